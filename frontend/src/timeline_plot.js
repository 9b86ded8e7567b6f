/**
 * The timeline's drawing (uPlot): series, axes, non-finite marks, the
 * incident/explosion/rewind/selection lines and the skipped-step bands. It draws
 * whatever response `getData()` returns and reports the user's gestures;
 * what to fetch is decided in timeline_data.js.
 *
 * Y axes. Both axes use uPlot's arcsinh distribution (distr 4), a symlog:
 * linear within ±threshold and logarithmic beyond, so it shows values that
 * span many decades (a loss of 0.05 and an exploding 1e30 gradient norm) and
 * still accepts zero and negative values, which a log axis cannot.
 *  - left axis "magnitude": loss and gradient norm; the linear threshold is the
 *    power of ten just below their smallest positive value in the run, so the
 *    axis behaves like a log axis for these positive series.
 *  - right axis "logits": logit min and max; logit min is usually negative,
 *    so this axis uses arcsinh with threshold 1 (linear in [-1, 1]).
 *
 * A rewind (`on_nonfinite="rewind"`) is a band of its own: the steps it undid,
 * from the step it went back to through the step it rewound at, tinted in the
 * rewind colour with solid edges; its label lies in a lane of its own above
 * the plot (timeline.js), never among the marker labels.
 *
 * Non-finite values are not gaps: each is drawn as a mark at the plot's edge,
 * in its series' colour: ▲ at the top for +Inf, ▼ at the bottom for -Inf and
 * a ◆ at the top for NaN.
 */
import uPlot from "uplot";
import { fmt, nonFiniteKind } from "./format.js";
import { cssColor } from "./theme.js";
import { warningMarks } from "./warnings.js";

export const HEIGHT = 280;
/** Least distance between two y tick labels, in CSS pixels. */
const MIN_TICK_GAP = 22;
/** Plot height assumed before uPlot has laid the plot out. */
const FALLBACK_PLOT_HEIGHT = HEIGHT - 60;
/** Step increments of the x axis: whole steps only (never 0.2). */
const STEP_INCREMENTS = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9].flatMap((k) => [1, 2, 5].map((m) => m * 10 ** k));

/** Least room per point, in CSS pixels, for a series to show its points. */
const POINT_SPACE = 12;
/** The colour variable of a rewind's band (`on_nonfinite="rewind"`), and its tint's opacity. */
const REWIND_COLOR = "--healthy";
const REWIND_ALPHA = 0.18;

/** Gap between a marker line and its label, and between two labels of a row, in CSS pixels. */
const LABEL_GAP = 4;

/**
 * The plotted series: column name, label, scale, the CSS variable of its
 * colour (Okabe-Ito hues, one set per theme: style.css) and its dash (the
 * right axis' series are dashed, so no reader needs the colour alone).
 */
export const SERIES = [
  { column: "loss", label: "loss (left)", scale: "mag", color: "--series-loss" },
  { column: "grad_norm", label: "grad norm (left)", scale: "mag", color: "--series-grad" },
  { column: "logit_max", label: "logit max (right)", scale: "logit", color: "--series-logit-max", dash: [7, 3] },
  { column: "logit_min", label: "logit min (right)", scale: "logit", color: "--series-logit-min", dash: [2, 2] },
];

/** The titles of the y axes: what each shows. */
export const AXIS_TITLES = { left: "loss, grad norm (symlog)", right: "logit min, max (symlog)" };

/**
 * The words of the right axis: "logit" where the model's outputs feed a
 * sigmoid/softmax or a from-logits loss, else "output" (a regression's
 * outputs are no logits; the `timeline` route's `output_word`).
 * @param {string|undefined} outputWord "logits" or "outputs".
 * @returns {{series: string[], right: string}} Series labels and right axis title.
 */
