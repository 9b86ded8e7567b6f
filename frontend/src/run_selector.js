/** Run selector: pick one or several runs to show side by side. */
import { el, clear } from "./dom.js";
import { kindLabel } from "./format.js";

/**
 * One-line status of a run from the `runs` route.
 * @param {Object} run An entry of `runs`.
 * @returns {{text: string, state: "nonfinite"|"explosion"|"healthy"}} Status text and state.
 */
export function runStatus(run) {
  const parts = [];
  let state = "healthy";
  const inc = run.first_nonfinite;
  if (inc) {
    state = "nonfinite";
    const where = inc.layer ? ` in ${inc.layer}` : "";
    parts.push(`first ${kindLabel(inc.kind)} at step ${inc.step} (${inc.phase}${where})`);
  }
  if (run.explosion) {
    if (state === "healthy") state = "explosion";
    parts.push(`explosion from step ${run.explosion.step} (${run.explosion.signal})`);
  }
  if (!parts.length) parts.push("healthy: no NaN/Inf");
  parts.push(`${run.steps} steps, ${run.status}`);
  if (run.skipped_count) parts.push(`${run.skipped_count} skipped`);
  return { text: parts.join(" · "), state };
}

/**
 * Default selection: the first broken run, plus the first healthy one to compare with.
 * @param {Array<Object>} runs Entries of the `runs` route.
 * @returns {string[]} Selected run names.
 */
export function defaultSelection(runs) {
  const broken = runs.find((r) => r.first_nonfinite) || runs.find((r) => r.explosion);
  const healthy = runs.find((r) => !r.first_nonfinite && !r.explosion);
  const picked = [broken, healthy].filter(Boolean).map((r) => r.run);
  return picked.length ? picked : runs.slice(0, 1).map((r) => r.run);
}

/**
 * Renders the run selector.
 * @param {HTMLElement} container Where to render (emptied first).
 * @param {Array<Object>} runs Entries of the `runs` route.
 * @param {string[]} selected Currently selected run names.
 * @param {(selected: string[]) => void} onChange Called with the new selection.
 */
export function renderRunSelector(container, runs, selected, onChange) {
  clear(container);
  container.append(el("h2", { text: "Runs" }));
  if (!runs.length) {
    container.append(el("p", { class: "muted", text: "No NaN Watch runs found in the log directory." }));
    return;
  }
  const chosen = new Set(selected);
  const list = el("ul", { class: "run-list" });
  for (const run of runs) {
    const status = runStatus(run);
    const box = el("input", { attrs: { type: "checkbox", checked: chosen.has(run.run) } });
    box.addEventListener("change", () => {
      if (box.checked) chosen.add(run.run);
      else chosen.delete(run.run);
      onChange(runs.map((r) => r.run).filter((name) => chosen.has(name)));
    });
    list.append(
      el("li", { class: `run-item state-${status.state}`, data: { run: run.run, state: status.state } }, [
        el("label", {}, [
          box,
          el("span", { class: "run-name", text: run.run, title: run.run }),
        ]),
        el("div", { class: "run-status", data: { field: "status" }, text: status.text }),
      ]),
    );
  }
  container.append(list);
}
