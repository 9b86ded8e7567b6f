/**
 * Timeline view of one run: loss, global gradient norm and logit min/max per
 * step. Wires the data/zoom controller (timeline_data.js) to the drawing
 * (timeline_plot.js) and owns the toolbar, the key and the user's gestures.
 *
 * Magenta line: first non-finite step; dashed line in the text colour:
 * explosion onset; grey dotted line: a learning-rate jump before the onset;
 * (their labels sit above the plot, in rows that never overlap); green band:
 * a rewind (`on_nonfinite="rewind"`: the steps it undid, from the step it went
 * back to through the step it rewound at; its label, in a lane of its own
 * above the marker labels, says where from, where to and which remedy it set); grey bands:
 * steps skipped by the loss scaler; blue dotted line: the selected step.
 * Zoom by dragging, pan with shift+drag or the arrow buttons, reset with a
 * double-click or the button; "Go to incident" centres the incident (or the
 * explosion onset). CSV/JSON download the whole run at full resolution. Timelines created with the same `syncKey`
 * (runs side by side) share the hover cursor and zoom/pan/reset together.
 */
import uPlot from "uplot";
import { el, clear } from "./dom.js";
import { downloadName, saveText, timelineCsv, timelineJson } from "./download.js";
import { createTimelineData, stepOfPoint } from "./timeline_data.js";
import { cssColor } from "./theme.js";
import { HEIGHT, SERIES, createPlot, magnitudeThreshold, placeLabels, toPlotData } from "./timeline_plot.js";

/** Height of a row of the rewinds' lane, in CSS pixels. */
const REWIND_ROW = 22;

/**
 * The words of a rewind's label: "↶ rewound at step 3 to before step 0 ·
 * clipnorm=1.0", and its tooltip.
 * @param {{step: number, rewound_to: number, remedy?: {id?: string, setting?: string}, skipped_batches?: number}} r The rewind.
 * @returns {{text: string, title: string}} The label.
 */
export function rewindWords(r) {
  const remedy = r.remedy?.setting || r.remedy?.id || "";
  const text = `↶ rewound at step ${r.step} to before step ${r.rewound_to}${remedy ? ` · ${remedy}` : ""}`;
  const batches = typeof r.skipped_batches === "number" ? `; ${r.skipped_batches} batch${r.skipped_batches === 1 ? "" : "es"} not trained on again` : "";
  const title = `At step ${r.step} the run went back to its weights from before step ${r.rewound_to}${remedy ? ` and set ${remedy}` : ""}${batches}.`;
  return { text, title };
}

/** Steps shown either side of the incident by "Go to incident" when not zoomed in closer. */
const INCIDENT_HALF_SPAN = 50;

/** Timelines sharing a sync key zoom and pan together: syncKey -> Set of members. */
const GROUPS = new Map();

