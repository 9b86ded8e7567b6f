/**
 * Entry point of the NaN Watch TensorBoard plugin. TensorBoard's plugin
 * iframe imports this module (relative to `<base href="plugin/nanwatch/">`)
 * and calls `render()`.
 */
import { fetchRuns } from "./api.js";
import { el, clear } from "./dom.js";
import { createRunPanel } from "./run_panel.js";
import { defaultSelection, renderRunSelector } from "./run_selector.js";

function ensureStylesheet() {
  if (document.querySelector("link[data-nanwatch-style]")) return;
  const link = document.createElement("link");
  link.rel = "stylesheet";
  link.href = "style.css"; // relative: resolves under the iframe's <base>
  link.dataset.nanwatchStyle = "";
  document.head.append(link);
}

/**
 * Builds the whole page inside the plugin iframe's body.
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

  function showPanels(names) {
    for (const p of panels) p.destroy();
    clear(panelsBox);
    panelsBox.dataset.count = String(names.length);
    if (!names.length) {
      panelsBox.append(el("p", { class: "muted", text: "Select one or more runs." }));
      panels = [];
      return;
    }
    panels = names.map((name, i) => createRunPanel(name, { primary: i === 0, syncKey: "nanwatch" }));
    for (const p of panels) panelsBox.append(p.node);
  }

  async function load() {
    status.textContent = "Loading runs…";
    root.dataset.state = "loading";
    let runs;
    try {
      runs = (await fetchRuns()).runs || [];
    } catch (err) {
      status.textContent = `Could not load runs: ${err.message}`;
      root.dataset.state = "error";
      return;
    }
    const names = new Set(runs.map((r) => r.run));
    selection = selection ? selection.filter((n) => names.has(n)) : defaultSelection(runs);
    renderRunSelector(selectorBox, runs, selection, (next) => {
      selection = next;
      showPanels(selection);
    });
    showPanels(selection);
    status.textContent = `${runs.length} run${runs.length === 1 ? "" : "s"}`;
    root.dataset.state = "ready";
  }

  reload.addEventListener("click", () => load());
  await load();
}
