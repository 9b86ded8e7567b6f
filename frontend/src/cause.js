/**
 * The cause verdict of an incident or explosion (the `incident` route's
 * `cause`): a label for its id, the one-sentence summary, the evidence and
 * the remedies, best first. Labels come from the vocabulary (vocabulary.js).
 * All text goes through `textContent` (dom.js).
 */
import { el } from "./dom.js";
import { fmt } from "./format.js";
import { labelOf } from "./vocabulary.js";

/** The most list items an evidence value shows before "… (N more)". */
const MAX_LIST_ITEMS = 12;

/**
 * @param {string} id A cause id.
 * @returns {string} Its label in the vocabulary; an id outside it reads as itself.
 */
export const causeLabel = (id) => labelOf("causes", id);

/**
 * Readable text of one evidence value: numbers as elsewhere in the tab
 * (NaN/Inf kept), lists joined, booleans as yes/no.
 * @param {*} value A number, string, boolean, list or object.
 * @returns {string} e.g. "1.4e29", "3, 17, 42", "yes".
 */
export function evidenceText(value) {
  if (typeof value === "number") return fmt(value);
  if (typeof value === "boolean") return value ? "yes" : "no";
  if (value === null || value === undefined) return "–";
  if (Array.isArray(value)) {
    const shown = value.slice(0, MAX_LIST_ITEMS).map(evidenceText).join(", ");
    const more = value.length - MAX_LIST_ITEMS;
    return more > 0 ? `${shown}, … (${more} more)` : shown;
  }
  if (typeof value === "object") {
    return Object.entries(value)
      .map(([k, v]) => `${k}: ${evidenceText(v)}`)
      .join("; ");
  }
  return String(value);
}

/**
 * @param {string} name An evidence name, e.g. "growth_factor".
 * @returns {string} e.g. "growth factor".
 */
export const evidenceName = (name) => String(name).replace(/_/g, " ");

/**
 * One line for the run list: the cause's label and its summary.
 * @param {{id: string, summary?: string}|null|undefined} cause The `runs` entry's cause.
 * @returns {string|null} e.g. "Overflow after growth: the loss grew …", null without a cause.
 */
export function causeLine(cause) {
  if (!cause) return null;
  return cause.summary ? `${causeLabel(cause.id)}: ${cause.summary}` : causeLabel(cause.id);
}

function renderEvidence(evidence, unknown) {
  const entries = Object.entries(evidence || {});
  if (!entries.length) return null;
  return el("div", { class: "cause-evidence-box" }, [
    el("h4", { text: unknown ? "What was seen" : "Evidence" }),
    el(
      "dl",
      { class: "cause-evidence" },
      entries.map(([name, value]) =>
        el("div", { class: "field" }, [
          el("dt", { text: evidenceName(name) }),
          el("dd", { data: { evidence: name }, text: evidenceText(value) }),
        ]),
      ),
    ),
  ]);
}

function renderRemedies(remedies, ids) {
  if (!remedies || !remedies.length) return null;
  return el("div", { class: "cause-remedies-box" }, [
    el("h4", { text: "What to try, best first" }),
    el(
      "ol",
      { class: "remedies" },
      remedies.map((text, i) => el("li", { class: "remedy", data: { rank: i + 1, remedy: ids?.[i] }, text })),
    ),
  ]);
}

/**
 * The cause block that leads the incident card: label, summary sentence,
 * evidence, ranked remedies. `unknown` says plainly that no known cause fits.
 * @param {{id: string, summary?: string, evidence?: Object, remedies?: string[], remedy_ids?: string[]}} cause
 *   The cause; `remedy_ids` name the remedies (`li[data-remedy=ID]`).
 * @returns {HTMLElement} The block (`.cause[data-cause=ID]`).
 */
export function renderCause(cause) {
  const unknown = cause.id === "unknown";
  return el("section", { class: "cause", data: { cause: cause.id } }, [
    el("div", { class: "cause-label", data: { field: "cause-label" } }, [
      unknown ? "Cause unknown: the evidence fits no known cause" : `Cause: ${causeLabel(cause.id)}`,
    ]),
    cause.summary ? el("p", { class: "cause-summary", data: { field: "cause-summary" }, text: cause.summary }) : null,
    renderEvidence(cause.evidence, unknown),
    renderRemedies(cause.remedies, cause.remedy_ids),
  ]);
}
