/**
 * Incident card: why, where and when the first NaN/Inf was born, in order of
 * weight. First the headline (what, step, phase, layer and the cause in one
 * sentence), then the one remedy shown to work (the first: its trial's
 * result and its code to paste), then the other remedies collapsed, then, in
 * a lighter block, the evidence and the details (op and source line, the
 * recorded fields, the explosion's numbers, the reproduction bundle, hints).
 * Shows a "healthy" card when the run has no incident, and an explosion card
 * when the run only blew up without producing a NaN/Inf.
 */
import { evidenceText, renderCauseLine, renderEvidence, renderLeadRemedy, renderOtherRemedies } from "./cause.js";
import { el, clear } from "./dom.js";
import { counted, fmt } from "./format.js";
import { renderBundle } from "./repro_bundle.js";
import { nearestSteps } from "./step_table.js";
import { kindLabel, phaseLabel } from "./vocabulary.js";
import { renderWarnings } from "./warnings.js";

/** Appends the non-null nodes. */
function append(container, ...nodes) {
  for (const node of nodes) if (node) container.append(node);
}

/** Whether a card value is there to show (null, undefined and "" are not). */
const present = (value) => value !== null && value !== undefined && value !== "";

/**
 * One field of the card's details, or null when it has no value: a card
 * shows only what was recorded.
 */
function field(name, label, value) {
  if (!present(value)) return null;
  return el("div", { class: "field" }, [el("dt", { text: label }), el("dd", { data: { field: name }, text: String(value) })]);
}

/**
 * The op that made the first non-finite value, from the replay:
 * "op Log (name model/dense_3/Log) at model.py:42"; only the parts it named.
 * @param {{type?: string, name?: string, source?: string|null, reproduced?: boolean}|null|undefined} op The op.
 * @returns {HTMLElement|null} The line; null without an op, or with an empty
 *   one that the replay did not try.
 */
/** Why the card names no op: the record's reason (e.g. a loop without loss_fn=), else the replay's. */
export function opNotNamed(op) {
  if (present(op.why)) return `No op is named: ${op.why}.`;
  return "The replay did not reproduce the non-finite value, so no op is named.";
}

function renderOp(op) {
  if (!op) return null;
  const notReproduced = op.reproduced === false;
  if (!present(op.type) && !present(op.name) && !present(op.source)) {
    if (!notReproduced) return null;
    return el("p", { class: "card-op card-note", data: { field: "op", reproduced: false } }, [
      el("span", { data: { field: "not-reproduced" }, text: opNotNamed(op) }),
    ]);
  }
  const parts = [];
  if (present(op.type)) parts.push("op ", el("code", { data: { field: "op-type" }, text: op.type }));
  if (present(op.name)) parts.push(parts.length ? " (name " : "op ", el("code", { data: { field: "op-name" }, text: op.name }), parts.length ? ")" : "");
  if (present(op.source)) parts.push(parts.length ? " at " : "source line ", el("code", { data: { field: "op-source" }, text: op.source }));
  if (notReproduced) parts.push(el("span", { class: "card-note", data: { field: "not-reproduced" }, text: " · not reproduced by the replay" }));
  return el("p", { class: "card-op", data: { field: "op", reproduced: op.reproduced } }, parts);
}

/**
 * The explosion's growth, with what the ratio is: the signal's value when
 * the explosion was confirmed over its reference level before the onset.
 * @param {Object} exp The explosion (`factor`, and `value`/`reference` when recorded).
 * @returns {HTMLElement|null} The line, null without a ratio.
 */
function renderGrowth(exp) {
  if (typeof exp.factor !== "number") return null;
  const what = exp.layer ? `the ${exp.signal} of ${exp.layer}` : `the ${exp.signal}`;
  const known = typeof exp.value === "number" && typeof exp.reference === "number";
  return el("p", { class: "card-def", data: { field: "growth" } }, [
    "Growth: ",
    el("strong", { data: { field: "growth-factor" }, text: `×${fmt(exp.factor)}` }),
    ` = ${what} when the explosion was confirmed${known ? ` (${fmt(exp.value)})` : ""}`,
    ` ÷ its reference level before the onset${known ? ` (${fmt(exp.reference)})` : ""}`,
    ", the lowest running median of the earlier steps.",
  ]);
}

