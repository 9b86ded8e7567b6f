"""Rules on the data: weights broken before training, a batch that held NaN/Inf."""

from __future__ import annotations

import numpy as np

from tb_nanwatch.evidence import diagnosis
from tb_nanwatch.evidence.causes.case import MAX_LISTED, Case, Finding, count, weights_at_start


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
    tensor = str(case.incident.get("tensor"))
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
    name = rec.incident.get("layer") or rec.incident.get("tensor") or "an input"
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
        f"Input {name} contained {kind.upper()} at step {rec.step}"
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
