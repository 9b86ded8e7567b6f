/**
 * CSV cells that a spreadsheet reads as text, never as a formula.
 *
 * Names in a run dir come from whoever wrote it: a cell such as
 * `=HYPERLINK("http://...")` would run in the spreadsheet that opens the
 * download. As the spreadsheet convention (OWASP "CSV injection") asks, a cell
 * that starts with `=`, `+`, `-`, `@`, a tab or a carriage return is prefixed
 * with a single quote; a number (`-1.5`, `-Infinity`) is left as it is. Then
 * the cell is quoted when it holds a quote, a comma or a line end.
 */

const FORMULA_START = /^[=+\-@\t\r]/;
const NUMBER = /^[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?$|^[+-]?Infinity$/;

/**
 * One CSV cell.
 * @param {string|null} text The cell's text; null for an empty cell.
 * @returns {string} The cell as written in the file.
 */
export function csvCell(text) {
  if (text === null || text === undefined) return "";
  let cell = String(text);
  if (FORMULA_START.test(cell) && !NUMBER.test(cell)) cell = `'${cell}`;
  return /[",\n\r]/.test(cell) ? `"${cell.replace(/"/g, '""')}"` : cell;
}
