/**
 * Timeline view of one run: loss, global gradient norm and logit min/max per
 * step. Wires the data/zoom controller (timeline_data.js) to the drawing
 * (timeline_plot.js) and owns the toolbar, the key and the user's gestures.
 *
 * Red line: first non-finite step; orange dashed line: explosion onset; grey
 * bands: steps skipped by the loss scaler; blue line: the selected step.
 * Zoom by dragging, pan with shift+drag or the arrow buttons, reset with a
 * double-click or the button. Timelines created with the same `syncKey`
 * (runs side by side) share the hover cursor and zoom/pan/reset together.
 */
import uPlot from "uplot";
import { el, clear } from "./dom.js";
import { createTimelineData, stepOfPoint } from "./timeline_data.js";
import { HEIGHT, createPlot, magnitudeThreshold, toPlotData } from "./timeline_plot.js";

/** Timelines sharing a sync key zoom and pan together: syncKey -> Set of members. */
const GROUPS = new Map();

/**
 * Creates the timeline of one run.
 * @param {HTMLElement} container Element to render into (gets data-state, data-bucket, ...).
 * @param {{run: string, syncKey?: string, onStepClick?: (step: number) => void}} opts Options.
 * @returns {{load: () => Promise<Object>, setSelectedStep: (step: number|null) => void,
 *            resetZoom: () => Promise<void>, zoomTo: (start: number, end: number) => Promise<void>,
 *            destroy: () => void, get data(): Object|null, get plot(): Object|null}} Controller.
 */