export function outputWords(outputWord) {
  const word = outputWord === "outputs" ? "output" : "logit";
  return {
    series: SERIES.map((s) => s.label.replace(/^logit/, word)),
    right: AXIS_TITLES.right.replace(/^logit/, word),
  };
}

/**
 * Rows for marker labels so that no two overlap: each label sits right of
 * its line (left of it when it would pass the right edge), in the first row
 * where it clears the labels already there.
 * @param {Array<{x: number, width: number}>} labels Line positions and label widths, CSS pixels.
 * @param {number} width Width available.
 * @param {number} [gap] Gap between a line and its label, and between two labels of a row.
 * @returns {Array<{left: number, row: number}>} Placement of each label, in input order.
 */
export function placeLabels(labels, width, gap = LABEL_GAP) {
  const order = labels.map((label, i) => i).sort((a, b) => labels[a].x - labels[b].x);
  const rowEnds = [];
  const placed = new Array(labels.length);
  for (const i of order) {
    const { x, width: w } = labels[i];
    let left = x + gap;
    if (left + w > width) left = Math.max(0, x - gap - w);
    let row = rowEnds.findIndex((end) => end + gap <= left);
    if (row < 0) row = rowEnds.push(-Infinity) - 1;
    rowEnds[row] = left + w;
    placed[i] = { left, row };
  }
  return placed;
}

/**
 * Linear threshold of the magnitude axis: the power of ten at or below the
 * smallest positive finite value (clamped to [1e-12, 1]).
 * @param {Array<Array<number|null>>} columns Value arrays.
 * @returns {number} The threshold.
 */
export function magnitudeThreshold(columns) {
  let smallest = Infinity;
  for (const col of columns) {
    for (const v of col || []) {
      const a = typeof v === "number" ? Math.abs(v) : NaN;
      if (Number.isFinite(a) && a > 0 && a < smallest) smallest = a;
    }
  }
  if (!Number.isFinite(smallest)) return 1;
  return Math.min(1, Math.max(1e-12, 10 ** Math.floor(Math.log10(smallest))));
}

/**
 * Converts a `timeline` response into uPlot's aligned data; non-finite values
 * become null (drawn as edge marks instead of line points).
 * @param {Object} tl The `timeline` response.
 * @returns {Array<Array<number|null>>} [steps, ...series values].
 */
export function toPlotData(tl) {
  const n = tl.steps.length;
  const out = [tl.steps.slice()];
  for (const s of SERIES) {
    const col = tl.columns[s.column] || new Array(n).fill(null);
    out.push(col.map((v) => (typeof v === "number" && Number.isFinite(v) ? v : null)));
  }
  return out;
}

/**
 * "Nice" evenly spaced ticks of a linear range (about four of them).
 * @param {number} min Range minimum.
 * @param {number} max Range maximum.
 * @returns {number[]} Tick values, ascending.
 */
export function linearTicks(min, max) {
  const rough = (max - min) / 4;
  const magnitude = 10 ** Math.floor(Math.log10(rough));
  const step = [1, 2, 5, 10].map((m) => m * magnitude).find((m) => m >= rough);
  const ticks = [];
  for (let t = Math.ceil(min / step) * step; t <= max + step * 1e-9; t += step) ticks.push(Number(t.toPrecision(12)));
  return ticks;
}

/** How round a power of ten's exponent is: ticks of rounder ones are kept first. */
function roundness(value) {
  if (value === 0) return Infinity;
  const k = Math.round(Math.log10(Math.abs(value)));
  return [10, 5, 2, 1].find((d) => k % d === 0);
}

/**
 * Tick positions for an arcsinh axis: 0 and ±powers of ten, none closer
 * than MIN_TICK_GAP pixels to another (0 and round exponents are kept
 * first, so labels never overlap); evenly spaced ticks when fewer than two
 * of those fall in the range (a range inside the linear part).
 * @param {number} min Scale minimum.
 * @param {number} max Scale maximum.
 * @param {number} threshold Linear threshold of the scale.
 * @param {number} pixels Height of the plot in CSS pixels.
 * @returns {number[]} Tick values, ascending.
 */