/**
 * The learning-rate jump in the steps before the onset, when one was recorded.
 * @param {Object} exp The explosion, with `lr_change: {step, from, to}`.
 * @returns {HTMLElement|null} The line.
 */
function renderLrChange(exp) {
  const change = exp.lr_change;
  if (!change || typeof change.from !== "number" || typeof change.to !== "number") return null;
  const verb = change.to > change.from ? "jumped" : "dropped";
  const before = exp.step - change.step;
  const when = before > 0 ? `, ${counted(before, "step")} before the onset` : ", at the onset";
  return el("p", { class: "card-note", data: { field: "lr-change", step: change.step } }, [
    `The learning rate ${verb} from ${fmt(change.from)} to ${fmt(change.to)} at step ${change.step}${when}.`,
  ]);
}

function renderHints(hints) {
  if (!hints || !hints.length) return null;
  const list = el("ol", { class: "hints" });
  for (const hint of hints) {
    const evidence = Object.entries(hint.evidence || {}).filter(([, v]) => present(v));
    list.append(
      el("li", { class: "hint", data: { hint: hint.id } }, [
        el("div", { class: "hint-title", text: hint.title }),
        el("div", { class: "hint-text", text: hint.text }),
        evidence.length
          ? el(
              "dl",
              { class: "hint-evidence" },
              evidence.map(([k, v]) =>
                el("div", { class: "field" }, [
                  el("dt", { text: k }),
                  el("dd", { data: { evidence: k }, text: typeof v === "number" ? fmt(v, 6) : evidenceText(v) }),
                ]),
              ),
            )
          : null,
      ]),
    );
  }
  return el("div", { class: "hints-box" }, [el("h4", { text: "Hints" }), list]);
}

/**
 * The headline's first line for an incident: "First Inf at step 37, born in
 * the forward phase at layer model/dense_3".
 */
function incidentTitle(inc) {
  const where = inc.layer ? [" at layer ", el("code", { data: { field: "headline-layer" }, text: inc.layer })] : [];
  return el("h3", { class: "card-title" }, [
    `First ${kindLabel(inc.kind)} at step ${inc.step}`,
    present(inc.phase) ? `, born in the ${phaseLabel(inc.phase)} phase` : "",
    ...where,
  ]);
}

/** The details of an incident, for the card's lighter block. */
function incidentDetails(inc, exp, goto) {
  return [
    renderOp(inc.op),
    el("dl", { class: "fields" }, [
      field("step", "step", inc.step),
      field("epoch", "epoch", inc.epoch),
      field("batch", "batch", inc.batch),
      field("phase", "phase", present(inc.phase) ? phaseLabel(inc.phase) : null),
      field("layer", "layer", inc.layer),
      field("tensor", "tensor", inc.tensor),
      field("kind", "NaN / Inf", present(inc.kind) ? kindLabel(inc.kind) : null),
      field("iterations", "optimizer iterations", inc.iterations),
      field("loss", "loss", present(inc.loss) ? fmt(inc.loss) : null),
    ]),
    inc.note ? el("p", { class: "card-note", data: { field: "note" }, text: inc.note }) : null,
    exp ? el("p", { class: "card-note", data: { field: "explosion" }, text: explosionNote(inc, exp) }) : null,
    exp ? renderLrChange(exp) : null,
    exp ? renderGrowth(exp) : null,
    goto(inc.step),
  ];
}

