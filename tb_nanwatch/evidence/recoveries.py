"""What a recovering watcher did (``on_nonfinite="skip"``/``"rewind"``), as
the run summary holds it, checked for the readers.

The summary (written by ``record/after_incident/recovery.py``) holds ``recoveries`` (one
entry a rewind: ``{"step", "rewound_to", "remedy": {"id", "setting"},
"skipped_batches"}``, with ``"onset"`` for an explosion), the steps skipped
(``skipped_nonfinite_steps``), why the run fell back to skipping
(``skip_fallback``) and why recovering stopped training (``recovery_stopped``).
A run dir may come from anyone: every reader takes them through this module,
which leaves out what is malformed and bounds how much is read. Pure Python.
"""

from __future__ import annotations

from typing import Any

from tb_nanwatch.evidence.limits import count

# At most this many recoveries and skipped steps are read from a summary.
MAX_RECOVERIES = 1000
MAX_SKIPPED = 10_000
MAX_TEXT = 500


def _text(value: object) -> str:
    return value[:MAX_TEXT] if isinstance(value, str) else ""


def recoveries(summary: dict) -> list[dict]:
    """The rewinds of a run (``[]`` for none or for a malformed list), each
    ``{"step", "rewound_to", "remedy": {"id", "setting"}, "skipped_batches"}``
    (``"onset"`` too when an explosion started it)."""
    entries = summary.get("recoveries") if isinstance(summary, dict) else None
    if not isinstance(entries, list):
        return []
    out = []
    for entry in entries[:MAX_RECOVERIES]:
        parsed = _recovery(entry)
        if parsed is not None:
            out.append(parsed)
    return out


def _recovery(entry: object) -> dict | None:
    if not isinstance(entry, dict):
        return None
    fields = {k: count(entry.get(k)) for k in ("step", "rewound_to", "skipped_batches")}
    remedy = entry.get("remedy")
    if any(v is None for v in fields.values()) or not isinstance(remedy, dict):
        return None
    parsed: dict[str, Any] = {
        **fields,
        "remedy": {"id": _text(remedy.get("id")), "setting": _text(remedy.get("setting"))},
    }
    onset = count(entry.get("onset"))
    if onset is not None:
        parsed["onset"] = onset
    return parsed


def skipped_nonfinite_steps(summary: dict) -> list[int]:
    """The steps a recovering watcher did not apply (non-finite)."""
    steps = summary.get("skipped_nonfinite_steps") if isinstance(summary, dict) else None
    if not isinstance(steps, list):
        return []
    return [s for s in steps[:MAX_SKIPPED] if count(s) is not None]


def _note(summary: dict, key: str) -> dict | None:
    """``{"step", "why"}`` under ``key`` (skip_fallback, recovery_stopped), or None."""
    note = summary.get(key) if isinstance(summary, dict) else None
    if not isinstance(note, dict) or count(note.get("step")) is None:
        return None
    return {"step": note["step"], "why": _text(note.get("why"))}


def skip_fallback(summary: dict) -> dict | None:
    """Where and why a ``"rewind"`` run fell back to skipping, or None."""
    return _note(summary, "skip_fallback")


def recovery_stopped(summary: dict) -> dict | None:
    """Where and why recovering stopped training (``max_skips``, ``max_rewinds``), or None."""
    return _note(summary, "recovery_stopped")


def marker_label(recovery: dict) -> str:
    """The timeline marker's words: ``rewind to 0: clipnorm=1.0``."""
    remedy = recovery["remedy"]
    return f"rewind to {recovery['rewound_to']}: {remedy['setting'] or remedy['id']}"


def recovery_text(recovery: dict) -> str:
    """One line on a rewind, as ``report`` prints it."""
    remedy = recovery["remedy"]
    onset = f" (explosion onset at step {recovery['onset']})" if "onset" in recovery else ""
    batches = recovery["skipped_batches"]
    return (
        f"rewound at step {recovery['step']}{onset} to the state before step "
        f"{recovery['rewound_to']}, {remedy['id']} set ({remedy['setting']}), "
        f"{batches} batch{'es' * (batches != 1)} not trained on again"
    )


def report_lines(summary: dict) -> list[str]:
    """The ``report`` lines of a run's recovery (none for a run that did not recover)."""
    lines = []
    skipped = skipped_nonfinite_steps(summary)
    if skipped:
        shown = ", ".join(str(s) for s in skipped[:20]) + (", ..." if len(skipped) > 20 else "")
        lines.append(f"  non-finite steps not applied (skipped): {len(skipped)}: {shown}")
    lines += [f"  recovery: {recovery_text(r)}" for r in recoveries(summary)]
    fallback = skip_fallback(summary)
    if fallback is not None:
        lines.append(
            f"  recovery: no rewind at step {fallback['step']} ({fallback['why']}); "
            "fell back to skipping non-finite steps"
        )
    stopped = recovery_stopped(summary)
    if stopped is not None:
        lines.append(f"  recovery stopped training at step {stopped['step']}: {stopped['why']}")
    return lines
