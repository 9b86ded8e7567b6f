/**
 * The cause verdict of an incident or explosion (the `incident` route's
 * `cause`), in the pieces the card places (incident_card.js): the label and
 * one-sentence summary of its headline, the remedy it leads with (the first:
 * shown to work, when one was) with its trial and code, the other remedies
 * (collapsed), and the evidence. Labels come from the vocabulary (vocabulary.js).
 * All text goes through `textContent` (dom.js).
 */
import { el } from "./dom.js";
import { fmt } from "./format.js";
import { renderSnippet } from "./repro_bundle.js";
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

/**
 * The evidence of a cause, as a list of names and values.
 * @param {{id: string, evidence?: Object}} cause The cause.
 * @returns {HTMLElement|null} The block (`.cause-evidence-box`), null without evidence.
 */
export function renderEvidence(cause) {
  const entries = Object.entries(cause.evidence || {});
  if (!entries.length) return null;
  return el("div", { class: "cause-evidence-box" }, [
    el("h4", { text: cause.id === "unknown" ? "What was seen" : "Evidence" }),
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

/**
 * One remedy of a cause as the card reads it. The routes send
 * `{id, text, code, trial}` (a combination: `together` too); a cause written
 * before remedy trials sends the text.
 * @param {{id?: string, text?: string, code?: string|null, trial?: Object|null}|string} remedy The remedy.
 * @param {string|undefined} id Its id from `remedy_ids` (older causes).
 * @returns {{id: string|undefined, text: string, code: string, trial: Object|null}} The remedy.
 */
export function remedyOf(remedy, id) {
  if (remedy && typeof remedy === "object") {
    const code = typeof remedy.code === "string" ? remedy.code : "";
    return { id: remedy.id ?? id, text: String(remedy.text ?? ""), code, trial: remedy.trial || null };
  }
  return { id, text: String(remedy ?? ""), code: "", trial: null };
}

/**
 * The line on a remedy's trial: Python's words ("Tried: clipnorm=1.0 kept 40
 * steps finite, …"), else the vocabulary's word for the outcome.
 * @param {{outcome?: string, text?: string, why?: string}} trial The remedy's trial.
 * @returns {string} e.g. "Tried, did not help: lr x0.1 over 4 steps".
 */
export function trialText(trial) {
  if (trial.text) return String(trial.text);
  const words = labelOf("trial_outcomes", trial.outcome);
  return trial.why ? `${words}: ${trial.why}` : words;
}

function renderRemedy(remedy, rank) {
  const trial = remedy.trial;
  const outcome = trial ? String(trial.outcome) : "none";
  return el("li", { class: "remedy", data: { rank, remedy: remedy.id, outcome } }, [
    el("span", { class: "remedy-text", text: remedy.text }),
    trial ? el("div", { class: "remedy-trial", data: { outcome }, text: trialText(trial) }) : null,
    remedy.code ? renderSnippet(remedy.code, "remedy-code", "copy-remedy-code") : null,
  ]);
}

/**
 * The heading over the remedy the card leads with: whether it was shown to
 * work, or that no remedy tried fixed the run.
 * @param {Array<{trial: Object|null}>} listed The remedies, as remedyOf reads them, best first.
 * @returns {string} e.g. "Shown to work on a re-run of your steps".
 */
export function remediesHeading(listed) {
  const outcomes = listed.map((remedy) => remedy.trial && String(remedy.trial.outcome));
  if (outcomes.includes("fixed")) return "Shown to work on a re-run of your steps";
  if (outcomes.includes("not_fixed")) return "Nothing we tried fixed the run; what to try first";
  if (outcomes.some(Boolean)) return "What to try first (untested: no remedy trial could run)";
  return "What to try first";
}

/** The cause's remedies as the card reads them, best first. */
const listedRemedies = (cause) => (cause.remedies || []).map((remedy, i) => remedyOf(remedy, cause.remedy_ids?.[i]));

/**
 * The one remedy the card leads with (the first: the ranking puts the fixes
 * that worked first), with its trial's result and its code to paste.
 * @param {{remedies?: Array<Object|string>, remedy_ids?: string[]}} cause The cause.
 * @returns {HTMLElement|null} The block (`.lead-remedy`), null without remedies.
 */
export function renderLeadRemedy(cause) {
  const listed = listedRemedies(cause);
  if (!listed.length) return null;
  return el("section", { class: "lead-remedy", data: { field: "lead-remedy", outcome: listed[0].trial?.outcome ?? "none" } }, [
    el("h4", { data: { field: "lead-heading" }, text: remediesHeading(listed) }),
    el("ol", { class: "remedies remedies-lead" }, [renderRemedy(listed[0], 1)]),
  ]);
}

/**
 * The remedies after the first, collapsed: "Other things we tried (3)"
 * ("to try" when none of them was tried).
 * @param {{remedies?: Array<Object|string>, remedy_ids?: string[]}} cause The cause.
 * @returns {HTMLElement|null} The `<details class="other-remedies">`, null with one remedy or none.
 */
export function renderOtherRemedies(cause) {
  const others = listedRemedies(cause).slice(1);
  if (!others.length) return null;
  const tried = others.some((remedy) => remedy.trial && remedy.trial.outcome !== "not_tried");
  return el("details", { class: "other-remedies", data: { field: "other-remedies" } }, [
    el("summary", { text: `Other things ${tried ? "we tried" : "to try"} (${others.length})` }),
    el("ol", { class: "remedies", attrs: { start: 2 } }, others.map((remedy, i) => renderRemedy(remedy, i + 2))),
  ]);
}

/**
 * The cause in the card's headline: its label and its one-sentence summary.
 * `unknown` says plainly that no known cause fits.
 * @param {{id: string, summary?: string}} cause The cause.
 * @returns {HTMLElement} The line (`.cause[data-cause=ID]`).
 */
export function renderCauseLine(cause) {
  const unknown = cause.id === "unknown";
  return el("div", { class: "cause", data: { cause: cause.id } }, [
    el("span", { class: "cause-label", data: { field: "cause-label" } }, [
      unknown ? "Cause unknown: the evidence fits no known cause" : `Cause: ${causeLabel(cause.id)}`,
    ]),
    cause.summary ? el("p", { class: "cause-summary", data: { field: "cause-summary" }, text: cause.summary }) : null,
  ]);
}