/**
 * Creates the timeline of one run.
 * @param {HTMLElement} container Element to render into (gets data-state, data-bucket, ...).
 * @param {{run: string, syncKey?: string, onStepClick?: (step: number) => void}} opts Options.
 * @returns {{load: () => Promise<Object>, refresh: () => Promise<Object>, redraw: () => void,
 *            setSelectedStep: (step: number|null) => void, gotoIncident: () => void,
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
  const incidentBtn = el("button", { class: "btn", text: "Go to incident", title: "Centre the first non-finite step (or the explosion onset)", data: { action: "goto-incident" } });
  incidentBtn.hidden = true;
  const csvBtn = el("button", { class: "btn", text: "CSV", title: "Download the run's timeline as CSV", data: { action: "download-csv" } });
  const jsonBtn = el("button", { class: "btn", text: "JSON", title: "Download the run's timeline as JSON", data: { action: "download-json" } });
  const info = el("span", { class: "timeline-info muted", data: { field: "range" } });
  const toolbar = el("div", { class: "timeline-toolbar" }, [
    resetBtn, panLeft, panRight, incidentBtn, info, el("span", { class: "toolbar-gap" }), csvBtn, jsonBtn,
  ]);
  const rewindStrip = el("div", { class: "timeline-rewinds", data: { field: "rewinds" } });
  const marksStrip = el("div", { class: "timeline-marks", data: { field: "marks" } });
  const chartBox = el("div", { class: "timeline-chart" });
  const keyText = el("div", { class: "timeline-key muted" }, [
    el("span", { class: "mark mark-posinf", text: "▲" }), " +Inf  ",
    el("span", { class: "mark mark-neginf", text: "▼" }), " -Inf  ",
    el("span", { class: "mark mark-nan", text: "◆" }), " NaN (at the plot edge)  ",
    el("span", { class: "swatch swatch-first" }), " first non-finite  ",
    el("span", { class: "swatch swatch-explosion-line" }), " explosion onset  ",
    el("span", { class: "swatch swatch-lr-line" }), " learning-rate jump before it  ",
    el("span", { class: "swatch swatch-warning-line" }), " early warning  ",
    el("span", { class: "swatch swatch-rewind" }), " rewind (the steps it undid)  ",
    el("span", { class: "swatch swatch-skipped" }), " skipped steps · ",
    "drag: zoom · shift+drag: pan · double-click: reset · click: layers of that step",
  ]);
  container.append(toolbar, rewindStrip, marksStrip, chartBox, keyText);

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
    const shown = a === b ? `step ${a}` : `steps ${a}–${b}`;
    info.textContent = `${shown} of ${tl.total_steps} · ${exact}`;
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
      outputWord: full.output_word,
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
      onMarks: showMarkLabels,
      onRewinds: showRewindLabels,
      onDrawn({ series, marks, ticks, axes }) {
        // Exposed for tests: what was drawn.
        container.dataset.axisLeft = axes[0];
        container.dataset.axisRight = axes[1];
        container.dataset.seriesDrawn = String(series);
        container.dataset.marksInside = String(marks);
        container.dataset.ticksX = ticks[0].join(" ");
        container.dataset.ticksLeft = ticks[1].join(" ");
        container.dataset.ticksRight = ticks[2].join(" ");
      },
    });
  }

  /** The labels of the marker lines, above the plot, in rows that never overlap. */
  function showMarkLabels(lines) {
    const key = JSON.stringify(lines);
    if (marksStrip.dataset.drawn === key) return;
    marksStrip.dataset.drawn = key;
    clear(marksStrip);
    const spans = lines.map((line) => el("span", { class: `mark-label mark-label-${line.kind}`, data: { mark: line.kind, step: line.step }, text: line.text }));
    placeInRows(marksStrip, spans, lines.map((line) => line.x), { rowHeight: 16, emptyRows: 1 });
  }

  /**
   * The rewinds' labels, in their own lane above the marker labels: each
   * starts at its band's left edge and spans the band at least; rows never overlap.
   */
  function showRewindLabels(bands) {
    const key = JSON.stringify(bands);
    if (rewindStrip.dataset.drawn === key) return;
    rewindStrip.dataset.drawn = key;
    clear(rewindStrip);
    const spans = bands.map(({ recovery: r, x0, x1 }) => {
      const { text, title } = rewindWords(r);
      const span = el("span", { class: "rewind-label", data: { mark: "rewind", step: r.step, to: r.rewound_to }, text, title });
      span.style.minWidth = `${Math.max(0, x1 - x0)}px`;
      return span;
    });
    placeInRows(rewindStrip, spans, bands.map((band) => band.x0), { rowHeight: REWIND_ROW, gap: 0, emptyRows: 0 });
  }

  /**
   * Puts ``spans`` into ``strip``, each at its ``xs`` or right of it, in rows
   * that never overlap (placeLabels); the strip is as tall as its rows
   * (``emptyRows`` when there is none).
   */
  function placeInRows(strip, spans, xs, { rowHeight, gap = undefined, emptyRows }) {
    strip.append(...spans);
    const placed = placeLabels(
      xs.map((x, i) => ({ x, width: spans[i].offsetWidth })),
      strip.clientWidth,
      gap,
    );
    placed.forEach(({ left, row }, i) => {
      spans[i].style.left = `${left}px`;
      spans[i].style.top = `${row * rowHeight}px`;
    });
    const rows = placed.length ? Math.max(...placed.map((p) => p.row)) + 1 : emptyRows;
    strip.style.height = `${rows * rowHeight}px`;
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

  /** The step the incident button centres: first non-finite, else explosion onset. */
  function incidentStep() {
    const tl = data.full;
    if (!tl) return null;
    if (tl.first_nonfinite) return tl.first_nonfinite.step;
    return tl.explosion ? tl.explosion.step : null;
  }

  function gotoIncident() {
    const step = incidentStep();
    if (!u || step === null) return;
    const shown = u.scales.x.max - u.scales.x.min;
    const half = Math.min(INCIDENT_HALF_SPAN, shown / 2);
    userSetRange(step - half, step + half);
  }

  async function download(format) {
    const whole = await data.fetchWhole().catch((err) => {
      info.textContent = `Could not download the timeline: ${err.message}`;
      return null;
    });
    if (!whole) return;
    if (format === "csv") saveText(downloadName(run, "csv"), timelineCsv(whole), "text/csv");
    else saveText(downloadName(run, "json"), timelineJson(whole), "application/json");
  }

  function showLoaded(full, view) {
    u?.destroy();
    u = null; // the new plot's first setScale must not see the old one
    u = makePlot(Math.max(300, chartBox.clientWidth || 600));
    if (view) u.setScale("x", view);
    resizeObserver?.observe(chartBox);
    incidentBtn.hidden = incidentStep() === null;
    container.dataset.totalSteps = String(full.total_steps);
    container.dataset.state = "ready";
    setInfo();
  }

  function resize() {
    if (!u) return;
    const width = Math.max(300, chartBox.clientWidth);
    if (Math.abs(width - u.width) > 2) u.setSize({ width, height: HEIGHT });
  }

  resetBtn.addEventListener("click", () => resetZoom());
  incidentBtn.addEventListener("click", gotoIncident);
  csvBtn.addEventListener("click", () => download("csv"));
  jsonBtn.addEventListener("click", () => download("json"));
  panLeft.addEventListener("click", () => pan(-0.5));
  panRight.addEventListener("click", () => pan(0.5));
  window.addEventListener("mousemove", onMouseMove);
  window.addEventListener("mouseup", onMouseUp);

  return {
    async load() {
      const full = await data.load();
      if (full) showLoaded(full, null);
      return full;
    },
    /** Fetches the run again (it may have grown), keeping a zoomed view where it was. */
    async refresh() {
      const before = data.full;
      const zoomed = u && before && data.current !== before;
      const view = zoomed ? { min: u.scales.x.min, max: u.scales.x.max } : null;
      const full = await data.load();
      if (full) showLoaded(full, view);
      return full;
    },
    /** Draws again, e.g. in the colours of a new theme (the legend's markers too). */
    redraw() {
      if (!u) return;
      u.root.querySelectorAll(".u-legend .u-series").forEach((row, i) => {
        const marker = row.querySelector(".u-marker");
        if (i > 0 && marker) marker.style.borderColor = cssColor(SERIES[i - 1].color);
      });
      u.redraw(false);
    },
    gotoIncident,
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
