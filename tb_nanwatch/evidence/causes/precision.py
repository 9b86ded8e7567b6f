"""The float16 rule: under mixed precision, values beyond float16's range."""

from __future__ import annotations

import math

from tb_nanwatch.evidence import diagnosis
from tb_nanwatch.evidence.causes.case import (
    MAGNITUDE_KINDS,
    Case,
    Finding,
    max_abs,
    predecessors,
    tensor_words,
    text_or_none,
)
from tb_nanwatch.evidence.remedies import fmt

FLOAT16_MAX = 65504.0
# A recorded |x| this close to float16's largest value makes an Inf under
# mixed precision an fp16 overflow.
FP16_NEAR = FLOAT16_MAX / 16


def _scaler_streak(case: Case) -> Finding:
    return Finding(
        f"Under mixed precision the loss scaler kept finding non-finite float16 gradients "
        f"({case.incident.get('note')}): they exceed float16's range even unscaled.",
        {
            "note": case.incident.get("note"),
            "loss_scale": case.header("loss_scale", case.step),
            "step": case.step,
            "dtype_policy": text_or_none(case.rec.summary.get("dtype_policy")),
        },
    )


def fp16_overflow(case: Case) -> Finding | None:
    """Under mixed precision, an Inf where recorded magnitudes neared 65504."""
    if not case.mixed_precision():
        return None
    if diagnosis.from_loss_scaler(case.rec.incident) and case.incident.get("layer") is None:
        return _scaler_streak(case)
    origin, vector = case.origin_entry(), case.vector
    kind = str(case.incident.get("kind"))
    if origin is None or vector is None or "inf" not in kind:
        return None
    seen = [(max_abs(vector, e), e) for e in predecessors(case, origin)]
    if origin.kind in MAGNITUDE_KINDS and case.rec.flight is not None:
        for step in case.rec.flight.steps:
            earlier = case.rec.flight.vector(step)
            if step < case.step and not diagnosis.entry_nonfinite(earlier, origin):
                seen.append((max_abs(earlier, origin), origin))
    seen = [(m, e) for m, e in seen if math.isfinite(m)]
    if not seen:
        return None
    largest, where = max(seen, key=lambda pair: pair[0])
    if largest < FP16_NEAR:
        return None
    return Finding(
        f"Under mixed precision, {case.text()}: recorded values reached {fmt(largest)} "
        f"({tensor_words(where.tensor)}), near float16's largest value {FLOAT16_MAX:g}; "
        "float32 would have held them.",
        {
            "dtype_policy": text_or_none(case.rec.summary.get("dtype_policy")),
            "largest_max_abs": largest,
            "largest_tensor": tensor_words(where.tensor),
            "float16_max": FLOAT16_MAX,
            "layer": case.incident.get("layer"),
            "step": case.step,
        },
    )
