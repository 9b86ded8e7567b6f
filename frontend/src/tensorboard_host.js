/**
 * The plugin's line to TensorBoard's page, over TensorBoard's experimental
 * plugin API: the iframe posts "experimental.bootstrap" with a MessagePort to
 * its parent; TensorBoard then sends JSON messages `{type, id, payload,
 * error, isReply}` on that port, among them "experimental.DataReloaded"
 * each time its data were reloaded (the reload button and auto-reload).
 * Every message is answered, as TensorBoard's own plugin library does.
 */

const BOOTSTRAP = "experimental.bootstrap";
const DATA_RELOADED = "experimental.DataReloaded";

/**
 * Calls `onReload` whenever TensorBoard reloads its data. Does nothing
 * outside a TensorBoard iframe (e.g. the exported HTML file).
 * @param {() => void} onReload Called on each reload.
 * @returns {boolean} True when connected to a parent page.
 */
export function onTensorBoardReload(onReload) {
  if (window.parent === window) return false;
  const channel = new MessageChannel();
  const port = channel.port1;
  port.addEventListener("message", (event) => {
    let message;
    try {
      message = JSON.parse(event.data);
    } catch (_) {
      return;
    }
    if (!message || message.isReply) return;
    if (message.type === DATA_RELOADED) onReload();
    port.postMessage(JSON.stringify({ type: message.type, id: message.id, payload: null, error: null, isReply: true }));
  });
  port.start();
  window.parent.postMessage(BOOTSTRAP, "*", [channel.port2]);
  return true;
}
