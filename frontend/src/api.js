/**
 * Fetches the plugin's JSON routes (see docs/reference/routes.md).
 *
 * URLs are relative: the plugin iframe has `<base href="plugin/nanwatch/">`,
 * so `fetch("runs")` reaches `data/plugin/nanwatch/runs`, also under
 * TensorBoard's `--path_prefix`.
 *
 * TensorBoard's JSON cleanser writes NaN/±Inf as words (the vocabulary's
 * `non_finite`); `revive` turns them back into numbers, except under the
 * vocabulary's `text_keys` (a layer may well be called "NaN").
 */
import { encodingOf, vocabulary } from "./vocabulary.js";

/** Error thrown for a non-2xx response; `status` is the HTTP status. */
export class ApiError extends Error {
  /**
   * @param {number} status HTTP status code.
   * @param {string} message Server's `error` text or the status text.
   */
  constructor(status, message) {
    super(message);
    this.name = "ApiError";
    this.status = status;
  }
}

/**
 * Turns the non-finite words back into numbers, recursively.
 * @param {*} value Parsed JSON.
 * @param {Object} [vocab] The vocabulary whose `text_keys` and `non_finite` to
 *   use; the loaded one by default.
 * @returns {*} The same structure with non-finite numbers restored.
 */
export function revive(value, vocab = vocabulary()) {
  const { textKeys, numbers } = encodingOf(vocab);
  const walk = (v, isText) => {
    if (typeof v === "string") return !isText && numbers.has(v) ? numbers.get(v) : v;
    if (Array.isArray(v)) return v.map((item) => walk(item, isText));
    if (v && typeof v === "object") {
      const out = {};
      for (const [k, item] of Object.entries(v)) out[k] = walk(item, isText || textKeys.has(k));
      return out;
    }
    return v;
  };
  return walk(value, false);
}

/**
 * Builds a relative route URL with query parameters (undefined/null skipped).
 * @param {string} route Route name, e.g. "timeline".
 * @param {Object<string, *>} [params] Query parameters.
 * @returns {string} e.g. "timeline?run=a%2Fb&start=0".
 */
export function routeUrl(route, params = {}) {
  const query = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) {
    if (v !== undefined && v !== null) query.set(k, String(v));
  }
  const qs = query.toString();
  return qs ? `${route}?${qs}` : route;
}

/**
 * The answer to a route from data embedded in the page (`tb-nanwatch export`
 * writes `window.__NANWATCH_DATA__ = {routes: [{route, params, body}]}`):
 * the entry with exactly these parameters, else the entry of the same route
 * and run without other parameters (e.g. the whole timeline for a zoom).
 * @param {string} route Route name.
 * @param {Object<string, *>} params Query parameters.
 * @returns {*} The JSON body, not yet revived.
 * @throws {ApiError} 404 when the export does not hold it.
 */
function embeddedJson(route, params) {
  const wanted = Object.entries(params).filter(([, v]) => v !== undefined && v !== null);
  const same = (a, b) => a.length === b.length && a.every(([k, v]) => String(b.find(([k2]) => k2 === k)?.[1]) === String(v));
  const entries = globalThis.__NANWATCH_DATA__.routes.filter((e) => e.route === route);
  const byRun = wanted.filter(([k]) => k === "run");
  const hit =
    entries.find((e) => same(wanted, Object.entries(e.params))) ||
    (route === "timeline" ? entries.find((e) => same(byRun, Object.entries(e.params))) : undefined);
  if (!hit) throw new ApiError(404, "not included in this export");
  return hit.body;
}

/**
 * GETs a route and returns its JSON body as it came (not revived).
 * @param {string} route Route name (relative URL).
 * @param {Object<string, *>} [params] Query parameters.
 * @param {AbortSignal} [signal] Optional abort signal.
 * @returns {Promise<*>} The parsed JSON.
 * @throws {ApiError} On a non-2xx response.
 */
async function getBody(route, params = {}, signal = undefined) {
  if (globalThis.__NANWATCH_DATA__) return embeddedJson(route, params);
  const response = await fetch(routeUrl(route, params), { signal, headers: { Accept: "application/json" } });
  let body = null;
  try {
    body = await response.json();
  } catch (_) {
    body = null;
  }
  if (!response.ok) {
    const message = body && typeof body.error === "string" ? body.error : response.statusText;
    throw new ApiError(response.status, message || `HTTP ${response.status}`);
  }
  return body;
}

/**
 * GETs a route and returns its revived JSON body (needs the vocabulary loaded).
 * @param {string} route Route name (relative URL).
 * @param {Object<string, *>} [params] Query parameters.
 * @param {AbortSignal} [signal] Optional abort signal.
 * @returns {Promise<*>} The revived JSON.
 * @throws {ApiError} On a non-2xx response.
 */
export async function getJson(route, params = {}, signal = undefined) {
  return revive(await getBody(route, params, signal));
}

/** @returns {Promise<Object>} The `vocabulary` route (holds no number to revive). */
export const fetchVocabulary = () => getBody("vocabulary");

/** @returns {Promise<{runs: Array<Object>}>} The `runs` route. */
export const fetchRuns = () => getJson("runs");

/**
 * @param {string} run Run name.
 * @param {{start?: number, end?: number, maxPoints?: number}} [range] Step range [start, end).
 * @param {AbortSignal} [signal] Optional abort signal.
 * @returns {Promise<Object>} The `timeline` route.
 */
export const fetchTimeline = (run, range = {}, signal = undefined) =>
  getJson("timeline", { run, start: range.start, end: range.end, max_points: range.maxPoints }, signal);

/**
 * @param {string} run Run name.
 * @returns {Promise<Object>} The `incident` route.
 */
export const fetchIncident = (run) => getJson("incident", { run });

/**
 * @param {string} run Run name.
 * @param {number} step Step number.
 * @returns {Promise<Object>} The `step` route (throws ApiError 404 when not recorded).
 */
export const fetchStep = (run, step) => getJson("step", { run, step });
