/**
 * Tiny DOM helpers. Text is only ever set through `textContent`: run names,
 * layer paths and hints come from user data and must never become HTML.
 */

/**
 * Creates an element.
 * @param {string} tag Tag name.
 * @param {{class?: string, text?: *, title?: string, data?: Object<string, *>,
 *          attrs?: Object<string, *>, on?: Object<string, Function>}} [opts] Options.
 * @param {Array<Node|string|null|undefined>} [children] Children; strings become text nodes.
 * @returns {HTMLElement} The element.
 */
export function el(tag, opts = {}, children = []) {
  const node = document.createElement(tag);
  if (opts.class) node.className = opts.class;
  if (opts.text !== undefined && opts.text !== null) node.textContent = String(opts.text);
  if (opts.title) node.title = opts.title;
  for (const [k, v] of Object.entries(opts.data || {})) {
    if (v !== undefined && v !== null) node.dataset[k] = String(v);
  }
  for (const [k, v] of Object.entries(opts.attrs || {})) {
    if (v !== undefined && v !== null && v !== false) node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const [event, handler] of Object.entries(opts.on || {})) node.addEventListener(event, handler);
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(typeof child === "string" ? document.createTextNode(child) : child);
  }
  return node;
}

/**
 * Removes all children of a node.
 * @param {Node} node The node to empty.
 */
export function clear(node) {
  while (node.firstChild) node.removeChild(node.firstChild);
}

/** Characters after which a name may break onto the next line. */
const NAME_BREAKS = /([_/\-.:=,]+)/;

/**
 * A name (a run, a layer path) as text nodes with a line-break opportunity
 * (`<wbr>`) after each `_ / - . : = ,`, so a long name wraps between its
 * words, never inside one (with `overflow-wrap: break-word` in the CSS, a
 * single word wider than its box still breaks rather than overflow).
 * @param {string} name The name.
 * @returns {Node[]} The nodes, to pass to `el` as children.
 */
export function breakableName(name) {
  const nodes = [];
  for (const part of String(name).split(NAME_BREAKS)) {
    if (!part) continue;
    nodes.push(document.createTextNode(part));
    if (NAME_BREAKS.test(part)) nodes.push(document.createElement("wbr"));
  }
  return nodes;
}
