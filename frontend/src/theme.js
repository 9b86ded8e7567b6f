/**
 * Light or dark, as TensorBoard shows it. TensorBoard toggles the class
 * `dark-mode` on its own `document.body` (its dark-mode-supporter component:
 * the user's override, else the browser's prefers-color-scheme). The plugin
 * iframe has the same origin, so it reads that class and watches it; outside
 * TensorBoard (the exported HTML file) it follows prefers-color-scheme.
 *
 * The page's colours are CSS variables switched by `data-theme` on <html>;
 * canvases read them through `cssColor`.
 */

const DARK_CLASS = "dark-mode";

/** TensorBoard's body when this page is its plugin iframe, else null. */
function tensorboardBody() {
  try {
    if (window.parent === window) return null;
    return window.parent.document.body || null;
  } catch (_) {
    return null; // another origin: not TensorBoard's plugin iframe
  }
}

/**
 * The value of a CSS colour variable of the page, e.g. cssColor("--fg").
 * @param {string} name Variable name.
 * @returns {string} Its value, trimmed.
 */
export function cssColor(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

/**
 * Sets `data-theme` on <html> now and whenever TensorBoard's (or the
 * browser's) mode changes; calls `onChange(theme)` after each change.
 * @param {(theme: "light"|"dark") => void} onChange Called when the theme changed.
 * @returns {"light"|"dark"} The theme now.
 */
export function followTheme(onChange) {
  const body = tensorboardBody();
  const media = window.matchMedia ? window.matchMedia("(prefers-color-scheme: dark)") : null;
  const isDark = () => (body ? body.classList.contains(DARK_CLASS) : Boolean(media && media.matches));
  const apply = () => {
    const theme = isDark() ? "dark" : "light";
    if (document.documentElement.dataset.theme === theme) return theme;
    document.documentElement.dataset.theme = theme;
    return theme;
  };
  const update = () => {
    const before = document.documentElement.dataset.theme;
    const theme = apply();
    if (theme !== before) onChange(theme);
  };
  if (body) new MutationObserver(update).observe(body, { attributes: true, attributeFilter: ["class"] });
  else media?.addEventListener?.("change", update);
  return apply();
}
