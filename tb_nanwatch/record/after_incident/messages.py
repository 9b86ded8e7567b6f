"""The words of NanWatch's console blocks: an incident, an explosion, the replay's op.

Each block says what went wrong, when and where, the cause, the first remedy
and whether it is tried, the run dir and the ``report`` command: one block a
run, written by the session through
:data:`~tb_nanwatch.record.after_incident.console.CONSOLE`. Every name is made
printable (no control character from a layer name reaches the terminal).
"""

from __future__ import annotations

import math

from tb_nanwatch.evidence import causes
from tb_nanwatch.evidence.printable import printable


def describe_incident(incident: dict) -> str:
    """The one-line description of an incident (console, ``NonFiniteError``);
    names are made printable (no control character reaches the terminal)."""
    return printable(
        f"first non-finite value ({incident['kind']}) at step {incident['step']} "
        f"(epoch {incident.get('epoch')}, batch {incident.get('batch')}), "
        f"born in the {incident['phase']} phase, {_where(incident)}"
    )


def _where(incident: dict) -> str:
    """Where in the step: a layer, the loss or an input; never "layer None"."""
    tensor = incident.get("tensor")
    if incident.get("layer"):
        return f"at layer {incident['layer']} ({tensor})"
    if incident["phase"] == "loss":
        return f"in the loss ({tensor})"
    if incident["phase"] == "input":
        return f"in the input ({tensor})"
    return f"in {tensor}"


def cause_lines(cause: dict | None, plan: str) -> list[str]:
    """The cause in a line, then its first remedy and ``plan`` (whether and
    when it is tried)."""
    if not cause:
        return ["  cause: none judged"]
    lines = [f"  cause {cause.get('id')}: {cause.get('summary', '')}"]
    remedies = cause.get("remedies") or []
    if remedies:
        lines.append(f"  first remedy: {causes.remedy_text(remedies[0])} ({plan})")
    return lines


def first_remedy_id(cause: dict | None) -> str | None:
    """The id of the cause's first remedy, None when it offers none."""
    remedies = (cause or {}).get("remedies") or []
    first = remedies[0] if remedies else None
    return first.get("id") if isinstance(first, dict) else None


def where_to_look(run_dir: str) -> str:
    return f"  run dir: {run_dir}   details: tb-nanwatch report {run_dir}"


def incident_block(
    incident: dict, cause_text: list[str], run_dir: str, bundle: str | None
) -> list[str]:
    """The block at an incident: what, when, where, the cause, where to look."""
    lines = [f"NanWatch: {describe_incident(incident)}", *cause_text, where_to_look(run_dir)]
    if bundle:
        lines.append(f"  reproduction bundle: {bundle}   (tb_nanwatch.load_bundle)")
    return [printable(line) for line in lines]


def explosion_block(
    onset: dict, cause_text: list[str], lr: float | None, run_dir: str
) -> list[str]:
    """The block at an explosion: the signal, the onset step, its growth, the
    learning rate at the onset (and a jump), the cause, where to look."""
    what = str(onset.get("signal", "a signal"))
    if onset.get("layer"):
        what = f"{what} of layer {onset['layer']}"
    lines = [f"NanWatch: {what} exploded from step {int(onset['step'])} (no NaN/Inf yet)"]
    factor = onset.get("factor")
    if isinstance(factor, (int, float)) and math.isfinite(factor):
        lines.append(f"  growth: {factor:.3g}x its reference level")
    jump = onset.get("lr_change")
    rate = f"learning rate at the onset: {lr:.4g}" if lr is not None else ""
    if isinstance(jump, dict):
        change = f"it jumped {jump['from']:.4g} -> {jump['to']:.4g} at step {jump['step']}"
        rate = f"{rate}; {change}" if rate else f"learning rate: {change}"
    if rate:
        lines.append(f"  {rate}")
    lines += [*cause_text, where_to_look(run_dir)]
    return [printable(line) for line in lines]


def replay_line(step: int, origin, output: str | None) -> str:
    """The replay's op in one line (``origin``: the replay's ``OpOrigin``) and
    where TensorFlow's check output was kept."""
    kept = f"; TensorFlow's check output: {output}" if output else ""
    if not origin.type:
        return printable(f"NanWatch replay: step {step}: not reproduced: {origin.detail}{kept}")
    verdict = "reproduced" if origin.reproduced else f"NOT reproduced ({origin.detail})"
    source = origin.source or "no user frame found"
    return printable(
        f"NanWatch replay: step {step}: first non-finite value from op {origin.type} "
        f"({origin.name}), {origin.phase} phase, at {source}; {verdict}{kept}"
    )
