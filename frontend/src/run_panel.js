/**
 * One run's panel: incident card, timeline, heatmap and step table, wired so
 * that clicking a step anywhere loads that step's per-layer table.
 */
import { ApiError, fetchIncident, fetchStep } from "./api.js";
import { breakableName, el } from "./dom.js";
import { renderHeatmap } from "./heatmap.js";
import { renderIncidentCard } from "./incident_card.js";
import { renderStepError, renderStepLoading, renderStepMissing, renderStepTable } from "./step_table.js";
import { createTimeline } from "./timeline.js";

/**
 * Creates the panel of one run and starts loading its data.
 * @param {string} run Run name.
 * @param {{primary?: boolean, syncKey?: string}} [opts] `primary` gives the
 *   panel's parts stable ids (#incident-card, #timeline, #heatmap, #step-table).
 * @returns {{run: string, node: HTMLElement, ready: Promise<void>, showStep: (step: number) => void,
 *            refresh: () => Promise<void>, redraw: () => void, destroy: () => void}} The panel.
 */
export function createRunPanel(run, opts = {}) {
  const id = (name) => (opts.primary ? { id: name } : {});
  const card = el("div", { class: "incident-card card", attrs: id("incident-card") });
  const timelineBox = el("div", { class: "timeline", attrs: id("timeline") });
  const heatmapBox = el("div", { class: "heatmap", attrs: id("heatmap") });
  const tableBox = el("div", { class: "step-table", attrs: id("step-table"), data: { state: "idle" } });
  tableBox.append(el("p", { class: "muted", text: "Click a step on the timeline or a heatmap column to see its layers." }));
  const node = el("section", { class: "run-panel", data: { run } }, [
    el("h2", { class: "run-title", title: run }, breakableName(run)),
    card,
    el("h3", { class: "section-title", text: "Timeline" }),
    timelineBox,
    el("h3", { class: "section-title", text: "Flight recorder: layer × step" }),
    heatmapBox,
    el("h3", { class: "section-title", text: "Layers of one step" }),
    tableBox,
  ]);

  let heatmap = { setSelectedStep() {}, redraw() {} };
  let incident = null; // the `incident` route's incident (null when none)
  let stepSeq = 0;

  /**
   * Shows the per-layer table of a step.
   * @param {number} step The step.
   * @param {{scroll?: boolean}} [how] `scroll`: bring the table into view.
   */
  async function showStep(step, how = {}) {
    const mine = ++stepSeq;
    timeline.setSelectedStep(step);
    heatmap.setSelectedStep(step);
    const bringIntoView = () => how.scroll && tableBox.scrollIntoView({ block: "start" });
    const recorded = timeline.data ? timeline.data.recorded_steps || [] : null;
    // Ask only for recorded steps: an expected 404 would still log a console error.
    if (recorded && !recorded.includes(step)) {
      renderStepMissing(tableBox, step, recorded, showStep);
      bringIntoView();
      return;
    }
    renderStepLoading(tableBox, step);
    bringIntoView();
    try {
      const data = await fetchStep(run, step);
      if (mine !== stepSeq) return;
      renderStepTable(tableBox, data, incident);
      bringIntoView();
    } catch (err) {
      if (mine !== stepSeq) return;
      if (err instanceof ApiError && err.status === 404) renderStepMissing(tableBox, step, recorded || [], showStep);
      else renderStepError(tableBox, `Could not load step ${step}: ${err.message}`);
    }
  }

  const timeline = createTimeline(timelineBox, { run, syncKey: opts.syncKey, onStepClick: showStep });

  function showIncident(data) {
    incident = data.incident || null;
    const recorded = timeline.data ? timeline.data.recorded_steps || [] : [];
    renderIncidentCard(card, data, { recorded, onStepClick: (step) => showStep(step, { scroll: true }) });
    heatmap = renderHeatmap(heatmapBox, data.heatmap, { onStepClick: showStep });
  }

  async function load(loadTimeline) {
    const [data] = await Promise.all([fetchIncident(run).catch((err) => ({ error: err })), loadTimeline()]);
    if (data.error) {
      card.textContent = `Could not load the incident: ${data.error.message}`;
      card.dataset.state = "error";
      return;
    }
    showIncident(data);
  }

  card.dataset.state = "loading";
  card.append(el("p", { class: "muted", text: "Loading…" }));
  const failed = (err) => {
    card.textContent = `Could not load run: ${err.message}`;
    card.dataset.state = "error";
  };
  const ready = load(() => timeline.load()).catch(failed);

  return {
    run,
    node,
    ready,
    showStep,
    /** Loads the run again (it may have grown), keeping the zoom and the shown step. */
    refresh() {
      const step = tableBox.dataset.state === "ready" ? Number(tableBox.dataset.step) : null;
      return load(() => timeline.refresh())
        .then(() => step !== null && showStep(step))
        .catch(failed);
    },
    /** Draws the canvases again (new theme colours). */
    redraw() {
      timeline.redraw();
      heatmap.redraw();
    },
    destroy() {
      timeline.destroy();
    },
  };
}