export function symlogTicks(min, max, threshold, pixels) {
  if (!Number.isFinite(min) || !Number.isFinite(max) || max <= min) return [];
  const lo = Math.floor(Math.log10(threshold));
  const hi = Math.ceil(Math.log10(Math.max(Math.abs(min), Math.abs(max), threshold)));
  const candidates = [0];
  for (let k = lo; k <= hi; k++) candidates.push(10 ** k, -(10 ** k));
  const inRange = candidates.filter((t) => t >= min && t <= max);
  if (inRange.length < 2) return linearTicks(min, max);
  const at = (v) => Math.asinh(v / threshold);
  const scale = pixels / (at(max) - at(min));
  const kept = [];
  inRange.sort((a, b) => roundness(b) - roundness(a) || Math.abs(b) - Math.abs(a));
  for (const t of inRange) {
    if (kept.every((k) => Math.abs(at(k) - at(t)) * scale >= MIN_TICK_GAP)) kept.push(t);
  }
  return kept.sort((a, b) => a - b);
}

/**
 * Short tick label: "0", "0.01", "1", "1e20", "-1e5".
 * @param {number} t Tick value.
 * @returns {string} Label.
 */
export function tickLabel(t) {
  if (t === null || t === undefined) return "";
  const a = Math.abs(t);
  if (a === 0) return "0";
  if (a >= 1e4 || a < 1e-2) return t.toExponential(0).replace("e+", "e");
  return String(Number(t.toPrecision(2)));
}

function drawMark(ctx, kind, x, y, r) {
  ctx.beginPath();
  if (kind === "posinf") {
    ctx.moveTo(x, y - r);
    ctx.lineTo(x + r, y + r);
    ctx.lineTo(x - r, y + r);
  } else if (kind === "neginf") {
    ctx.moveTo(x, y + r);
    ctx.lineTo(x + r, y - r);
    ctx.lineTo(x - r, y - r);
  } else {
    ctx.moveTo(x, y - r);
    ctx.lineTo(x + r, y);
    ctx.lineTo(x, y + r);
    ctx.lineTo(x - r, y);
  }
  ctx.closePath();
  ctx.fill();
  ctx.stroke();
}

/**
 * Whether a series' points are drawn: when they have room (uPlot's rule),
 * and always for a single point, which has no line to show it.
 * @param {Object} self The plot.
 * @returns {boolean} Draw the points.
 */
function pointsFit(self) {
  const [i0, i1] = self.series[0].idxs || [0, 0];
  if (!(i1 > i0)) return true;
  const xs = self.data[0];
  const span = Math.abs(self.valToPos(xs[i1], "x") - self.valToPos(xs[i0], "x"));
  return i1 - i0 <= span / POINT_SPACE;
}

/** A vertical line at `step` across the plot; its label is the timeline's (see `onMarks`). */
function vline(u, step, color, dash) {
  const x = u.valToPos(step, "x", true);
  const { top, left, width, height } = u.bbox;
  if (!(x >= left && x <= left + width)) return false;
  const ctx = u.ctx;
  const dpr = uPlot.pxRatio;
  ctx.save();
  ctx.strokeStyle = color;
  ctx.lineWidth = 2 * dpr;
  ctx.setLineDash(dash.map((d) => d * dpr));
  ctx.beginPath();
  ctx.moveTo(x, top);
  ctx.lineTo(x, top + height);
  ctx.stroke();
  ctx.restore();
  return true;
}

/**
 * The rewinds of a `timeline` response with the x extent of their bands, in
 * CSS pixels from the plot's left edge (clamped to it; those outside the
 * view left out): from half a step before the step rewound to, to half a
 * step after the step it rewound at.
 * @param {Object} u The plot.
 * @param {Object} tl The `timeline` response.
 * @returns {Array<{recovery: Object, x0: number, x1: number}>} The bands.
 */