export function createTimeline(container, opts) {
  const { run, onStepClick, syncKey } = opts;
  clear(container);
  container.classList.add("timeline");
  container.dataset.state = "loading";

  const resetBtn = el("button", { class: "btn", text: "Reset zoom", data: { action: "reset-zoom" } });
  const panLeft = el("button", { class: "btn", text: "◀", title: "Pan left", data: { action: "pan-left" } });
  const panRight = el("button", { class: "btn", text: "▶", title: "Pan right", data: { action: "pan-right" } });
  const info = el("span", { class: "timeline-info muted", data: { field: "range" } });
  const toolbar = el("div", { class: "timeline-toolbar" }, [
    resetBtn, panLeft, panRight, info,
  ]);
  const chartBox = el("div", { class: "timeline-chart" });
  const keyText = el("div", { class: "timeline-key muted" }, [
    el("span", { class: "mark mark-posinf", text: "▲" }), " +Inf  ",
    el("span", { class: "mark mark-neginf", text: "▼" }), " -Inf  ",
    el("span", { class: "mark mark-nan", text: "◆" }), " NaN (at the plot edge)  ",
    el("span", { class: "swatch swatch-first" }), " first non-finite  ",
    el("span", { class: "swatch swatch-explosion" }), " explosion onset  ",
    el("span", { class: "swatch swatch-skipped" }), " skipped steps · ",
    "drag: zoom · shift+drag: pan · double-click: reset · click: layers of that step",
  ]);
  container.append(toolbar, chartBox, keyText);

  let u = null;
  let selectedStep = null;
  let panning = null;
  let downX = null;
  const resizeObserver = typeof ResizeObserver === "function" ? new ResizeObserver(() => resize()) : null;

  const data = createTimelineData(run, {
    onState(state, message) {
      container.dataset.state = state;
      if (message) info.textContent = message;
    },
    onRange(tl, { min, max }) {
      if (!u) return;
      u.setData(toPlotData(tl), false);
      u.setScale("x", { min, max });
      setInfo();
    },
  });

  function setInfo() {
    const tl = data.current;
    if (!tl) return;
    container.dataset.bucket = String(tl.bucket);
    container.dataset.start = String(tl.start);
    container.dataset.end = String(tl.end);
    container.dataset.points = String(tl.steps.length);
    const exact = tl.bucket === 1 ? "exact" : `${tl.bucket} steps per point, extremes kept`;
    let [a, b] = [tl.start, tl.end - 1];
    if (u && Number.isFinite(u.scales.x.min)) {
      a = Math.max(0, Math.ceil(u.scales.x.min));
      b = Math.min(tl.total_steps - 1, Math.floor(u.scales.x.max));
    }
    container.dataset.viewStart = String(a);
    container.dataset.viewEnd = String(b + 1);
    info.textContent = `steps ${a}–${b} of ${tl.total_steps} · ${exact}`;
  }

  const member = {
    applyRange(min, max) {
      if (u) u.setScale("x", { min, max });
    },
    reset() {
      resetZoom(false);
    },
  };
  const group = syncKey ? GROUPS.get(syncKey) || new Set() : new Set();
  if (syncKey) GROUPS.set(syncKey, group);
  group.add(member);

  /** Sets the x range on behalf of the user, and on the other timelines of the group. */
  function userSetRange(min, max) {
    if (!u || !(max > min)) return;
    u.setScale("x", { min, max });
    for (const other of group) if (other !== member) other.applyRange(min, max);
  }

  async function resetZoom(propagate = true) {
    if (propagate) for (const other of group) if (other !== member) other.reset();
    const full = data.reset();
    if (!full) return;
    u.setData(toPlotData(full), true);
    setInfo();
  }

  function pan(fraction) {
    if (!u) return;
    const { min, max } = u.scales.x;
    const span = max - min;
    const total = data.current.total_steps;
    let nmin = min + span * fraction;
    nmin = Math.max(0, Math.min(nmin, total - 1 - span));
    userSetRange(nmin, nmin + span);
  }

  function makePlot(width) {
    const full = data.full;
    return createPlot(chartBox, {
      width,
      threshold: magnitudeThreshold([full.columns.loss, full.columns.grad_norm]),
      syncKey,
      getData: () => data.current,
      getSelectedStep: () => selectedStep,
      onMouseDown(e, self) {
        downX = e.clientX;
        if (!e.shiftKey) return false;
        panning = { x: e.clientX, min: self.scales.x.min, max: self.scales.x.max };
        return true;
      },
      onDoubleClick: () => resetZoom(),
      onScaleX() {
        if (!u) return;
        setInfo();
        data.showRange(u.scales.x.min, u.scales.x.max);
      },
      onSelectRange: userSetRange,
      onDrawn(count) {
        // Exposed for tests: how many series have a drawn path.
        container.dataset.seriesDrawn = String(count);
      },
    });
  }

  function onMouseMove(e) {
    if (!panning || !u) return;
    const pxPerStep = u.bbox.width / uPlot.pxRatio / (panning.max - panning.min);
    const delta = (panning.x - e.clientX) / pxPerStep;
    userSetRange(panning.min + delta, panning.max + delta);
  }

  function onMouseUp(e) {
    if (panning) {
      panning = null;
      return;
    }
    if (!u || downX === null) return;
    const moved = Math.abs(e.clientX - downX);
    downX = null;
    if (moved < 4 && e.target && u.over.contains(e.target) && u.cursor.idx != null && data.current) {
      const step = stepOfPoint(data.current, u.cursor.idx);
      if (onStepClick) onStepClick(step);
    }
  }

  function resize() {
    if (!u) return;
    const width = Math.max(300, chartBox.clientWidth);
    if (Math.abs(width - u.width) > 2) u.setSize({ width, height: HEIGHT });
  }

  resetBtn.addEventListener("click", () => resetZoom());
  panLeft.addEventListener("click", () => pan(-0.5));
  panRight.addEventListener("click", () => pan(0.5));
  window.addEventListener("mousemove", onMouseMove);
  window.addEventListener("mouseup", onMouseUp);

  return {
    async load() {
      const full = await data.load();
      if (!full) return null;
      u?.destroy();
      u = null; // the new plot's first setScale must not see the old one
      u = makePlot(Math.max(300, chartBox.clientWidth || 600));
      resizeObserver?.observe(chartBox);
      container.dataset.state = "ready";
      setInfo();
      return full;
    },
    setSelectedStep(step) {
      selectedStep = step;
      u?.redraw(false);
    },
    resetZoom,
    async zoomTo(start, end) {
      userSetRange(start, end);
    },
    destroy() {
      data.destroy();
      resizeObserver?.disconnect();
      group.delete(member);
      if (syncKey && !group.size) GROUPS.delete(syncKey);
      window.removeEventListener("mousemove", onMouseMove);
      window.removeEventListener("mouseup", onMouseUp);
      u?.destroy();
      u = null;
    },
    get data() {
      return data.current;
    },
    get plot() {
      return u;
    },
  };
}
