/**
 * The tab's vocabulary, as Python sends it (the `vocabulary` route, built by
 * tb_nanwatch/evidence/vocabulary.py): the labels of cause ids, remedy ids,
 * phases and incident kinds, the JSON keys that hold text, and the words that
 * stand for non-finite numbers. `render()` loads it once; the views read it
 * here and keep no list of their own.
 */

let current = null;
/** Lookups built once per vocabulary object (see `encodingOf`). */
const encodings = new WeakMap();

/**
 * Makes `vocab` the vocabulary every view reads from now on.
 * @param {{causes: Object<string, string>, remedies: Object<string, string>,
 *          phases: Object<string, string>, incident_kinds: Object<string, string>,
 *          text_keys: string[], non_finite: {nan: string, posinf: string, neginf: string}}} vocab
 *   The `vocabulary` route's answer, as parsed JSON.
 */
export function useVocabulary(vocab) {
  current = vocab;
}

/** @returns {boolean} Whether a vocabulary was loaded. */
export const hasVocabulary = () => current !== null;

/**
 * @returns {Object} The vocabulary in use.
 * @throws {Error} Before `useVocabulary`.
 */
export function vocabulary() {
  if (current === null) throw new Error("the tab's vocabulary is not loaded");
  return current;
}

/**
 * The label of an id in one of the vocabulary's tables.
 * @param {"causes"|"remedies"|"phases"|"incident_kinds"} table Table name.
 * @param {string|null|undefined} id The id.
 * @returns {string} Its label; an id the table lacks reads as itself ("–" for none).
 */
export function labelOf(table, id) {
  const labels = vocabulary()[table] || {};
  return Object.prototype.hasOwnProperty.call(labels, id) ? labels[id] : String(id ?? "–");
}

/**
 * The text keys as a Set and the non-finite words as a Map to numbers.
 * @param {Object} vocab A vocabulary.
 * @returns {{textKeys: Set<string>, numbers: Map<string, number>, words: Object}} Lookups.
 */
export function encodingOf(vocab) {
  let found = encodings.get(vocab);
  if (!found) {
    const words = vocab.non_finite;
    found = {
      textKeys: new Set(vocab.text_keys),
      numbers: new Map([[words.nan, NaN], [words.posinf, Infinity], [words.neginf, -Infinity]]),
      words,
    };
    encodings.set(vocab, found);
  }
  return found;
}

/**
 * @param {string} key A JSON key.
 * @returns {boolean} Whether its values are text (never revived into numbers).
 */
export const isTextKey = (key) => encodingOf(vocabulary()).textKeys.has(key);

/**
 * The word the routes write for a non-finite number.
 * @param {number} v NaN, Infinity or -Infinity.
 * @returns {string} e.g. "NaN", "Infinity", "-Infinity".
 */
export function nonFiniteWord(v) {
  const { words } = encodingOf(vocabulary());
  if (Number.isNaN(v)) return words.nan;
  return v > 0 ? words.posinf : words.neginf;
}

/**
 * Human text of an incident kind.
 * @param {string} kind The kind from the backend, e.g. "nan+inf".
 * @returns {string} e.g. "NaN and Inf".
 */
export const kindLabel = (kind) => labelOf("incident_kinds", kind);

/**
 * @param {string} phase A phase, e.g. "forward".
 * @returns {string} Its label.
 */
export const phaseLabel = (phase) => labelOf("phases", phase);