export function rewindBands(u, tl) {
  const width = u.bbox.width / uPlot.pxRatio;
  const bands = [];
  for (const r of Array.isArray(tl.recoveries) ? tl.recoveries : []) {
    if (typeof r.step !== "number" || typeof r.rewound_to !== "number") continue;
    const x0 = Math.max(0, u.valToPos(r.rewound_to - 0.5, "x"));
    const x1 = Math.min(width, u.valToPos(r.step + 0.5, "x"));
    if (x1 > x0) bands.push({ recovery: r, x0, x1 });
  }
  return bands;
}

/** Draws the rewinds' bands (rewindBands): tinted, with solid left and right edges. */
function drawRewindBands(u, tl) {
  const dpr = uPlot.pxRatio;
  const { top, left, height } = u.bbox;
  const ctx = u.ctx;
  ctx.save();
  ctx.fillStyle = cssColor(REWIND_COLOR);
  ctx.strokeStyle = ctx.fillStyle;
  ctx.lineWidth = 2 * dpr;
  for (const { x0, x1 } of rewindBands(u, tl)) {
    const [a, b] = [left + x0 * dpr, left + x1 * dpr];
    ctx.globalAlpha = REWIND_ALPHA;
    ctx.fillRect(a, top, b - a, height);
    ctx.globalAlpha = 1;
    ctx.beginPath();
    for (const x of [a, b]) {
      ctx.moveTo(x, top);
      ctx.lineTo(x, top + height);
    }
    ctx.stroke();
  }
  ctx.restore();
}

/**
 * The x range a plot opens on: the run's steps plus a little room on the
 * right, so the last step (where a stopped run's NaN is) is not on the edge.
 * @param {number} min First step.
 * @param {number} max Last step.
 * @returns {[number, number]} x minimum and maximum.
 */
export function paddedStepRange(min, max) {
  const pad = Math.max(0.5, (max - min) * 0.03);
  return [min === max ? min - pad : min, max + pad];
}

/**
 * Creates the uPlot chart.
 * @param {HTMLElement} chartBox Element the chart goes into.
 * @param {{width: number, threshold: number, syncKey?: string, outputWord?: string,
 *          getData: () => Object|null, getSelectedStep: () => number|null,
 *          onMouseDown: (e: MouseEvent, plot: Object) => boolean,
 *          onDoubleClick: () => void, onScaleX: () => void,
 *          onSelectRange: (min: number, max: number) => void,
 *          onMarks: (labels: Array<{kind: string, step: number, text: string, x: number}>) => void,
 *          onRewinds: (bands: Array<{recovery: Object, x0: number, x1: number}>) => void,
 *          onDrawn: (drawn: {series: number, marks: number, ticks: string[][], axes: string[]}) => void}} opts
 *   `getData` returns the `timeline` response on screen; `onMouseDown` returns
 *   true when it took the event (uPlot then ignores it); `onDrawn` reports
 *   after each draw how many series have a path, how many NaN/Inf marks lie
 *   wholly inside the plot, the tick labels of the x, left and right axes and
 *   the titles of the y axes; `onMarks` gets the marker lines drawn (x in CSS
 *   pixels from the chart's left edge) for their labels; `onRewinds` the
 *   rewinds' bands (x0/x1 likewise) for theirs.
 * @returns {Object} The uPlot instance.
 */
