/**
 * The timeline's data and zoom controller: what to fetch, when, and which
 * response is current. No drawing here (see timeline_plot.js).
 *
 * The whole run is fetched once (reduced to at most MAX_POINTS buckets);
 * every zoom asks the server for the visible range again, so a zoomed view
 * of at most MAX_POINTS steps is exact (bucket 1). Requests are debounced,
 * and a newer request aborts an older one.
 */
import { fetchTimeline } from "./api.js";

export const MAX_POINTS = 4000;
/** The route's largest `max_points` (plugin.MAX_MAX_POINTS): a download reads windows this long. */
const DOWNLOAD_WINDOW = 8000;
const REFETCH_DELAY_MS = 150;

/**
 * One timeline response from consecutive exact windows of one run (steps and
 * every column concatenated; NaN/Infinity kept as they came).
 * @param {Object[]} parts Responses for [0, w), [w, 2w), ... in order.
 * @returns {Object} A response covering them all, bucket 1.
 */
export function joinWindows(parts) {
  const [first] = parts;
  const columns = {};
  for (const name of Object.keys(first.columns)) {
    columns[name] = parts.flatMap((part) => part.columns[name] ?? []);
  }
  return {
    ...first,
    start: first.start,
    end: parts[parts.length - 1].end,
    bucket: 1,
    steps: parts.flatMap((part) => part.steps),
    columns,
  };
}

/**
 * The step range to fetch for a visible x range, or null when the data held
 * already shows it as well as a fetch would.
 * @param {Object} current The response on screen.
 * @param {Object} full The whole-run response.
 * @param {{start: number, end: number}|null} requested The last range asked for.
 * @param {number} min Visible x minimum (steps, may be fractional).
 * @param {number} max Visible x maximum.
 * @returns {{start: number, end: number}|null} Steps [start, end) to fetch.
 */
export function rangeToFetch(current, full, requested, min, max) {
  const start = Math.max(0, Math.floor(min));
  const end = Math.min(current.total_steps, Math.floor(max) + 1);
  if (end <= start) return null;
  const last = current.steps.length - 1;
  if (current === full && (last < 0 || (min <= current.steps[0] && max >= current.steps[last]))) return null; // whole run shown
  if (requested && requested.start === start && requested.end === end) return null;
  if (current.bucket === 1 && current.start <= start && end <= current.end) return null; // already exact
  return { start, end };
}

/**
 * The step a click on point `idx` means: the point's first step, or in a
 * bucket of several steps the first one that has a per-layer record.
 * @param {Object} tl A `timeline` response.
 * @param {number} idx Point index.
 * @returns {number} The step.
 */
export function stepOfPoint(tl, idx) {
  const step = tl.steps[idx];
  if (tl.bucket <= 1) return step;
  const inBucket = (tl.recorded_steps || []).filter((s) => s >= step && s < step + tl.bucket);
  return inBucket.length ? inBucket[0] : step;
}

/**
 * Creates the data controller of one run's timeline.
 * @param {string} run Run name.
 * @param {{onState: (state: "loading"|"ready"|"error", message?: string) => void,
 *          onRange: (tl: Object, view: {min: number, max: number}) => void}} events `onState` on every state
 *   change; `onRange` with the visible range it was fetched for, when a
 *   zoomed range arrived (not for `load`/`reset`).
 * @returns {{load: () => Promise<Object|null>, fetchWhole: () => Promise<Object>, showRange: (min: number, max: number) => void,
 *            reset: () => Object|null, destroy: () => void,
 *            get current(): Object|null, get full(): Object|null}} Controller.
 */
export function createTimelineData(run, events) {
  let current = null; // the response on screen (raw, with non-finite numbers)
  let full = null; // the whole-run response
  let requested = null; // {start, end} of the last range request
  let controller = null;
  let timer = 0;
  let seq = 0;

  async function fetchRange(range) {
    controller?.abort();
    controller = new AbortController();
    const mine = ++seq;
    events.onState("loading");
    try {
      const data = await fetchTimeline(run, { ...range, maxPoints: MAX_POINTS }, controller.signal);
      return mine === seq ? data : null;
    } catch (err) {
      if (err.name !== "AbortError") events.onState("error", `Could not load the timeline: ${err.message}`);
      return null;
    }
  }

  async function fetchVisible(min, max) {
    if (!current || !full) return;
    const range = rangeToFetch(current, full, requested, min, max);
    if (!range) return;
    requested = range;
    const data = await fetchRange(range);
    if (!data) return;
    current = data;
    events.onState("ready");
    events.onRange(current, { min, max });
  }

  return {
    /** Fetches the whole run; resolves with it (null when aborted or failed); the caller says when it is shown. */
    async load() {
      const data = await fetchRange({});
      if (!data) return null;
      full = current = data;
      requested = null;
      return data;
    },
    /** Fetches the whole run, every step exactly, in windows the route accepts (for downloads). */
    async fetchWhole() {
      const first = await fetchTimeline(run, { start: 0, end: DOWNLOAD_WINDOW, maxPoints: DOWNLOAD_WINDOW });
      const parts = [first];
      for (let start = DOWNLOAD_WINDOW; start < first.total_steps; start += DOWNLOAD_WINDOW) {
        const end = start + DOWNLOAD_WINDOW;
        parts.push(await fetchTimeline(run, { start, end, maxPoints: DOWNLOAD_WINDOW }));
      }
      return joinWindows(parts);
    },
    /** The user now sees [min, max]: fetch it exactly, soon, if needed. */
    showRange(min, max) {
      clearTimeout(timer);
      timer = setTimeout(() => fetchVisible(min, max), REFETCH_DELAY_MS);
    },
    /** Back to the whole run, cancelling pending requests; returns it. */
    reset() {
      requested = null;
      clearTimeout(timer);
      seq++;
      controller?.abort();
      if (!full) return null;
      current = full;
      events.onState("ready");
      return full;
    },
    destroy() {
      clearTimeout(timer);
      controller?.abort();
    },
    get current() {
      return current;
    },
    get full() {
      return full;
    },
  };
}
