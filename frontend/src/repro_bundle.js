/**
 * The incident's reproduction bundle (the `incident` route's `bundle`): its
 * folder, whether it is exact, and the two lines of Python that replay it,
 * with a Copy button.
 */
import { el } from "./dom.js";

/**
 * @param {boolean|null|undefined} exact The bundle's `exact`.
 * @returns {string} What it means for the user.
 */
export function exactText(exact) {
  if (exact === true) return "exact: the batch and the weights from just before the incident step";
  if (exact === false) return "not exact: the batch or the weights are from an earlier step";
  return "exactness not recorded";
}

/** Selects the text of a node, so that Ctrl+C copies it. */
function selectText(node) {
  const range = document.createRange();
  range.selectNodeContents(node);
  const selection = window.getSelection();
  selection.removeAllRanges();
  selection.addRange(range);
}

/**
 * Copies `text` with the clipboard API. Where there is none (TensorBoard
 * served over plain http to another machine is not a secure context) or it
 * is refused, selects the code block instead and tries the older copy command.
 * @param {string} text The text.
 * @param {HTMLElement} code The element showing it.
 * @returns {Promise<"copied"|"selected">} What happened.
 */
export async function copyText(text, code) {
  try {
    if (navigator.clipboard && navigator.clipboard.writeText) {
      await navigator.clipboard.writeText(text);
      return "copied";
    }
  } catch (_) {
    // refused (permissions policy, no focus): fall back to the selection
  }
  selectText(code);
  try {
    if (document.execCommand("copy")) return "copied";
  } catch (_) {
    // not supported: the text stays selected
  }
  return "selected";
}

/**
 * @param {{path: string, exact?: boolean|null, snippet?: string}} bundle The bundle.
 * @returns {HTMLElement} The bundle block (`.bundle`).
 */
export function renderBundle(bundle) {
  return el("section", { class: "bundle", data: { exact: bundle.exact } }, [
    el("h4", { text: "Reproduction bundle" }),
    el("p", { class: "bundle-path" }, [
      "In the run dir: ",
      el("code", { data: { field: "bundle-path" }, text: bundle.path }),
      " (",
      el("span", { data: { field: "bundle-exact" }, text: exactText(bundle.exact) }),
      ")",
    ]),
    bundle.snippet ? renderSnippet(bundle.snippet, "bundle-snippet", "copy-snippet") : null,
  ]);
}

/**
 * A code block with a Copy button (the bundle's lines, a remedy's code).
 * @param {string} text The code.
 * @param {string} field The code element's `data-field`.
 * @param {string} action The button's `data-action`.
 * @returns {HTMLElement} The `.snippet` block.
 */
export function renderSnippet(text, field, action) {
  const code = el("code", { data: { field }, text });
  const status = el("span", { class: "muted copy-status", data: { field: "copy-status" }, attrs: { "aria-live": "polite" } });
  const copy = el("button", { class: "btn", text: "Copy", data: { action } });
  copy.addEventListener("click", async () => {
    const outcome = await copyText(text, code);
    status.textContent = outcome === "copied" ? "Copied" : "Selected: press Ctrl+C to copy";
    copy.dataset.outcome = outcome;
  });
  return el("div", { class: "snippet" }, [
    el("pre", { class: "snippet-code" }, [code]),
    el("div", { class: "snippet-actions" }, [copy, status]),
  ]);
}