export function createPlot(chartBox, opts) {
  const { threshold, syncKey, getData } = opts;
  const words = outputWords(opts.outputWord);
  const ticks = [[], [], []];

  function rawValue(sidx, idx) {
    const tl = getData();
    if (!tl || idx == null) return null;
    const col = tl.columns[SERIES[sidx - 1].column];
    return col ? col[idx] : null;
  }

  function drawBands(plot) {
    const tl = getData();
    if (!tl) return;
    drawRewindBands(plot, tl);
    if (!tl.skipped_ranges) return;
    const { top, left, width, height } = plot.bbox;
    const ctx = plot.ctx;
    ctx.save();
    ctx.fillStyle = "rgba(120, 120, 120, 0.22)";
    for (const [a, b] of tl.skipped_ranges) {
      let x0 = plot.valToPos(a, "x", true);
      let x1 = plot.valToPos(b + 1, "x", true);
      x0 = Math.max(left, x0);
      x1 = Math.min(left + width, Math.max(x1, x0 + uPlot.pxRatio));
      if (x1 > x0) ctx.fillRect(x0, top, x1 - x0, height);
    }
    ctx.restore();
  }

  /** NaN/Inf marks, drawn over the lines; returns how many lie wholly inside the plot. */
  function drawMarks(plot, tl) {
    const dpr = uPlot.pxRatio;
    const ctx = plot.ctx;
    const { top, left, width, height } = plot.bbox;
    const r = 4.5 * dpr;
    let inside = 0;
    ctx.save();
    ctx.lineWidth = 1 * dpr;
    for (let s = 0; s < SERIES.length; s++) {
      const col = tl.columns[SERIES[s].column];
      if (!col || !plot.series[s + 1].show) continue;
      ctx.fillStyle = cssColor(SERIES[s].color);
      for (let i = 0; i < tl.steps.length; i++) {
        const kind = nonFiniteKind(col[i]);
        if (!kind) continue;
        const x = plot.valToPos(tl.steps[i], "x", true);
        if (x < left - r || x > left + width + r) continue;
        if (x >= left + r && x <= left + width - r) inside++;
        const y = kind === "neginf" ? top + height - r - 1 : top + r + 1 + (kind === "nan" ? 2 * r + 2 : 0);
        ctx.strokeStyle = kind === "nan" ? cssColor("--bad") : cssColor("--fg");
        drawMark(ctx, kind, x, y, r);
      }
    }
    ctx.restore();
    return inside;
  }

  function drawOverlays(plot) {
    const tl = getData();
    if (!tl) return;
    // Lines first: the marks at the incident step stay on top of its line.
    const labels = [];
    const line = (kind, step, color, dash, text) => {
      if (vline(plot, step, color, dash)) labels.push({ kind, step, text, x: plot.valToPos(step, "x") + plot.over.offsetLeft });
    };
    if (tl.first_nonfinite) line("first", tl.first_nonfinite.step, cssColor("--first"), [], `first non-finite: step ${tl.first_nonfinite.step}`);
    if (tl.explosion) line("explosion", tl.explosion.step, cssColor("--fg"), [6, 4], `explosion onset: step ${tl.explosion.step}`);
    const jump = tl.explosion?.lr_change;
    if (jump && typeof jump.from === "number" && typeof jump.to === "number") {
      line("lr", jump.step, cssColor("--muted"), [2, 3], `learning rate ${fmt(jump.from)} → ${fmt(jump.to)}: step ${jump.step}`);
    }
    for (const mark of warningMarks(tl)) line("warning", mark.step, cssColor("--note"), [1, 3], mark.text);
    const selectedStep = opts.getSelectedStep();
    if (selectedStep !== null) vline(plot, selectedStep, cssColor("--accent"), [2, 3]);
    const marks = drawMarks(plot, tl);
    opts.onMarks(labels);
    const offset = plot.over.offsetLeft;
    opts.onRewinds(rewindBands(plot, tl).map(({ recovery, x0, x1 }) => ({ recovery, x0: x0 + offset, x1: x1 + offset })));
    const axes = [plot.axes[1].label, plot.axes[2].label];
    opts.onDrawn({ series: plot.series.slice(1).filter((s) => s._paths).length, marks, ticks, axes });
  }

  const plotHeight = (self) => (self.bbox.height ? self.bbox.height / uPlot.pxRatio : FALLBACK_PLOT_HEIGHT);
  const labelled = (axisIdx, format) => (self, values) => {
    ticks[axisIdx] = values.map((t) => (t == null ? "" : format(t)));
    return ticks[axisIdx];
  };
  const themed = {
    stroke: () => cssColor("--fg"),
    grid: { stroke: () => cssColor("--grid"), width: 1 },
    ticks: { stroke: () => cssColor("--grid"), width: 1 },
  };
  const series = [
    {
      label: "step",
      value: (self, v) => {
        const tl = getData();
        if (v == null || !tl) return "–";
        return tl.bucket > 1 ? `${v}–${v + tl.bucket - 1}` : String(v);
      },
    },
    ...SERIES.map((s, i) => ({
      label: words.series[i],
      scale: s.scale,
      stroke: () => cssColor(s.color),
      dash: s.dash ? s.dash.map((d) => d * uPlot.pxRatio) : undefined,
      width: 1.5,
      spanGaps: false,
      // Always drawn: a run of one step is one point, with no line to show it.
      points: {
        show: pointsFit,
        size: 7,
        // Hollow on the page's colour; filled when alone, to be seen at once.
        fill: (self) => (self.data[0].length === 1 ? cssColor(s.color) : cssColor("--bg")),
      },
      value: (self, v, sidx, idx) => fmt(rawValue(sidx, idx)),
    })),
  ];
  const plotOpts = {
    width: opts.width,
    height: HEIGHT,
    series,
    scales: {
      // One step: uPlot would widen the range to [0, 100]; centre the point instead.
      x: { time: false, range: (self, min, max) => (self.data[0].length === 1 ? paddedStepRange(self.data[0][0], self.data[0][0]) : paddedStepRange(min, max)) },
      mag: { distr: 4, asinh: threshold },
      logit: { distr: 4, asinh: 1 },
    },
    axes: [
      { ...themed, label: "step", size: 40, incrs: STEP_INCREMENTS, values: labelled(0, String) },
      {
        ...themed,
        scale: "mag",
        label: AXIS_TITLES.left,
        splits: (self, i, min, max) => symlogTicks(min, max, threshold, plotHeight(self)),
        filter: (self, splits) => splits,
        values: labelled(1, tickLabel),
        size: 56,
      },
      {
        ...themed,
        scale: "logit",
        side: 1,
        label: words.right,
        grid: { show: false },
        splits: (self, i, min, max) => symlogTicks(min, max, 1, plotHeight(self)),
        filter: (self, splits) => splits,
        values: labelled(2, tickLabel),
        size: 56,
      },
    ],
    cursor: {
      drag: { x: true, y: false, setScale: false },
      // Hover only: zoom and pan are shared by the timeline's sync group.
      sync: syncKey ? { key: syncKey, filters: { pub: (type) => !["mousedown", "mouseup", "dblclick"].includes(type) } } : undefined,
      bind: {
        mousedown: (self, targ, handler) => (e) => (opts.onMouseDown(e, self) ? null : handler(e)),
        dblclick: () => () => {
          opts.onDoubleClick();
          return null;
        },
      },
    },
    legend: { live: true, markers: { dash: (self, i) => (SERIES[i - 1]?.dash ? "dashed" : "solid") } },
    hooks: {
      drawClear: [drawBands],
      draw: [drawOverlays],
      setScale: [
        (self, key) => {
          if (key === "x") opts.onScaleX();
        },
      ],
      setSelect: [
        (self) => {
          const { left, width } = self.select;
          if (width < 4) return;
          const min = self.posToVal(left, "x");
          const max = self.posToVal(left + width, "x");
          self.setSelect({ left: 0, top: 0, width: 0, height: 0 }, false);
          opts.onSelectRange(min, max);
        },
      ],
    },
  };
  return new uPlot(plotOpts, toPlotData(getData()), chartBox);
}
