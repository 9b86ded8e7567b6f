/**
 * Entry point of the NaN Watch TensorBoard plugin. TensorBoard's plugin
 * iframe imports this module (relative to `<base href="plugin/nanwatch/">`)
 * and calls `render()`.
 */
import { fetchRuns, fetchVocabulary } from "./api.js";
import { el, clear } from "./dom.js";
import { counted } from "./format.js";
import { createRunPanel } from "./run_panel.js";
import { createRunSelector, defaultSelection } from "./run_selector.js";
import { onTensorBoardReload } from "./tensorboard_host.js";
import { followTheme } from "./theme.js";
import { hasVocabulary, useVocabulary } from "./vocabulary.js";

function ensureStylesheet() {
  if (document.querySelector("link[data-nanwatch-style]")) return;
  const link = document.createElement("link");
  link.rel = "stylesheet";
  link.href = "style.css"; // relative: resolves under the iframe's <base>
  link.dataset.nanwatchStyle = "";
  document.head.append(link);
}

/**
 * Builds the whole page inside the plugin iframe's body. Loads the
 * vocabulary (labels, text keys, non-finite words) once, before any run. Follows
 * TensorBoard's dark mode, and reloads with TensorBoard (its reload button
 * and auto-reload): the runs list is fetched again and each shown run whose
 * entry changed (more steps, a new status or incident) is reloaded in place.
 * @returns {Promise<void>} Resolves when the run list is shown.
 */
export async function render() {
  ensureStylesheet();
  document.title = "NaN Watch";
  const selectorBox = el("aside", { attrs: { id: "run-selector" }, class: "run-selector" });
  const panelsBox = el("main", { attrs: { id: "panels" }, class: "panels" });
  const status = el("span", { class: "muted", attrs: { id: "app-status" } });
  const reload = el("button", { class: "btn", text: "Reload", data: { action: "reload" } });
  const root = el("div", { attrs: { id: "nanwatch" }, class: "nanwatch" }, [
    el("header", { class: "app-header" }, [el("h1", { text: "NaN Watch" }), reload, status]),
    el("div", { class: "app-body" }, [selectorBox, panelsBox]),
  ]);
  document.body.append(root);

  let panels = [];
  let selection = null;
  /** The `runs` entry each shown panel was loaded from, as JSON: run -> text. */
  let loadedFrom = new Map();
  let reloads = 0;

  function showPanels(names, runs) {
    for (const p of panels) p.destroy();
    clear(panelsBox);
    panelsBox.dataset.count = String(names.length);
    loadedFrom = new Map(runs.filter((r) => names.includes(r.run)).map((r) => [r.run, JSON.stringify(r)]));
    if (!names.length) {
      panelsBox.append(el("p", { class: "muted", text: "Select one or more runs." }));
      panels = [];
      return;
    }
    panels = names.map((name, i) => createRunPanel(name, { primary: i === 0, syncKey: "nanwatch" }));
    for (const p of panels) panelsBox.append(p.node);
  }

  /** Reloads the shown panels whose run changed; rebuilds them when the selection changed. */
  function updatePanels(names, runs) {
    const shownBefore = panelsBox.dataset.count !== undefined;
    const same = shownBefore && panels.length === names.length && names.every((n, i) => panels[i].run === n);
    if (!same) {
      showPanels(names, runs);
      return;
    }
    for (const panel of panels) {
      const entry = JSON.stringify(runs.find((r) => r.run === panel.run));
      if (entry === loadedFrom.get(panel.run)) continue;
      loadedFrom.set(panel.run, entry);
      panel.refresh();
    }
  }

  let latestRuns = [];
  /** The run filter's test: the panels of the runs it hides are hidden too. */
  let shownByFilter = () => true;
  const hiddenNote = el("p", { class: "muted", data: { field: "all-filtered" }, text: "The selected runs are hidden by the run filter." });
  function applyFilter() {
    for (const p of panels) p.node.hidden = !shownByFilter(p.run);
    hiddenNote.hidden = !panels.length || panels.some((p) => !p.node.hidden);
    if (!hiddenNote.isConnected) panelsBox.prepend(hiddenNote);
  }
  const selector = createRunSelector(
    selectorBox,
    (next) => {
      selection = next;
      showPanels(selection, latestRuns);
      applyFilter();
    },
    (matches) => {
      shownByFilter = matches;
      applyFilter();
    },
  );

  async function load() {
    status.textContent = "Loading runs…";
    root.dataset.state = "loading";
    let runs;
    try {
      if (!hasVocabulary()) useVocabulary(await fetchVocabulary());
    } catch (err) {
      status.textContent = `Could not load the tab's vocabulary: ${err.message}`;
      root.dataset.state = "error";
      return;
    }
    try {
      runs = (await fetchRuns()).runs || [];
    } catch (err) {
      status.textContent = `Could not load runs: ${err.message}`;
      root.dataset.state = "error";
      return;
    }
    latestRuns = runs;
    const names = new Set(runs.map((r) => r.run));
    selection = selection ? selection.filter((n) => names.has(n)) : defaultSelection(runs);
    selector.update(runs, selection);
    updatePanels(selection, runs);
    applyFilter();
    status.textContent = counted(runs.length, "run");
    root.dataset.state = "ready";
    root.dataset.reloads = String(reloads++);
  }

  followTheme(() => {
    for (const p of panels) p.redraw();
  });
  onTensorBoardReload(() => load());
  reload.addEventListener("click", () => load());
  await load();
}