/** The incident card's line on the explosion onset: "before it" only when it was. */
export function explosionNote(inc, exp) {
  if (exp.step === inc.step) return `The explosion and the incident are the same step (${exp.signal}).`;
  const when = exp.step < inc.step ? "before it" : "after it";
  return `Explosion onset ${when}: step ${exp.step} (${exp.signal}).`;
}

/** The headline's first line for a run that exploded without a NaN/Inf. */
function explosionTitle(exp) {
  if (!exp) return el("h3", { class: "card-title", text: "No NaN or Inf recorded" });
  const what = exp.layer ? `the ${exp.signal} of ${exp.layer}` : `the ${exp.signal}`;
  return el("h3", { class: "card-title", text: `Explosion from step ${exp.step}: ${what} started to blow up, no NaN or Inf yet` });
}

/** The details of an explosion, for the card's lighter block. */
function explosionDetails(exp, goto) {
  if (!exp) return [];
  return [
    el("dl", { class: "fields" }, [field("step", "onset step", exp.step), field("signal", "signal", exp.signal), field("layer", "layer", exp.layer)]),
    renderLrChange(exp),
    renderGrowth(exp),
    goto(exp.step),
  ];
}

/**
 * The card's lighter block: the evidence, the details, the bundle and the
 * hints (null when there is none of them).
 */
function renderMore(parts) {
  const shown = parts.filter(Boolean);
  if (!shown.length) return null;
  return el("section", { class: "card-more", data: { field: "details" } }, [el("h4", { class: "card-more-title", text: "Evidence and details" }), ...shown]);
}

/**
 * Renders the card for one run.
 * @param {HTMLElement} container Element to render into (gets data-state).
 * @param {Object} data The `incident` route response; `cause` and `bundle`
 *   (and the incident's `op`) are optional: older runs have none.
 * @param {{onStepClick?: (step: number) => void, recorded?: number[]}} [opts]
 *   `recorded`: the steps with a per-layer record; a step without one gets no
 *   "Show layers" link but a line saying so, with a link to the nearest recorded step.
 */
export function renderIncidentCard(container, data, opts = {}) {
  clear(container);
  container.classList.add("incident-card");
  const { incident: inc, explosion: exp, cause, bundle } = data;
  const button = (step) =>
    el("button", { class: "btn link", text: `Show layers at step ${step}`, data: { action: "show-step", step }, on: { click: () => opts.onStepClick(step) } });
  const goto = (step) => {
    if (!opts.onStepClick) return null;
    const recorded = opts.recorded || [];
    if (recorded.includes(step)) return button(step);
    const [near] = nearestSteps(recorded, step, 1);
    return el("p", { class: "card-note", data: { field: "no-record" } }, [
      `Step ${step} has no per-layer record (only the flight-recorder window and periodic snapshots are kept)`,
      ...(near === undefined ? ["."] : ["; nearest recorded: ", button(near)]),
    ]);
  };

  let title;
  let details = [];
  if (inc) {
    container.dataset.state = "nonfinite";
    title = incidentTitle(inc);
    details = incidentDetails(inc, exp, goto);
  } else if (exp || cause) {
    // A cause without an incident is an explosion's (a run is never "healthy" with a cause).
    container.dataset.state = "explosion";
    title = explosionTitle(exp);
    details = explosionDetails(exp, goto);
  } else {
    container.dataset.state = "healthy";
    title = el("h3", { class: "card-title", text: "Healthy" });
    details = [el("p", { class: "card-summary", text: "No NaN or Inf and no explosion recorded in this run." })];
  }
  const headline = el("header", { class: "card-headline", data: { field: "headline" } }, [title, cause ? renderCauseLine(cause) : null]);
  const rest = [...details, bundle ? renderBundle(bundle) : null, renderHints(data.hints)];
  const warned = renderWarnings(data.warnings); // the early warnings, after what to do
  if (cause) {
    append(container, headline, renderLeadRemedy(cause), renderOtherRemedies(cause), warned, renderMore([renderEvidence(cause), ...rest]));
  } else {
    append(container, headline, warned, ...rest);
  }
}
