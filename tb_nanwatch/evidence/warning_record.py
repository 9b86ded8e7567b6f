"""A run's early warnings as the run summary holds them, checked for the readers.

The summary's ``warnings`` (written by the journal from
:class:`~tb_nanwatch.evidence.warning_watch.EarlyWarnings`) is a list of
``{"step", "kind", "predicted_step", "message", "evidence"}`` (``"outlived"``
once the run ended). A run dir may come from anyone: this module bounds what
is read, leaves out malformed entries, keeps non-finite numbers and makes
every string printable. Pure Python.
"""

from __future__ import annotations

from tb_nanwatch.evidence.early_warnings import KINDS
from tb_nanwatch.evidence.limits import count
from tb_nanwatch.evidence.printable import printable

MAX_WARNINGS = 20
MAX_EVIDENCE = 16
MAX_TEXT = 500


def _scalar(value: object) -> object:
    """A JSON scalar kept (text made printable and bounded), else None."""
    if value is None or isinstance(value, (bool, int, float)):
        return value  # NaN and Inf are evidence: kept
    if isinstance(value, str):
        return printable(value[:MAX_TEXT])
    return None


def warnings_of(summary: object) -> list[dict]:
    """The run's warnings (``[]`` for none or a malformed list), each
    ``{"step", "kind", "predicted_step", "message", "evidence", "outlived"}``."""
    entries = summary.get("warnings") if isinstance(summary, dict) else None
    if not isinstance(entries, list):
        return []
    out = [warning_entry(entry) for entry in entries[:MAX_WARNINGS]]
    return [entry for entry in out if entry is not None]


def warning_entry(entry: object) -> dict | None:
    if not isinstance(entry, dict) or entry.get("kind") not in KINDS:
        return None
    step = count(entry.get("step"))
    if step is None:
        return None
    raw_evidence = entry.get("evidence")
    evidence = {}
    if isinstance(raw_evidence, dict):
        for key, value in list(raw_evidence.items())[:MAX_EVIDENCE]:
            evidence[printable(str(key)[:100])] = _scalar(value)
    message = entry.get("message")
    outlived = entry.get("outlived")
    return {
        "step": step,
        "kind": entry["kind"],
        "predicted_step": count(entry.get("predicted_step")),
        "message": printable(message[:MAX_TEXT]) if isinstance(message, str) else "",
        "evidence": evidence,
        "outlived": outlived if isinstance(outlived, bool) else None,
    }


def warning_line(entry: dict) -> str:
    """One line of text for a warning (the report's and the console's)."""
    predicted = entry.get("predicted_step")
    ahead = "" if predicted is None else f", predicted step {predicted}"
    outlived = " (the run outlived it)" if entry.get("outlived") else ""
    return f"warning at step {entry['step']} [{entry['kind']}{ahead}]: {entry['message']}{outlived}"
