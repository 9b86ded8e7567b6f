"""The cause verdict: why a run went non-finite (or exploded), from recorded evidence.

:func:`diagnose` reads what was recorded (the incident, the flight window, the
series, the explosion onset and the run summary) and names one cause of a
fixed vocabulary (:data:`CAUSE_IDS`) with the numbers that support it and the
remedies ranked by that evidence::

    {"id": str, "summary": str, "evidence": {name: number | str | list},
     "remedies": [str, ...]}

Rules are tried in :data:`RULES` order; the first whose evidence holds wins,
and an incident no rule explains is ``unknown`` (what was seen, no guess).
Run-summary keys the write side records (missing: "not known", as in runs
written before them):

* ``"weights_at_start": {"checked": int, "nonfinite": [variable path, ...]}``:
  every weight checked once when training begins;
* ``"dtype_policy": "mixed_float16" | "float32" | ...``: the Keras policy;
* ``"loss_from_logits": bool | null``: whether the loss reads logits.

Pure Python and NumPy, no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from tb_nanwatch.evidence import diagnosis, hints
from tb_nanwatch.evidence.hints import SATURATED_LOGIT
from tb_nanwatch.evidence.recorded import Record
from tb_nanwatch.evidence.schema import Entry

# A short label for each cause id, in the order the tab lists them.
CAUSE_LABELS = {
    "nonfinite_weights": "Weights already NaN/Inf before the step",
    "input_data": "Bad input data",
    "growth_overflow": "Overflow after growth",
    "fp16_overflow": "float16 overflow",
    "forward_math": "Math error in the forward pass",
    "loss_math": "Math error in the loss",
    "backward_math": "Math error in the backward pass",
    "optimizer_update": "Optimizer update broke the weights",
    "explosion": "Explosion (no NaN/Inf yet)",
    "unknown": "Unknown cause",
}
CAUSE_IDS = tuple(CAUSE_LABELS)

FLOAT16_MAX = 65504.0
# A recorded |x| this close to float16's largest value makes an Inf under
# mixed precision an fp16 overflow.
FP16_NEAR = FLOAT16_MAX / 16
# A layer input is of ordinary size when its max |x| is at most this many times
# its median over the earlier steps of the flight window (never below 1) ...
ORDINARY_GROWTH = 100.0
# ... or, without earlier steps, at most this; and never beyond the ceiling.
ORDINARY_MAX = 1e6
ORDINARY_CEILING = 1e15
# A learning rate this many times its median before the step is a spike.
LR_SPIKE = 10.0
# The series steps replayed through the explosion rule before an incident.
SERIES_REPLAY = 2048
MAX_LISTED = 10

SERIES_SIGNALS = (("loss", None), ("grad_norm", None), ("logits", None))
MAGNITUDE_KINDS = ("input", "activation", "logits")


@dataclasses.dataclass
class _Case:
    """One record as the rules read it (built once by :func:`diagnose`)."""

    rec: Record
    batch: object = None

    @property
    def incident(self) -> dict:
        return self.rec.incident or {}

    @property
    def step(self) -> int | None:
        return self.rec.step

    @property
    def vector(self) -> np.ndarray | None:
        return None if self.step is None else self.rec.vector(self.step)

    def origin_entry(self) -> Entry | None:
        """The schema entry of the incident's origin tensor (the non-finite
        one when the step's vector is at hand)."""
        matches = [
            e
            for e in self.rec.schema.diagnosed()
            if e.phase == self.incident.get("phase") and e.tensor == self.incident.get("tensor")
        ]
        vector = self.vector
        if vector is not None:
            bad = [e for e in matches if diagnosis.entry_nonfinite(vector, e)]
            matches = bad or matches
        return matches[0] if matches else None

    def header(self, field: str, step: int) -> float | None:
        vector = self.rec.vector(step)
        if vector is not None:
            return float(vector[self.rec.schema.header_index(field)])
        if self.rec.series is not None:
            return self.rec.series.value(field, step)
        return None

    def text(self) -> str:
        kind = diagnosis.KIND_TEXT.get(str(self.incident.get("kind")), "NaN or Inf")
        where = self.incident.get("layer") or self.incident.get("tensor")
        return f"{kind} at step {self.step} in the {self.incident.get('phase')} phase ({where})"


