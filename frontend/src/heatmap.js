/**
 * Layer × step heatmap of the flight-recorder window (`incident` route).
 *
 * Rows are layers in execution order, columns are steps. Cells are drawn on a
 * canvas with a logarithmic colour scale, on a mid-grey ground that sets each
 * cell apart in both themes; labels are ordinary text elements. A cell whose
 * value is NaN/Inf is magenta; a cell whose layer has another non-finite
 * tensor at that step gets a magenta corner. The origin cell (where the first
 * non-finite value was born) is outlined by an element with
 * `data-origin="true"`, and the container names it in `data-origin-layer` /
 * `data-origin-step`. The legend explains each of these marks.
 */
import { interpolateViridis } from "d3-scale-chromatic";
import { el, clear } from "./dom.js";
import { fmt, truncateLeft } from "./format.js";
import { cssColor } from "./theme.js";
import { phaseLabel } from "./vocabulary.js";

const MAX_CELL_W = 22;
const MIN_CELL_W = 6;
const CELL_H = 16;
const NONFINITE_COLOR = "#ff00ff";
/** Pixels per character of a column label (10 px digits) and the gap between labels. */
const LABEL_CHAR_W = 6.5;
const LABEL_GAP = 8;
const METRICS = [
  { key: "forward_max_abs", label: "forward max |x|", what: "the largest |x| of the layer's output" },
  {
    key: "grad_norm",
    label: "gradient norm",
    what: "the norm of the gradients the layer's backward pass computed (w.r.t. its input and its weights)",
  },
];

/**
 * The metric the heatmap opens on: the one of the incident's phase (a
 * backward incident is seen in the gradient norms).
 * @param {Object|null} origin The heatmap's origin.
 * @returns {string} A METRICS key.
 */
export function initialMetric(origin) {
  return origin && origin.phase === "backward" ? "grad_norm" : "forward_max_abs";
}

/**
 * Which columns get a step label: the origin's, then every `every`-th column
 * far enough from the labels kept before, so that no two labels overlap.
 * @param {number[]} steps Steps of the columns.
 * @param {number} cellW Column width in pixels.
 * @param {number} originCol The origin's column, -1 when none.
 * @returns {number[]} Column indices, ascending.
 */
export function labelledColumns(steps, cellW, originCol) {
  const labelW = Math.max(...steps.map((s) => String(s).length)) * LABEL_CHAR_W + LABEL_GAP;
  const every = Math.max(1, Math.ceil(labelW / cellW));
  const kept = originCol >= 0 ? [originCol] : [];
  for (let c = 0; c < steps.length; c += every) {
    if (kept.every((k) => Math.abs(k - c) * cellW >= labelW)) kept.push(c);
  }
  return kept.sort((a, b) => a - b);
}

/**
 * The origin's column.
 * @param {Object|null} origin The heatmap's origin.
 * @param {number[]} steps Steps of the columns.
 * @returns {number} Its index, -1 when none is shown.
 */
const originColumnOf = (origin, steps) => (origin ? steps.indexOf(origin.step) : -1);

/**
 * Colour for t in [0, 1] on the viridis scale (d3-scale-chromatic).
 * @param {number} t Position on the scale; clamped to [0, 1].
 * @returns {string} CSS colour.
 */
export const colorAt = (t) => interpolateViridis(Math.min(1, Math.max(0, t)));

/** The legend bar's background: the same scale as the cells. */
const LEGEND_GRADIENT = `linear-gradient(to right, ${[0, 0.25, 0.5, 0.75, 1].map(colorAt).join(", ")})`;

/**
 * log10 range of the positive finite values of a matrix.
 * @param {Array<Array<number|null>>} matrix Values per layer per step.
 * @returns {{lo: number, hi: number}|null} Range of log10 values, null if none.
 */
export function logRange(matrix) {
  let lo = Infinity;
  let hi = -Infinity;
  for (const row of matrix || []) {
    for (const v of row || []) {
      if (typeof v === "number" && Number.isFinite(v) && v > 0) {
        const l = Math.log10(v);
        if (l < lo) lo = l;
        if (l > hi) hi = l;
      }
    }
  }
  return Number.isFinite(lo) ? { lo, hi } : null;
}

/**
 * Renders the heatmap.
 * @param {HTMLElement} container Element to render into.
 * @param {Object|null} heatmap The `heatmap` object of the `incident` route.
 * @param {{onStepClick?: (step: number) => void}} [opts] Options.
 * @returns {{setSelectedStep: (step: number|null) => void, setMetric: (key: string) => void,
 *            redraw: () => void}} Controller.
 */
