/**
 * Incident card: where and when the first NaN/Inf was born, with hints.
 * Shows a "healthy" card when the run has no incident, and an explosion card
 * when the run only blew up without producing a NaN/Inf.
 */
import { el, clear } from "./dom.js";
import { fmt, kindLabel } from "./format.js";
import { nearestSteps } from "./step_table.js";

/** Appends the non-null nodes. */
function append(container, ...nodes) {
  for (const node of nodes) if (node) container.append(node);
}

function field(name, label, value) {
  return el("div", { class: "field" }, [
    el("dt", { text: label }),
    el("dd", { data: { field: name }, text: value === null || value === undefined ? "–" : String(value) }),
  ]);
}

function renderHints(hints) {
  if (!hints || !hints.length) return null;
  const list = el("ol", { class: "hints" });
  for (const hint of hints) {
    const evidence = Object.entries(hint.evidence || {});
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
                  el("dd", { data: { evidence: k }, text: typeof v === "number" ? fmt(v, 6) : String(v) }),
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
 * Renders the card for one run.
 * @param {HTMLElement} container Element to render into (gets data-state).
 * @param {Object} data The `incident` route response.
 * @param {{onStepClick?: (step: number) => void, recorded?: number[]}} [opts]
 *   `recorded`: the steps with a per-layer record; a step without one gets no
 *   "Show layers" link but a line saying so, with a link to the nearest recorded step.
 */
export function renderIncidentCard(container, data, opts = {}) {
  clear(container);
  container.classList.add("incident-card");
  const inc = data.incident;
  const exp = data.explosion;
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

  if (inc) {
    container.dataset.state = "nonfinite";
    const where = inc.layer ? inc.layer : "(no single layer)";
    append(
      container,
      el("h3", { class: "card-title", text: `First ${kindLabel(inc.kind)} at step ${inc.step}` }),
      el("p", { class: "card-summary" }, [
        "Born in the ",
        el("strong", { text: inc.phase }),
        " phase at ",
        el("code", { text: where }),
        ` (${inc.tensor}).`,
      ]),
      el("dl", { class: "fields" }, [
        field("step", "step", inc.step),
        field("epoch", "epoch", inc.epoch),
        field("batch", "batch", inc.batch),
        field("phase", "phase", inc.phase),
        field("layer", "layer", inc.layer ?? "(none)"),
        field("tensor", "tensor", inc.tensor),
        field("kind", "NaN / Inf", kindLabel(inc.kind)),
        field("iterations", "optimizer iterations", inc.iterations),
        field("loss", "loss", fmt(inc.loss ?? null)),
      ]),
      inc.note ? el("p", { class: "card-note", data: { field: "note" }, text: inc.note }) : null,
      exp ? el("p", { class: "card-note", data: { field: "explosion" }, text: `Explosion onset before it: step ${exp.step} (${exp.signal}).` }) : null,
      goto(inc.step),
    );
  } else if (exp) {
    container.dataset.state = "explosion";
    append(
      container,
      el("h3", { class: "card-title", text: `Explosion from step ${exp.step}` }),
      el("p", { class: "card-summary", text: `No NaN/Inf was recorded, but ${exp.signal} started to blow up.` }),
      el("dl", { class: "fields" }, [field("step", "step", exp.step), field("signal", "signal", exp.signal)]),
      goto(exp.step),
    );
  } else {
    container.dataset.state = "healthy";
    container.append(
      el("h3", { class: "card-title", text: "Healthy" }),
      el("p", { class: "card-summary", text: "No NaN or Inf and no explosion recorded in this run." }),
    );
  }
  const hints = renderHints(data.hints);
  if (hints) container.append(hints);
}
