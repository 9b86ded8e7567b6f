/**
 * A run's early warnings (raised before the NaN): their timeline markers and
 * the card's warnings block. Their words are the run's own (each warning's
 * message, set as text, never HTML); this module only lays them out.
 */

import { el } from "./dom.js";

/**
 * The well-formed warnings of a route answer (`timeline` or `incident`).
 * @param {Object} body The answer.
 * @returns {Array<Object>} Warnings with a numeric step, in step order.
 */
export function warningsOf(body) {
  const list = body && Array.isArray(body.warnings) ? body.warnings : [];
  return list.filter((w) => w && typeof w.step === "number" && typeof w.kind === "string").sort((a, b) => a.step - b.step);
}

/**
 * What a warning foresees, in a few words: "predicted step 48 (33 steps ahead)".
 * @param {Object} w The warning.
 * @returns {string} The words, "" without a predicted step.
 */
export function foreseen(w) {
  if (typeof w.predicted_step !== "number") return "";
  const ahead = w.predicted_step - w.step;
  return `predicted step ${w.predicted_step}${ahead > 0 ? ` (${ahead} step${ahead === 1 ? "" : "s"} ahead)` : ""}`;
}

/**
 * The timeline's marker lines of the warnings, one a warning at its step.
 * @param {Object} tl The `timeline` answer.
 * @returns {Array<{step: number, text: string}>} The markers.
 */
export function warningMarks(tl) {
  return warningsOf(tl).map((w) => {
    const ahead = foreseen(w);
    return { step: w.step, text: `warning ${w.kind}: step ${w.step}${ahead ? `, ${ahead}` : ""}` };
  });
}

/**
 * The card's block of early warnings, or null when the run raised none.
 * @param {Array<Object>|undefined} warnings The `incident` answer's warnings.
 * @returns {HTMLElement|null} The block.
 */
export function renderWarnings(warnings) {
  const list = warningsOf({ warnings });
  if (!list.length) return null;
  const items = list.map((w) => {
    const ahead = foreseen(w);
    return el("li", { class: "card-warning", data: { kind: w.kind, step: w.step, outlived: w.outlived === true ? "true" : null } }, [
      el("span", { class: "warning-kind", text: w.kind }),
      ` at step ${w.step}${ahead ? `, ${ahead}` : ""}: `,
      el("span", { class: "warning-message", text: typeof w.message === "string" ? w.message : "" }),
      w.outlived === true ? el("span", { class: "warning-outlived", text: " (the run outlived it)" }) : null,
    ]);
  });
  const title = list.length === 1 ? "Early warning" : `Early warnings (${list.length})`;
  return el("section", { class: "card-warnings", data: { field: "warnings" } }, [el("h4", { class: "card-warnings-title", text: title }), el("ul", {}, items)]);
}
