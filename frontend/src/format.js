/** Number and path formatting shared by the views. */

/**
 * Formats a number for display; non-finite values read "NaN", "Inf", "-Inf".
 * @param {number|null|undefined} v The value.
 * @param {number} [digits] Significant digits.
 * @returns {string} The text ("–" for null).
 */
export function fmt(v, digits = 4) {
  if (v === null || v === undefined) return "–";
  if (typeof v !== "number") return String(v);
  if (Number.isNaN(v)) return "NaN";
  if (v === Infinity) return "Inf";
  if (v === -Infinity) return "-Inf";
  if (v === 0) return "0";
  if (Number.isInteger(v) && Math.abs(v) < 1e9) return String(v);
  const a = Math.abs(v);
  if (a >= 1e5 || a < 1e-3) return v.toExponential(digits - 1).replace("e+", "e");
  return String(Number(v.toPrecision(digits)));
}

/**
 * @param {*} v A value.
 * @returns {boolean} True when `v` is NaN or ±Infinity.
 */
export const isNonFinite = (v) => typeof v === "number" && !Number.isFinite(v);

/**
 * Classifies a non-finite value.
 * @param {number} v The value.
 * @returns {"nan"|"posinf"|"neginf"|null} Its kind, null if finite or not a number.
 */
export function nonFiniteKind(v) {
  if (typeof v !== "number") return null;
  if (Number.isNaN(v)) return "nan";
  if (v === Infinity) return "posinf";
  if (v === -Infinity) return "neginf";
  return null;
}

/**
 * Shortens a layer path from the left, keeping its (most specific) end.
 * @param {string} path e.g. "model/backbone/block2_conv".
 * @param {number} [max] Maximum characters.
 * @returns {string} e.g. "…backbone/block2_conv".
 */
export function truncateLeft(path, max = 32) {
  const s = String(path ?? "");
  return s.length <= max ? s : `…${s.slice(s.length - max + 1)}`;
}

/**
 * A count with its noun: "1 step", "2 steps", "0 runs".
 * @param {number} n The count.
 * @param {string} one The noun for one.
 * @param {string} [many] The noun for other counts (default: `one` + "s").
 * @returns {string} The text.
 */
export function counted(n, one, many = `${one}s`) {
  return `${n} ${n === 1 ? one : many}`;
}
