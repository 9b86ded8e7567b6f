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
