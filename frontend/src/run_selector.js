/** Run selector: pick one or several runs to show side by side. */
import { causeLine } from "./cause.js";
import { breakableName, el, clear } from "./dom.js";
import { counted } from "./format.js";
import { kindLabel, phaseLabel } from "./vocabulary.js";

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
    parts.push(`first ${kindLabel(inc.kind)} at step ${inc.step} (${phaseLabel(inc.phase)}${where})`);
  }
  if (run.explosion) {
    if (state === "healthy") state = "explosion";
    parts.push(`explosion from step ${run.explosion.step} (${run.explosion.signal})`);
  }
  if (!parts.length) parts.push("healthy: no NaN/Inf");
  parts.push(`${counted(run.steps, "step")}, ${run.status}`);
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
 * The run filter's test, like TensorBoard's run filter: a case-insensitive
 * regular expression, or plain text while the expression is not valid.
 * @param {string} text The filter box's text.
 * @returns {{matches: (name: string) => boolean, valid: boolean}} Test and validity.
 */
export function runFilter(text) {
  if (!text) return { matches: () => true, valid: true };
  try {
    const re = new RegExp(text, "i");
    return { matches: (name) => re.test(name), valid: true };
  } catch (_) {
    const lower = text.toLowerCase();
    return { matches: (name) => name.toLowerCase().includes(lower), valid: false };
  }
}

/**
 * Creates the run selector: a filter box (kept across updates) and the list.
 * @param {HTMLElement} container Where to render (emptied first).
 * @param {(selected: string[]) => void} onChange Called with the new selection.
 * @param {(matches: (name: string) => boolean) => void} [onFilter] Called with
 *   the filter's test whenever the list is drawn (the panels of runs it hides are hidden too).
 * @returns {{update: (runs: Array<Object>, selected: string[]) => void}} Selector.
 */
export function createRunSelector(container, onChange, onFilter = () => {}) {
  clear(container);
  const filterBox = el("input", {
    class: "run-filter",
    attrs: { type: "search", placeholder: "Filter runs (regex)", "aria-label": "Filter runs (regular expression)", spellcheck: "false" },
    data: { field: "run-filter" },
  });
  const count = el("div", { class: "muted run-count", data: { field: "run-count" } });
  const listBox = el("div", { class: "run-list-box" });
  container.append(el("h2", { text: "Runs" }), filterBox, count, listBox);
  let runs = [];
  let chosen = new Set();

  function renderList() {
    clear(listBox);
    if (!runs.length) {
      count.textContent = "";
      listBox.append(el("p", { class: "muted", text: "No NaN Watch runs found in the log directory." }));
      return;
    }
    const filter = runFilter(filterBox.value);
    onFilter(filter.matches);
    filterBox.classList.toggle("invalid", !filter.valid);
    filterBox.title = filter.valid ? "" : "Not a valid regular expression: matching it as plain text";
    const shown = runs.filter((r) => filter.matches(r.run));
    count.textContent = shown.length === runs.length ? counted(runs.length, "run") : `${shown.length} of ${counted(runs.length, "run")} match`;
    const list = el("ul", { class: "run-list" });
    for (const run of shown) {
      const status = runStatus(run);
      const cause = causeLine(run.cause);
      const box = el("input", { attrs: { type: "checkbox", checked: chosen.has(run.run) } });
      box.addEventListener("change", () => {
        if (box.checked) chosen.add(run.run);
        else chosen.delete(run.run);
        onChange(runs.map((r) => r.run).filter((name) => chosen.has(name)));
      });
      list.append(
        el("li", { class: `run-item state-${status.state}`, data: { run: run.run, state: status.state } }, [
          el("label", {}, [box, el("span", { class: "run-name", title: run.run }, breakableName(run.run))]),
          el("div", { class: "run-status", data: { field: "status" }, text: status.text }),
          cause ? el("div", { class: "run-cause", data: { field: "cause", cause: run.cause.id }, text: cause, title: cause }) : null,
        ]),
      );
    }
    listBox.append(list);
  }

  filterBox.addEventListener("input", renderList);
  return {
    update(nextRuns, selected) {
      runs = nextRuns;
      chosen = new Set(selected);
      renderList();
    },
  };
}
