/**
 * Downloads of a run's timeline as CSV or JSON. Non-finite values are kept,
 * written as the routes write them (the vocabulary's `non_finite`: "NaN",
 * "Infinity", "-Infinity"); a missing value is an empty CSV cell / JSON null.
 * CSV cells that a spreadsheet would run as formulas are written as text (csv.js).
 */
import { csvCell } from "./csv.js";
import { nonFiniteWord } from "./vocabulary.js";

/**
 * A number as text for a file: full precision, non-finite as a word.
 * @param {*} v The value.
 * @returns {string|null} Its text, null for a missing value.
 */
function numberText(v) {
  if (v === null || v === undefined) return null;
  if (typeof v !== "number") return String(v);
  return Number.isFinite(v) ? String(v) : nonFiniteWord(v);
}

/**
 * The timeline as CSV: one row per point; `step` is the point's first step,
 * and `last_step` its last when a point stands for several steps.
 * @param {Object} tl A `timeline` response (non-finite values revived).
 * @returns {string} CSV text, header first, "\n" line ends.
 */
export function timelineCsv(tl) {
  const names = Object.keys(tl.columns);
  const bucketed = tl.bucket > 1;
  const header = ["step", ...(bucketed ? ["last_step"] : []), ...names];
  const lines = [header.map(csvCell).join(",")];
  tl.steps.forEach((step, i) => {
    const last = Math.min(step + tl.bucket, tl.end) - 1;
    const cells = [String(step), ...(bucketed ? [String(last)] : [])];
    for (const name of names) cells.push(csvCell(numberText(tl.columns[name][i])));
    lines.push(cells.join(","));
  });
  return `${lines.join("\n")}\n`;
}

/**
 * The timeline as JSON, in the route's own shape and words for non-finite values.
 * @param {Object} tl A `timeline` response (non-finite values revived).
 * @returns {string} JSON text.
 */
export function timelineJson(tl) {
  return JSON.stringify(tl, (key, v) => (typeof v === "number" && !Number.isFinite(v) ? numberText(v) : v), 1);
}

/**
 * A file name for a run's download: the run name with unsafe characters replaced.
 * @param {string} run Run name.
 * @param {string} extension "csv" or "json".
 * @returns {string} e.g. "mnist_run1-timeline.csv".
 */
export function downloadName(run, extension) {
  const safe = String(run).replace(/[^A-Za-z0-9._-]+/g, "_").replace(/^[._]+/, "") || "run";
  return `${safe}-timeline.${extension}`;
}

/**
 * Makes the browser save `text` as a file.
 * @param {string} name File name.
 * @param {string} text Content.
 * @param {string} type MIME type.
 */
export function saveText(name, text, type) {
  const url = URL.createObjectURL(new Blob([text], { type }));
  const link = document.createElement("a");
  link.href = url;
  link.download = name;
  document.body.append(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10_000);
}