export function renderHeatmap(container, heatmap, opts = {}) {
  clear(container);
  container.classList.add("heatmap");
  const noop = { setSelectedStep() {}, setMetric() {}, redraw() {} };
  if (!heatmap || !heatmap.layers || !heatmap.layers.length || !heatmap.steps || !heatmap.steps.length) {
    container.dataset.state = "empty";
    container.append(el("p", { class: "muted", text: "No flight-recorder window: the run had no incident." }));
    return noop;
  }
  const { layers, steps, origin } = heatmap;
  let metric = initialMetric(origin);
  let selectedStep = null;
  container.dataset.state = "ready";
  container.dataset.metric = metric;
  if (origin) {
    container.dataset.originStep = String(origin.step);
    if (origin.layer !== null && origin.layer !== undefined) container.dataset.originLayer = origin.layer;
  }

  const buttons = METRICS.map((m) =>
    el("button", {
      class: "btn metric-btn",
      text: m.label,
      data: { metric: m.key },
      on: { click: () => setMetric(m.key) },
    }),
  );
  const legendLo = el("span", { class: "legend-lo" });
  const legendHi = el("span", { class: "legend-hi" });
  const legendBar = el("span", { class: "legend-bar" });
  legendBar.style.background = LEGEND_GRADIENT;
  const key = (name, text) => el("span", { class: "legend-key", data: { key: name } }, [el("span", { class: `swatch swatch-${name}` }), text]);
  const legend = el("span", { class: "heatmap-legend" }, [
    el("span", { class: "legend-key", data: { key: "scale" } }, [legendLo, legendBar, legendHi]),
    key("nonfinite", "NaN/Inf"),
    key("corner", "corner: NaN/Inf in another tensor of the layer"),
    originColumnOf(origin, steps) >= 0 ? key("origin", "outline: origin, where the first NaN/Inf was born") : null,
    key("missing", "not recorded"),
  ]);
  const definition = el("p", { class: "heatmap-def muted", data: { field: "metric-definition" } });
  container.append(el("div", { class: "heatmap-toolbar" }, [...buttons, legend]), definition);

  const available = (container.clientWidth || 700) - 260; // minus the row labels
  const cellW = Math.max(MIN_CELL_W, Math.min(MAX_CELL_W, Math.floor(available / steps.length)));
  const dpr = window.devicePixelRatio || 1;
  const width = steps.length * cellW;
  const height = layers.length * CELL_H;
  const canvas = el("canvas", { class: "heatmap-canvas" });
  canvas.width = Math.round(width * dpr);
  canvas.height = Math.round(height * dpr);
  canvas.style.width = `${width}px`;
  canvas.style.height = `${height}px`;

  const originRow = origin && origin.layer != null ? layers.indexOf(origin.layer) : -1;
  const originColumn = originColumnOf(origin, steps);

  const rowLabels = el("div", { class: "heatmap-rows" });
  layers.forEach((layer, r) => {
    rowLabels.append(
      el("div", {
        class: r === originRow ? "heatmap-row-label origin" : "heatmap-row-label",
        text: truncateLeft(layer, 34),
        title: layer,
        data: { layer, origin: r === originRow ? "true" : null },
      }),
    );
  });
  const colLabels = el("div", { class: "heatmap-cols" });
  colLabels.style.width = `${width}px`;
  for (const c of labelledColumns(steps, cellW, originColumn)) {
    const step = steps[c];
    const label = el("span", {
      class: c === originColumn ? "heatmap-col-label origin" : "heatmap-col-label",
      text: String(step),
      data: { step },
    });
    label.style.left = `${c * cellW}px`;
    colLabels.append(label);
  }

  const tooltip = el("div", { class: "heatmap-tooltip", data: { field: "hover" } });
  tooltip.hidden = true;
  const plotArea = el("div", { class: "heatmap-plot" }, [canvas]);
  plotArea.style.width = `${width}px`;
  plotArea.style.height = `${height}px`;
  if (originColumn >= 0) {
    const box = el("div", {
      class: "heatmap-origin",
      title: `origin: ${origin.layer ?? "(no layer)"} at step ${origin.step} (${phaseLabel(origin.phase)})`,
      data: { origin: "true", layer: origin.layer, step: origin.step, row: originRow >= 0 ? originRow : null },
    });
    box.style.left = `${originColumn * cellW - 1}px`;
    box.style.width = `${cellW + 2}px`;
    box.style.top = originRow >= 0 ? `${originRow * CELL_H - 1}px` : "0px";
    box.style.height = originRow >= 0 ? `${CELL_H + 2}px` : `${height}px`;
    plotArea.append(box);
  }
  plotArea.append(tooltip);
  container.append(
    el("div", { class: "heatmap-grid" }, [
      el("div", { class: "heatmap-corner muted", text: "layer \\ step" }),
      colLabels,
      rowLabels,
      plotArea,
    ]),
  );

  function draw() {
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const missing = cssColor("--missing");
    const matrix = heatmap[metric] || [];
    const range = logRange(matrix);
    const span = range && range.hi > range.lo ? range.hi - range.lo : 1;
    legendLo.textContent = range ? fmt(10 ** range.lo, 2) : "–";
    legendHi.textContent = range ? fmt(10 ** range.hi, 2) : "–";
    for (let r = 0; r < layers.length; r++) {
      for (let c = 0; c < steps.length; c++) {
        const v = matrix[r] ? matrix[r][c] : null;
        let color = missing;
        if (typeof v === "number" && !Number.isFinite(v)) color = NONFINITE_COLOR;
        else if (typeof v === "number") color = v > 0 && range ? colorAt((Math.log10(v) - range.lo) / span) : colorAt(0);
        ctx.fillStyle = color;
        ctx.fillRect(c * cellW, r * CELL_H, cellW - 1, CELL_H - 1);
        const flagged = heatmap.nonfinite && heatmap.nonfinite[r] && heatmap.nonfinite[r][c];
        if (flagged && color !== NONFINITE_COLOR) {
          ctx.fillStyle = NONFINITE_COLOR;
          ctx.beginPath();
          ctx.moveTo(c * cellW + cellW - 1, r * CELL_H);
          ctx.lineTo(c * cellW + cellW - 1, r * CELL_H + 8);
          ctx.lineTo(c * cellW + cellW - 1 - Math.min(8, cellW - 2), r * CELL_H);
          ctx.fill();
        }
      }
    }
    const sc = selectedStep === null ? -1 : steps.indexOf(selectedStep);
    if (sc >= 0) {
      ctx.strokeStyle = cssColor("--accent");
      ctx.lineWidth = 2;
      ctx.strokeRect(sc * cellW + 1, 1, cellW - 3, height - 2);
    }
  }

  function cellAt(e) {
    const rect = canvas.getBoundingClientRect();
    const c = Math.floor((e.clientX - rect.left) / cellW);
    const r = Math.floor((e.clientY - rect.top) / CELL_H);
    if (c < 0 || r < 0 || c >= steps.length || r >= layers.length) return null;
    return { r, c };
  }

  function setMetric(name) {
    metric = name;
    container.dataset.metric = name;
    for (const b of buttons) b.setAttribute("aria-pressed", String(b.dataset.metric === name));
    definition.textContent = `Cells: ${METRICS.find((m) => m.key === name).what} at each step, on a log colour scale.`;
    draw();
  }

  canvas.addEventListener("mousemove", (e) => {
    const cell = cellAt(e);
    if (!cell) {
      tooltip.hidden = true;
      return;
    }
    const v = heatmap[metric]?.[cell.r]?.[cell.c];
    const flagged = heatmap.nonfinite?.[cell.r]?.[cell.c];
    const label = METRICS.find((m) => m.key === metric).label;
    const other = flagged && !(typeof v === "number" && !Number.isFinite(v)) ? " · NaN/Inf in another tensor of the layer" : "";
    tooltip.textContent = `${layers[cell.r]}\nstep ${steps[cell.c]} · ${label} = ${fmt(v ?? null)}${other}`;
    tooltip.hidden = false;
    tooltip.style.left = `${Math.min(cell.c * cellW + cellW + 4, Math.max(0, width - 160))}px`;
    tooltip.style.top = `${cell.r * CELL_H + CELL_H + 2}px`;
  });
  canvas.addEventListener("mouseleave", () => {
    tooltip.hidden = true;
  });
  canvas.addEventListener("click", (e) => {
    const cell = cellAt(e);
    if (cell && opts.onStepClick) opts.onStepClick(steps[cell.c]);
  });

  setMetric(metric);
  return {
    setSelectedStep(step) {
      selectedStep = step;
      draw();
    },
    setMetric,
    redraw: draw,
  };
}