def diagnose(rec: Record, batch: object = None) -> dict | None:
    """The cause of the run's incident or explosion, or None for a healthy run.

    ``batch``: the offending batch's arrays when at hand (a list, or a dict
    such as a bundle's ``batch/<i>`` arrays): ``input_data`` then names the
    sample rows.
    """
    case = _Case(rec, batch)
    weights = nonfinite_weights(case)
    if weights is not None:
        return weights
    if rec.incident is None:
        return explosion(case)
    for rule in RULES:
        cause = rule(case)
        if cause is not None:
            return cause
    return unknown(case)


def describe(cause: dict | None) -> str:
    """The cause in one line (the console message at the incident)."""
    if not cause:
        return "cause: none (no NaN/Inf, no explosion)"
    remedy = f" First try: {cause['remedies'][0]}" if cause.get("remedies") else ""
    return f"cause {cause['id']}: {cause['summary']}{remedy}"


def _cause(cause_id: str, summary: str, evidence: dict, remedies: list[str]) -> dict:
    evidence = hints.clean_evidence(evidence)
    return {"id": cause_id, "summary": summary, "evidence": evidence, "remedies": remedies}


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _fmt(value: float | None) -> str:
    return "?" if value is None else f"{value:.3g}"


def _lower_lr(lr: float | None, step: int) -> str:
    was = f" (it was {_fmt(lr)} at step {step})" if lr is not None and math.isfinite(lr) else ""
    return f"Lower the learning rate{was}, e.g. 10x."


def _max_abs(vector: np.ndarray, entry: Entry) -> float:
    low, high = vector[entry.index("min")], vector[entry.index("max")]
    return float(max(abs(low), abs(high)))


def _weights_at_start(case: _Case) -> dict | None:
    checked = case.rec.summary.get("weights_at_start")
    if not isinstance(checked, dict) or not isinstance(checked.get("nonfinite", []), list):
        return None
    return checked


# -- the rules, in decision order ---------------------------------------------


