/** Per-layer table of one step (`step` route). */
import { el, clear } from "./dom.js";
import { counted, fmt, isNonFinite, truncateLeft } from "./format.js";
import { isTextKey, phaseLabel } from "./vocabulary.js";

/** The row keys shown, in order; a key the vocabulary does not call text is a number. */
const COLUMNS = ["phase", "layer", "tensor", "nan", "inf", "min", "max", "max_abs", "norm", "value"];

/**
 * The text of one cell.
 * @param {string} column Column name.
 * @param {Object} row A row of the `step` route.
 * @returns {string} Numbers as `fmt`, phases by label, long layer paths shortened.
 */
function cellText(column, row) {
  const value = row[column];
  if (!isTextKey(column)) return fmt(value ?? null);
  if (column === "layer" && value) return truncateLeft(value, 44);
  if (column === "phase") return phaseLabel(value);
  return value ?? "–";
}

/**
 * Nearest recorded steps to `step`.
 * @param {number[]} recorded Recorded steps (any order).
 * @param {number} step The wanted step.
 * @param {number} [count] How many to return.
 * @returns {number[]} Up to `count` steps, nearest first.
 */
export function nearestSteps(recorded, step, count = 6) {
  return [...(recorded || [])]
    .sort((a, b) => Math.abs(a - step) - Math.abs(b - step) || a - b)
    .slice(0, count);
}

/**
 * True when a table cell is alarming: a non-finite value or a non-zero NaN/Inf count.
 * @param {string} column Column name.
 * @param {*} value Cell value.
 * @returns {boolean} Whether to highlight.
 */
export function isBadCell(column, value) {
  if (isNonFinite(value)) return true;
  return (column === "nan" || column === "inf") && typeof value === "number" && value !== 0;
}

/**
 * Whether a row is where the incident's first non-finite value was born.
 * @param {Object} row A row of the `step` route.
 * @param {Object|null} incident The run's incident.
 * @param {number} step The table's step.
 * @returns {boolean} True for the origin row.
 */
export function isOriginRow(row, incident, step) {
  if (!incident || incident.step !== step) return false;
  return row.phase === incident.phase && (row.layer ?? null) === (incident.layer ?? null) && row.tensor === incident.tensor;
}

/**
 * Shows a "loading" line.
 * @param {HTMLElement} container The step table container.
 * @param {number} step The step being loaded.
 */
export function renderStepLoading(container, step) {
  clear(container);
  container.dataset.state = "loading";
  container.dataset.step = String(step);
  container.append(el("p", { class: "muted", text: `Loading step ${step}…` }));
}

/**
 * Renders the per-layer table.
 * @param {HTMLElement} container Element to render into.
 * @param {Object} data The `step` route response.
 * @param {Object|null} [incident] The run's incident: its origin row is singled
 *   out (`tr.origin`, `data-origin="true"`) and scrolled to.
 */
export function renderStepTable(container, data, incident = null) {
  clear(container);
  container.classList.add("step-table");
  container.dataset.state = "ready";
  container.dataset.step = String(data.step);
  const rows = data.rows || [];
  const bad = rows.filter((r) => COLUMNS.some((c) => isBadCell(c, r[c]))).length;
  container.append(
    el("h4", { text: `Step ${data.step} · ${counted(rows.length, "tensor")} (${data.source} record)` }),
    el("p", { class: bad ? "warn" : "muted", data: { field: "bad-rows" }, text: bad ? `${counted(bad, "tensor")} with NaN/Inf (highlighted).` : "All tensors finite." }),
  );
  const head = el("tr", {}, COLUMNS.map((c) => el("th", { text: c.replace("_", " ") })));
  const body = el("tbody");
  let originRow = null;
  for (const row of rows) {
    const rowBad = COLUMNS.some((c) => isBadCell(c, row[c]));
    const origin = isOriginRow(row, incident, data.step);
    const tr = el(
      "tr",
        {
          class: [rowBad ? "bad" : "", origin ? "origin" : ""].join(" ").trim() || null,
          title: origin ? "origin: the first non-finite value was born here" : null,
          data: { phase: row.phase, layer: row.layer, origin: origin ? "true" : null },
        },
        COLUMNS.map((c) =>
          el("td", {
            class: `${isTextKey(c) ? "" : "num"}${isBadCell(c, row[c]) ? " nonfinite" : ""}`.trim() || null,
            data: { col: c },
            title: c === "layer" && row.layer ? row.layer : null,
            text: cellText(c, row),
          }),
        ),
      );
    if (origin) originRow = tr;
    body.append(tr);
  }
  const scroller = el("div", { class: "table-scroll" }, [el("table", {}, [el("thead", {}, [head]), body])]);
  container.append(scroller);
  container.dataset.originShown = String(Boolean(originRow));
  if (originRow) {
    // Scroll the table (not the page) so that the origin row sits below the sticky header.
    scroller.scrollTop = Math.max(0, originRow.offsetTop - head.offsetHeight - 2 * originRow.offsetHeight);
  }
}

/**
 * Renders the "not recorded" message with links to the nearest recorded steps.
 * @param {HTMLElement} container Element to render into.
 * @param {number} step The step asked for.
 * @param {number[]} recorded Recorded steps of the run (timeline's `recorded_steps`).
 * @param {(step: number) => void} onStepClick Called when a suggested step is clicked.
 */
export function renderStepMissing(container, step, recorded, onStepClick) {
  clear(container);
  container.classList.add("step-table");
  container.dataset.state = "missing";
  container.dataset.step = String(step);
  const near = nearestSteps(recorded, step);
  container.append(
    el("p", {
      class: "muted",
      text: `Step ${step} has no per-layer record (only the flight-recorder window and periodic snapshots are kept).`,
    }),
  );
  if (near.length) {
    container.append(
      el("p", {}, [
        "Nearest recorded steps: ",
        ...near.flatMap((s, i) => [
          i ? " " : null,
          el("button", { class: "btn link", text: String(s), data: { step: s }, on: { click: () => onStepClick(s) } }),
        ]),
      ]),
    );
  }
}

/**
 * Renders an error message.
 * @param {HTMLElement} container Element to render into.
 * @param {string} message The message (text).
 */
export function renderStepError(container, message) {
  clear(container);
  container.dataset.state = "error";
  container.append(el("p", { class: "warn", text: message }));
}
