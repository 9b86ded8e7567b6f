"""Rules on the data: weights broken before training, a batch that held NaN/Inf,
inputs or targets far from unit scale."""

from __future__ import annotations

import math

import numpy as np

from tb_nanwatch.evidence import diagnosis
from tb_nanwatch.evidence.causes.case import (
    MAX_LISTED,
    Case,
    Finding,
    count,
    tensor_words,
    weights_at_start,
)
from tb_nanwatch.evidence.causes.growth import growth_candidates
from tb_nanwatch.evidence.causes.math_errors import forward_math
from tb_nanwatch.evidence.remedies import fmt

# Unscaled data: the loss at the first recorded step is at least this (or
# Inf), and the incident comes within EARLY_STEPS of it or after a growth.
HUGE_LOSS = 1e3
EARLY_STEPS = 50


def nonfinite_weights(case: Case) -> Finding | None:
    """A weight was already NaN/Inf when training began: nothing else counts."""
    checked = weights_at_start(case)
    bad = [str(p) for p in (checked or {}).get("nonfinite") or []]
    if not bad:
        return None
    return Finding(
        f"{len(bad)} weight variable(s), first {bad[0]}, held NaN/Inf before the first "
        "training step: the model started broken, training did not make the NaN.",
        {
            "variables": bad[:MAX_LISTED],
            "nonfinite_variables": len(bad),
            "checked": checked.get("checked") if isinstance(checked.get("checked"), int) else None,
            "step": case.step,
        },
    )


def input_rows(batch: object) -> list[dict]:
    """The non-finite sample rows of each array of a batch (bundle arrays).

    ``batch``: a dict name -> array, or a list/tuple (nested) of arrays.
    Returns ``[{"tensor", "rows": [first rows], "rows_count", "values"}]``.
    """
    if isinstance(batch, dict):
        items = [(str(k), v) for k, v in sorted(batch.items())]
    elif isinstance(batch, (list, tuple)):
        items = [(f"batch/{i}", v) for i, v in enumerate(batch)]
    else:
        return []
    found = []
    for name, array in items:
        if isinstance(array, (list, tuple, dict)):
            found += [{**r, "tensor": f"{name}/{r['tensor']}"} for r in input_rows(array)]
            continue
        array = np.asarray(array) if array is not None else None
        if array is None or array.ndim == 0 or not np.issubdtype(array.dtype, np.floating):
            continue
        bad = ~np.isfinite(array.reshape(array.shape[0], -1))
        rows = np.flatnonzero(bad.any(axis=1))
        if len(rows):
            found.append(
                {
                    "tensor": name,
                    "rows": rows[:MAX_LISTED].tolist(),
                    "rows_count": len(rows),
                    "values": int(bad.sum()),
                }
            )
    return found


def input_data(case: Case) -> Finding | None:
    """The batch itself (an input or a target) held NaN/Inf."""
    if case.incident.get("phase") != "input":
        return None
    entry, vector = case.origin_entry(), case.vector
    values = None
    if entry is not None and vector is not None:
        values = count(vector, entry)
    kind = str(case.incident.get("kind", "nan"))
    tensor = tensor_words(case.incident.get("tensor"))
    rows = input_rows(case.batch)
    evidence = {"tensor": tensor, "kind": kind, "step": case.step, "nonfinite_values": values}
    if rows:
        evidence["rows"] = rows
    return Finding(
        f"The batch of step {case.step} held {diagnosis.KIND_TEXT.get(kind, kind)} in "
        f"{tensor}"
        + (f" ({values} value(s))" if values is not None else "")
        + ": the data, not the model, brought the non-finite value.",
        evidence,
    )


