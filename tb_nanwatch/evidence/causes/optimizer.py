"""Rules on the update: every gradient was finite, the optimizer step was not."""

from __future__ import annotations

import math

import numpy as np

from tb_nanwatch.evidence import diagnosis
from tb_nanwatch.evidence.causes.case import Case, Finding, text_or_none, weights_before
from tb_nanwatch.evidence.causes.growth import SERIES_REPLAY
from tb_nanwatch.evidence.remedies import fmt

# A learning rate this many times its median before the step is a spike.
LR_SPIKE = 10.0


def lr_history(case: Case) -> tuple[float | None, float | None]:
    """(lr at the incident step, median lr over the steps before it)."""
    lr = case.header("lr", case.step)
    before = []
    series = case.rec.series
    if series is not None and "lr" in series.columns:
        keep = series.steps < case.step
        before = series.columns["lr"][keep][-SERIES_REPLAY:].astype(np.float64).tolist()
    elif case.rec.flight is not None:
        index = case.rec.schema.header_index("lr")
        before = [float(case.rec.flight.vector(s)[index]) for s in case.rec.flight.steps]
        before = before[: max(0, case.step - case.rec.flight.first_step)]
    before = [v for v in before if math.isfinite(v)]
    return lr, (float(np.median(before)) if before else None)


def _zero_gradients(case: Case) -> int | None:
    vector = case.vector
    if vector is None:
        return None
    entries = case.rec.schema.find(phase="backward", kind="grad_var")
    return sum(1 for e in entries if vector[e.index("norm")] == 0.0)


def optimizer_update(case: Case) -> Finding | None:
    """Every gradient was finite; the update made a weight non-finite."""
    if case.incident.get("phase") != "update":
        return None
    weights = weights_before(case, case.incident.get("layer"))
    if weights is None:
        return None  # it may have been non-finite before the step
    lr, lr_before = lr_history(case)
    kind = diagnosis.KIND_TEXT.get(str(case.incident.get("kind")))
    return Finding(
        f"Every gradient was finite at step {case.step}, but the update made "
        f"{case.incident.get('tensor')} {kind}"
        f" (learning rate {fmt(lr)}, {fmt(lr_before)} before).",
        {
            "tensor": case.incident.get("tensor"),
            "step": case.step,
            "lr": lr,
            "lr_before": lr_before,
            "lr_ratio": lr / lr_before if lr is not None and lr_before else None,
            "zero_gradients": _zero_gradients(case),
            "optimizer": text_or_none(case.rec.summary.get("optimizer")),
            "weights_before": weights,
        },
    )


def adam_epsilon(case: Case) -> Finding | None:
    """Sign: the update broke while a variable's gradient was exactly zero."""
    rec = case.rec
    if rec.phase != "update" or rec.step is None:
        return None
    vector = rec.vector(rec.step)
    if vector is None:
        return None
    zero = []
    for entry in rec.schema.find(phase="backward", kind="grad_var"):
        finite = not diagnosis.entry_nonfinite(vector, entry)
        if finite and rec.schema.values(vector, entry)["norm"] == 0.0:
            zero.append(entry)
    if not zero:
        return None
    same_layer = [e for e in zero if e.layer == rec.incident.get("layer")]
    entry = (same_layer or zero)[0]
    return Finding(
        f"All gradients were finite at step {rec.step}, yet the update made "
        f"{rec.incident.get('tensor')} non-finite; the {entry.tensor} was exactly 0 "
        f"at that step ({len(zero)} variable(s) with a zero gradient). Adaptive "
        "optimizers (Adam, RMSprop) divide by sqrt(v) + epsilon: raise epsilon "
        "(e.g. 1e-7 -> 1e-4, more under float16).",
        {
            "variable": str(rec.incident.get("tensor")),
            "zero_gradient": entry.tensor,
            "grad_norm": 0.0,
            "zero_gradients": len(zero),
            "optimizer": text_or_none(rec.summary.get("optimizer")),
            "step": rec.step,
        },
    )