def nonfinite_weights(case: _Case) -> dict | None:
    """A weight was already NaN/Inf when training began: nothing else counts."""
    checked = _weights_at_start(case)
    bad = [str(p) for p in (checked or {}).get("nonfinite") or []]
    if not bad:
        return None
    first = bad[0]
    return _cause(
        "nonfinite_weights",
        f"{len(bad)} weight variable(s), first {first}, held NaN/Inf before the first "
        "training step: the model started broken, training did not make the NaN.",
        {
            "variables": bad[:MAX_LISTED],
            "nonfinite_variables": len(bad),
            "checked": checked.get("checked") if isinstance(checked.get("checked"), int) else None,
            "step": case.step,
        },
        [
            f"Reload the checkpoint or pretrained weights from a clean copy ({first} is "
            "non-finite before training).",
            "Replace the non-finite entries before fit (e.g. np.nan_to_num on an embedding "
            "table, or re-initialise the variable).",
            "If no weights were loaded, check the variable's initializer.",
        ],
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


def input_data(case: _Case) -> dict | None:
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
    remedies = [
        "Find the bad records: tf.debugging.assert_all_finite (or np.isfinite) over the "
        "dataset" + (f", starting with rows {rows[0]['rows']} of this batch" if rows else "") + ".",
        "Fill or drop missing values in preprocessing; guard its divisions and logs.",
    ]
    if "inf" in kind:
        remedies.insert(
            0,
            "Rescale float64 data before casting to float32: values beyond 3.4e38 become Inf.",
        )
    return _cause(
        "input_data",
        f"The batch of step {case.step} held {diagnosis.KIND_TEXT.get(kind, kind)} in "
        f"{tensor}"
        + (f" ({values} value(s))" if values is not None else "")
        + ": the data, not the model, brought the non-finite value.",
        evidence,
        remedies,
    )


def count(vector: np.ndarray, entry: Entry) -> int | float:
    """The NaN + Inf element count of ``entry`` in ``vector``."""
    total = float(vector[entry.index("nan")]) + float(vector[entry.index("inf")])
    return int(total) if math.isfinite(total) else total


def growth_candidates(case: _Case) -> list[dict]:
    """Signals above the explosion line at the incident step, earliest onset
    first: the series (loss, gradient norm, logits) and the flight window
    (those and every layer's max |x|) replayed through the one explosion rule
    (:class:`~tb_nanwatch.evidence.diagnosis.ExplosionDetector`)."""
    factor = case.rec.summary.get("explosion_factor", 1e3)
    factor = factor if isinstance(factor, (int, float)) and factor > 10 else 1e3
    found: list[dict] = []
    series = case.rec.series
    if series is not None and case.step is not None and len(series):
        keep = series.steps <= case.step
        steps = series.steps[keep][-SERIES_REPLAY:]
        detector = diagnosis.ExplosionDetector(SERIES_SIGNALS, factor=factor)
        columns = _series_signals(series, keep)
        for row, step in enumerate(steps):
            detector.update(int(step), columns[row - len(steps)])
        found += detector.pending()
    flight = case.rec.flight
    if flight is not None and case.step is not None:
        reader = diagnosis.SignalReader(flight.schema)
        detector = diagnosis.ExplosionDetector(reader.signals, factor=factor)
        for step in flight.steps:
            if step <= case.step:
                detector.update(step, reader.values(flight.vector(step)))
        found += detector.pending()
    return sorted(found, key=lambda o: o["step"])


def _series_signals(series, keep: np.ndarray) -> np.ndarray:
    def column(name: str) -> np.ndarray:
        values = series.columns.get(name)
        if values is None:
            return np.full(int(keep.sum()), np.nan)
        return np.abs(values[keep].astype(np.float64))

    logits = np.maximum(column("logit_min"), column("logit_max"))
    return np.stack([column("loss"), column("grad_norm"), logits], axis=1)


def _largest_layer(case: _Case) -> tuple[str | None, float | None]:
    """The forward tensor with the largest finite max |x| at the incident step."""
    vector = case.vector
    if vector is None:
        return None, None
    best, name = -1.0, None
    for entry in case.rec.schema.diagnosed():
        if entry.kind in MAGNITUDE_KINDS and not diagnosis.entry_nonfinite(vector, entry):
            magnitude = _max_abs(vector, entry)
            if math.isfinite(magnitude) and magnitude > best:
                best, name = magnitude, entry.layer or entry.tensor
    return name, (best if name is not None else None)


def _outputs_probabilities(case: _Case) -> bool:
    return any(e.before_final_activation for e in case.rec.schema.find(kind="logits"))


def growth_overflow(case: _Case) -> dict | None:
    """Loss, gradient norm, logits or activations grew by orders of magnitude
    up to the first non-finite value, which is then an overflow."""
    if diagnosis.from_loss_scaler(case.rec.incident) and case.incident.get("layer") is None:
        return None  # the scaler's own rule: see fp16_overflow
    candidates = growth_candidates(case)
    if not candidates:
        return None
    onset = candidates[0]
    signal = onset["signal"] + (f" of {onset['layer']}" if onset.get("layer") else "")
    layer, largest = _largest_layer(case)
    lr = case.header("lr", onset["step"])
    remedies = [
        _lower_lr(lr, onset["step"]),
        "Clip gradients: clipnorm=1.0 or global_clipnorm=1.0 in the optimizer.",
        "Add a learning-rate warm-up over the first steps.",
    ]
    if _outputs_probabilities(case):
        remedies.append("Compute the loss from logits (from_logits=True, no final activation).")
    return _cause(
        "growth_overflow",
        f"The {signal} grew {_fmt(onset['factor'])}x from step {onset['step']} on, until "
        f"the first non-finite value ({case.text()}) overflowed: training was exploding"
        + (f"; {layer}'s output had already reached {_fmt(largest)}" if layer else "")
        + ".",
        {
            "onset_step": onset["step"],
            "signal": onset["signal"],
            "layer": onset.get("layer"),
            "growth_factor": onset["factor"],
            "first_nonfinite_step": case.step,
            "largest_layer": layer,
            "largest_max_abs": largest,
            "lr": lr,
        },
        remedies,
    )


def _mixed_precision(case: _Case) -> bool:
    policy = case.rec.summary.get("dtype_policy")
    if isinstance(policy, str):
        return "float16" in policy and "bfloat16" not in policy
    scale = case.header("loss_scale", case.step) if case.step is not None else None
    return scale is not None and scale > 0


def _predecessors(case: _Case, origin: Entry) -> list[Entry]:
    """The recorded model inputs and layer outputs before ``origin`` (in
    execution order; targets feed the loss, not the layers)."""
    before = []
    for entry in case.rec.schema.diagnosed():
        if entry is origin or entry.offset >= origin.offset:
            break
        if entry.kind in MAGNITUDE_KINDS and not _is_target(entry):
            before.append(entry)
    return before


def _fp16_scaler(case: _Case) -> dict:
    scale = case.header("loss_scale", case.step)
    return _cause(
        "fp16_overflow",
        f"Under mixed precision the loss scaler kept finding non-finite float16 gradients "
        f"({case.incident.get('note')}): they exceed float16's range even unscaled.",
        {
            "note": case.incident.get("note"),
            "loss_scale": scale,
            "step": case.step,
            "dtype_policy": _text(case.rec.summary.get("dtype_policy")),
        },
        _FP16_REMEDIES,
    )


_FP16_REMEDIES = [
    "Keep the layers with large outputs or gradients in float32 (dtype='float32', e.g. "
    "the final softmax or a normalisation).",
    "Normalise inputs and activations (or lower the learning rate) so values stay well "
    "below 65504.",
    "Use bfloat16 (float32's range) where the hardware supports it.",
]


def fp16_overflow(case: _Case) -> dict | None:
    """Under mixed precision, an Inf where recorded magnitudes neared 65504."""
    if not _mixed_precision(case):
        return None
    if diagnosis.from_loss_scaler(case.rec.incident) and case.incident.get("layer") is None:
        return _fp16_scaler(case)
    origin, vector = case.origin_entry(), case.vector
    kind = str(case.incident.get("kind"))
    if origin is None or vector is None or "inf" not in kind:
        return None
    seen = [(_max_abs(vector, e), e) for e in _predecessors(case, origin)]
    if origin.kind in MAGNITUDE_KINDS and case.rec.flight is not None:
        for step in case.rec.flight.steps:
            earlier = case.rec.flight.vector(step)
            if step < case.step and not diagnosis.entry_nonfinite(earlier, origin):
                seen.append((_max_abs(earlier, origin), origin))
    seen = [(m, e) for m, e in seen if math.isfinite(m)]
    if not seen:
        return None
    largest, where = max(seen, key=lambda pair: pair[0])
    if largest < FP16_NEAR:
        return None
    return _cause(
        "fp16_overflow",
        f"Under mixed precision, {case.text()}: recorded values reached {_fmt(largest)} "
        f"({where.tensor}), near float16's largest value {FLOAT16_MAX:g}; float32 would "
        "have held them.",
        {
            "dtype_policy": _text(case.rec.summary.get("dtype_policy")),
            "largest_max_abs": largest,
            "largest_tensor": where.tensor,
            "float16_max": FLOAT16_MAX,
            "layer": case.incident.get("layer"),
            "step": case.step,
        },
        _FP16_REMEDIES,
    )


def _weights_before(case: _Case, layer: str | None) -> str | None:
    """How the layer's weights are known finite before the step, or None."""
    checked = _weights_at_start(case)
    if checked is not None and not checked.get("nonfinite"):
        return "all weights checked finite when training began"
    recorded = case.rec.schema.find(phase="update", kind="weights")
    owned = [e for e in recorded if e.layer == layer]
    if not recorded:
        return None
    if not owned:
        return "the layer has no weights"
    previous = case.rec.vector(case.step - 1) if case.step else None
    if previous is not None and not any(diagnosis.entry_nonfinite(previous, e) for e in owned):
        return f"finite after the update of step {case.step - 1}"
    return None


def _ordinary(case: _Case, entry: Entry, magnitude: float) -> bool:
    if not math.isfinite(magnitude) or magnitude > ORDINARY_CEILING:
        return False
    earlier = []
    for step in case.rec.flight.steps:
        vector = case.rec.flight.vector(step)
        if step < case.step and not diagnosis.entry_nonfinite(vector, entry):
            earlier.append(_max_abs(vector, entry))
    earlier = [m for m in earlier if math.isfinite(m)]
    if not earlier:
        return magnitude <= ORDINARY_MAX
    return magnitude <= ORDINARY_GROWTH * max(float(np.median(earlier)), 1.0)


def forward_math(case: _Case) -> dict | None:
    """A layer's inputs were finite and of ordinary size, its output was not."""
    if case.incident.get("phase") != "forward":
        return None
    origin, vector = case.origin_entry(), case.vector
    if origin is None or vector is None:
        return None
    inputs = [(_max_abs(vector, e), e) for e in _predecessors(case, origin)]
    if not all(_ordinary(case, e, m) for m, e in inputs):
        return None
    layer = case.incident.get("layer")
    weights = _weights_before(case, layer)
    if weights is None:
        return None  # the layer's own weights may have been broken already
    largest = max(inputs, key=lambda pair: pair[0], default=(None, None))
    return _cause(
        "forward_math",
        f"{layer} turned finite inputs of ordinary size (largest |x| {_fmt(largest[0])}) "
        f"into {case.text()}: a math error inside the layer.",
        {
            "layer": layer,
            "tensor": case.incident.get("tensor"),
            "kind": case.incident.get("kind"),
            "step": case.step,
            "nonfinite_values": count(vector, origin),
            "input_max_abs": largest[0],
            "input_tensor": largest[1].tensor if largest[1] is not None else None,
            "previous_tensor": inputs[-1][1].tensor if inputs else None,
            "previous_max_abs": inputs[-1][0] if inputs else None,
            "weights_before": weights,
        },
        [
            f"Look in {layer} for log or sqrt of a negative or zero, 0/0 or a division by "
            "~0: add an epsilon (log(x + 1e-7), x / (y + 1e-7)) or clamp (tf.maximum(x, 0.)).",
            "Use safe ops: tf.math.divide_no_nan, tf.math.xlogy, tf.nn.log_softmax.",
            "Mask attention with a large finite negative (-1e9), not -inf: an all-masked "
            "row gives a softmax of 0/0.",
            "Replay the step eagerly under tf.debugging.enable_check_numerics() to name the op.",
        ],
    )


def _max_abs_logit(case: _Case) -> float | None:
    vector = case.vector
    values = []
    if vector is not None:
        for entry in case.rec.schema.find(kind="logits"):
            if not diagnosis.entry_nonfinite(vector, entry):
                values.append(_max_abs(vector, entry))
    elif case.rec.series is not None:
        low = case.rec.series.value("logit_min", case.step)
        high = case.rec.series.value("logit_max", case.step)
        if low is not None and high is not None:
            values.append(max(abs(low), abs(high)))
    values = [v for v in values if math.isfinite(v)]
    return max(values) if values else None


def loss_math(case: _Case) -> dict | None:
    """The predictions were finite, the loss was not."""
    if case.incident.get("phase") != "loss" or diagnosis.from_loss_scaler(case.rec.incident):
        return None
    logit = _max_abs_logit(case)
    saturated = logit is not None and logit > SATURATED_LOGIT
    probabilities = _outputs_probabilities(case)
    from_logits = case.rec.summary.get("loss_from_logits")
    use_logits = "Remove the final sigmoid/softmax and compute the loss with from_logits=True."
    clip = "In a hand-written loss, clip predictions to [1e-7, 1 - 1e-7] before the log."
    calm = "Lower the learning rate or add label smoothing: the logits grew to saturation."
    remedies = [use_logits, clip, calm] if saturated or probabilities else [clip, use_logits]
    detail = (
        f"; the final activation was saturated (|logit| {_fmt(logit)})"
        if saturated
        else (f"; |logit| was {_fmt(logit)}" if logit is not None else "")
    )
    return _cause(
        "loss_math",
        f"The predictions were finite and the loss was not ({case.text()}): the loss "
        f"function broke, typically log(0) of a probability rounded to 0 or 1{detail}.",
        {
            "step": case.step,
            "tensor": case.incident.get("tensor"),
            "kind": case.incident.get("kind"),
            "max_abs_logit": logit,
            "saturated": saturated,
            "saturation_threshold": SATURATED_LOGIT,
            "outputs_probabilities": probabilities,
            "from_logits": from_logits if isinstance(from_logits, bool) else "not recorded",
        },
        remedies,
    )


def backward_math(case: _Case) -> dict | None:
    """The forward pass and the loss were finite, a derivative was not."""
    if case.incident.get("phase") != "backward" or diagnosis.from_loss_scaler(case.rec.incident):
        return None
    loss = case.header("loss", case.step)
    if loss is None or not math.isfinite(loss):
        return None
    layer = case.incident.get("layer")
    return _cause(
        "backward_math",
        f"The forward pass and the loss ({_fmt(loss)}) were finite, then {case.text()}: "
        f"a derivative inside {layer} is infinite at a finite input (sqrt or log at 0, pow, "
        "a custom gradient).",
        {
            "layer": layer,
            "tensor": case.incident.get("tensor"),
            "kind": case.incident.get("kind"),
            "step": case.step,
            "loss": loss,
        },
        [
            f"Add an epsilon inside sqrt/log/pow in {layer} (sqrt(x + 1e-12)) or clip its "
            "input away from 0.",
            "In a hand-written cross-entropy, clip p to [1e-7, 1 - 1e-7] rather than log(p + eps).",
            "Check any tf.custom_gradient in the layer.",
        ],
    )


def _lr_history(case: _Case) -> tuple[float | None, float | None]:
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


def _zero_gradients(case: _Case) -> int | None:
    vector = case.vector
    if vector is None:
        return None
    entries = case.rec.schema.find(phase="backward", kind="grad_var")
    return sum(1 for e in entries if vector[e.index("norm")] == 0.0)


def optimizer_update(case: _Case) -> dict | None:
    """Every gradient was finite; the update made a weight non-finite."""
    if case.incident.get("phase") != "update":
        return None
    weights = _weights_before(case, case.incident.get("layer"))
    if weights is None:
        return None  # it may have been non-finite before the step
    lr, lr_before = _lr_history(case)
    ratio = lr / lr_before if lr is not None and lr_before else None
    zeros = _zero_gradients(case)
    schedule = f"Fix the learning-rate schedule: {_fmt(lr)} at this step vs {_fmt(lr_before)}."
    epsilon = "Raise the optimizer's epsilon (Adam/RMSprop: 1e-7 -> 1e-4; never 0)."
    lower = "Lower the learning rate and clip gradients (clipnorm=1.0)."
    if ratio is not None and ratio >= LR_SPIKE:
        remedies = [schedule, lower, epsilon]
    elif zeros:
        remedies = [epsilon, lower]
    else:
        remedies = [epsilon, lower, schedule]
    return _cause(
        "optimizer_update",
        f"Every gradient was finite at step {case.step}, but the update made "
        f"{case.incident.get('tensor')} {diagnosis.KIND_TEXT.get(str(case.incident.get('kind')))}"
        f" (learning rate {_fmt(lr)}, {_fmt(lr_before)} before).",
        {
            "tensor": case.incident.get("tensor"),
            "step": case.step,
            "lr": lr,
            "lr_before": lr_before,
            "lr_ratio": ratio,
            "zero_gradients": zeros,
            "optimizer": _text(case.rec.summary.get("optimizer")),
            "weights_before": weights,
        },
        remedies,
    )


def explosion(case: _Case) -> dict | None:
    """No NaN/Inf, but an explosion onset."""
    onset = case.rec.explosion
    if not onset or not isinstance(onset.get("step"), int):
        return None
    step, signal = onset["step"], str(onset.get("signal"))
    where = f" of {onset['layer']}" if onset.get("layer") else ""
    lr = case.header("lr", step)
    factor = onset.get("factor")
    return _cause(
        "explosion",
        f"The {signal}{where} exploded from step {step} on"
        + (f" ({_fmt(factor)}x its reference level)" if factor is not None else "")
        + ", without NaN/Inf so far.",
        {
            "onset_step": step,
            "signal": signal,
            "layer": onset.get("layer"),
            "growth_factor": factor,
            "lr": lr,
        },
        [
            _lower_lr(lr, step),
            "Clip gradients: clipnorm=1.0 or global_clipnorm=1.0.",
            "Add a learning-rate warm-up; check that inputs and targets are normalised.",
        ],
    )


def unknown(case: _Case) -> dict:
    """An incident no rule explains: what was seen, and no guess."""
    layer, largest = _largest_layer(case)
    return _cause(
        "unknown",
        f"{case.text()}; the recorded evidence fits no known cause.",
        {
            "phase": case.incident.get("phase"),
            "layer": case.incident.get("layer"),
            "tensor": case.incident.get("tensor"),
            "kind": case.incident.get("kind"),
            "step": case.step,
            "note": case.incident.get("note"),
            "largest_layer": layer,
            "largest_max_abs": largest,
        },
        [
            "Open the step table of the incident and the steps before it: look for values "
            "that grew or sat at a limit.",
            "Replay the step from the reproduction bundle eagerly under "
            "tf.debugging.enable_check_numerics() to name the op.",
        ],
    )


RULES: tuple[Callable[[_Case], dict | None], ...] = (
    input_data,
    growth_overflow,
    fp16_overflow,
    forward_math,
    loss_math,
    backward_math,
    optimizer_update,
)


def _is_target(entry: Entry) -> bool:
    """A target entry ("target", or "target for output <name>"; older runs:
    "target <name>"): not a layer's input."""
    return entry.tensor == "target" or entry.tensor.startswith("target ")