def input_nonfinite(case: Case) -> Finding | None:
    """Sign: the non-finite value came in with the data."""
    rec = case.rec
    if rec.phase != "input" or rec.step is None:
        return None
    name = tensor_words(rec.incident.get("tensor") or rec.incident.get("layer") or "an input")
    kind = rec.incident.get("kind", "nan")
    clean_before = None
    entry = next(
        (e for e in rec.schema.find(phase="input") if e.layer == rec.incident.get("layer")),
        None,
    )
    if rec.flight is not None and entry is not None:
        clean_before = 0
        for step in range(rec.step - 1, rec.flight.first_step - 1, -1):
            if diagnosis.entry_nonfinite(rec.flight.vector(step), entry):
                break
            clean_before += 1
    text = (
        f"{name[:1].upper()}{name[1:]} contained {kind.upper()} at step {rec.step}"
        f" (epoch {rec.incident.get('epoch')}, batch {rec.incident.get('batch')}): "
        "the model was fed non-finite data. Check the data pipeline (missing values, "
        "divisions by zero or log of 0 in preprocessing)"
    )
    if "inf" in kind:
        text += ", and float64 inputs whose values overflow float32 when cast"
    text += ". tf.debugging.assert_all_finite on the dataset finds the records."
    return Finding(
        text,
        {"input": name, "kind": kind, "step": rec.step, "finite_steps_before": clean_before},
    )


# Ops whose non-finite output is a math error at a bad input, not an overflow.
MATH_OPS = ("log", "sqrt", "rsqrt", "div", "pow", "xlogy", "acos", "asin", "atanh", "lgamma")


def _specific_math(case: Case) -> bool:
    """The incident is a math error of its own: a layer that made NaN/Inf
    from ordinary inputs (the forward-math verdict), or an op the replay
    named that is a log, sqrt, division or power."""
    op = case.incident.get("op")
    kind = op.get("type") if isinstance(op, dict) else None
    if isinstance(kind, str) and any(word in kind.lower() for word in MATH_OPS):
        return True
    return case.incident.get("phase") == "forward" and forward_math(case) is not None


def _learning(case: Case) -> bool:
    """The loss fell steadily over the recorded steps before the incident."""
    series = case.rec.series
    if series is None or not len(series) or "loss" not in series.columns:
        return False
    losses = series.columns["loss"][series.steps < case.step][-diagnosis.STEADY_STEPS :]
    return diagnosis.falling_steadily([float(v) for v in losses])


def unscaled_data(case: Case) -> Finding | None:
    """A model input or target far from unit scale, a loss huge from the first
    recorded step, and an overflow soon after: the data's scale, not the rate."""
    far = [s for s in case.data_scales() if s.far]
    first_step, loss = case.first_loss()
    if not far or first_step is None or loss is None or math.isnan(loss) or loss < HUGE_LOSS:
        return None
    if case.step is None:
        return None
    grew = growth_candidates(case)
    if not grew and (case.step - first_step > EARLY_STEPS or _learning(case)):
        return None  # no overshoot: late, or the loss was falling steadily until the incident
    if case.rate_jump() is not None or _specific_math(case):
        return None  # a recorded rate jump, a math error in one op: their own verdicts
    far.sort(key=lambda s: -s.max_abs)
    inputs = [s for s in far if not s.target]
    targets = [s for s in far if s.target]
    seen = "; ".join(s.text() for s in (inputs[:2] + targets[:1]))
    return Finding(
        f"The data is far from unit scale ({seen}) and the loss was {fmt(loss)} from step "
        f"{first_step} on, until {case.text()}: the gradients grow with the data, so the "
        "first updates overshoot and overflow.",
        {
            "inputs_far": [s.words for s in inputs][:MAX_LISTED] or None,
            "input": inputs[0].words if inputs else None,
            "input_min": inputs[0].low if inputs else None,
            "input_max": inputs[0].high if inputs else None,
            "target": targets[0].words if targets else None,
            "target_min": targets[0].low if targets else None,
            "target_max": targets[0].high if targets else None,
            "first_loss": loss,
            "first_step": first_step,
            "step": case.step,
            "lr": case.header("lr", first_step),
        },
    )
