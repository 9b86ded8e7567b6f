"""Evidence-based hints for the incident card.

Each rule looks at what was recorded (run summary, per-step series, flight
window) and returns a hint only when the data supports it, with the numbers
that support it as ``evidence``. A hint is
``{"id": str, "title": str, "text": str, "evidence": {name: number | str}}``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from tb_nanwatch.evidence import diagnosis
from tb_nanwatch.evidence.recorded import Record, Series

# (a) logits rising: at least this many consecutive increases, growing this much;
# or, for noisy series, a steady trend: over the last TREND_STEPS finite steps
# (at least TREND_MIN_STEPS), the medians of TREND_SEGMENTS equal segments
# strictly increase and the last is TREND_GROWTH x the first.
MIN_RISING_STEPS = 5
MIN_RISING_GROWTH = 1.5
TREND_STEPS = 200
TREND_MIN_STEPS = 50
TREND_SEGMENTS = 5
TREND_GROWTH = 2.0
# (b) gradient-norm spike: peak in the last steps vs the median before them.
SPIKE_WINDOW = 10
SPIKE_RATIO = 1000.0
MIN_BASELINE_STEPS = 10
# (c) saturated final activation: |logit| above this at the incident.
SATURATED_LOGIT = 15.0
# (g) explosion: the signal's peak after onset vs its median before.
EXPLOSION_CONFIRM_RATIO = 10.0


def clean_evidence(evidence: dict) -> dict:
    """``evidence`` without the unknown (None) items, NumPy scalars as Python numbers."""
    clean = {}
    for name, value in evidence.items():
        if isinstance(value, (np.floating, np.integer)):
            value = value.item()
        if value is not None:
            clean[name] = value
    return clean


def _hint(hint_id: str, title: str, text: str, **evidence: float | str | None) -> dict:
    return {"id": hint_id, "title": title, "text": text, "evidence": clean_evidence(evidence)}


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def _abs_logits(series: Series) -> np.ndarray | None:
    if "logit_min" not in series.columns or "logit_max" not in series.columns:
        return None
    low = np.abs(series.columns["logit_min"].astype(np.float64))
    high = np.abs(series.columns["logit_max"].astype(np.float64))
    return np.maximum(low, high)  # NaN propagates


def _signal(series: Series, name: str) -> np.ndarray | None:
    if name == "logits":
        return _abs_logits(series)
    if name in series.columns:
        return np.abs(series.columns[name].astype(np.float64))
    return None


def logits_rising(rec: Record) -> dict | None:
    """(a) |logits| rose step after step before the loss became non-finite."""
    if rec.phase != "loss" or rec.series is None or rec.step is None:
        return None
    values = _abs_logits(rec.series)
    end = rec.series.index_of(rec.step)
    if values is None or end is None:
        return None
    steps = rec.series.steps
    if not math.isfinite(values[end]):
        end -= 1
    if end < 0 or not math.isfinite(values[end]):
        return None
    first = end
    while (
        first > 0
        and steps[first - 1] == steps[first] - 1
        and math.isfinite(values[first - 1])
        and values[first - 1] < values[first]
    ):
        first -= 1
    rises = end - first
    low, high = float(values[first]), float(values[end])
    if rises >= MIN_RISING_STEPS and high >= MIN_RISING_GROWTH * low:
        return _hint(
            "logits_rising",
            "Logits grew until the loss broke",
            f"The largest |logit| rose for {rises} consecutive steps, from {_fmt(low)} "
            f"(step {int(steps[first])}) to {_fmt(high)} (step {int(steps[end])}), before "
            f"the loss became {rec.incident.get('kind', 'non-finite')} at step {rec.step}. "
            + _OVERCONFIDENT,
            steps=rises,
            first=low,
            last=high,
            first_step=int(steps[first]),
            last_step=int(steps[end]),
        )
    return _logits_trend(rec, values, steps, end)


_OVERCONFIDENT = (
    "The model is becoming over-confident: lower the learning rate, add label "
    "smoothing or regularization, and compute the loss from logits."
)


def _logits_trend(rec: Record, values: np.ndarray, steps: np.ndarray, end: int) -> dict | None:
    """The noisy form of (a): segment medians of |logits| climbing steadily."""
    start = max(0, end + 1 - TREND_STEPS)
    window = values[start : end + 1]
    window_steps = steps[start : end + 1]
    finite = np.isfinite(window)
    window, window_steps = window[finite], window_steps[finite]
    if len(window) < TREND_MIN_STEPS:
        return None
    medians = [float(np.median(part)) for part in np.array_split(window, TREND_SEGMENTS)]
    increasing = all(a < b for a, b in zip(medians, medians[1:], strict=False))
    if not increasing or not medians[-1] >= TREND_GROWTH * medians[0]:
        return None
    first_step, last_step = int(window_steps[0]), int(window_steps[-1])
    return _hint(
        "logits_rising",
        "Logits grew until the loss broke",
        f"The largest |logit| climbed steadily over the {len(window)} steps before the "
        f"incident: its median over {TREND_SEGMENTS} successive stretches went "
        + " -> ".join(_fmt(m) for m in medians)
        + f" (steps {first_step}-{last_step}), before the loss became "
        f"{rec.incident.get('kind', 'non-finite')} at step {rec.step}. " + _OVERCONFIDENT,
        steps=len(window),
        first=medians[0],
        last=medians[-1],
        first_step=first_step,
        last_step=last_step,
    )


def grad_norm_spike(rec: Record) -> dict | None:
    """(b) global gradient norm x1000 above its earlier median."""
    series = rec.series
    if series is None or rec.step is None or "grad_norm" not in series.columns:
        return None
    norms = series.columns["grad_norm"].astype(np.float64)
    finite = np.isfinite(norms)
    recent = finite & (series.steps <= rec.step) & (series.steps >= rec.step - SPIKE_WINDOW)
    earlier = finite & (series.steps < rec.step - SPIKE_WINDOW)
    if not recent.any() or earlier.sum() < MIN_BASELINE_STEPS:
        return None
    median = float(np.median(norms[earlier]))
    index = np.flatnonzero(recent)[np.argmax(norms[recent])]
    peak = float(norms[index])
    if not median > 0 or peak / median < SPIKE_RATIO:
        return None
    ratio = peak / median
    return _hint(
        "grad_norm_spike",
        "Gradient norm exploded",
        f"The global gradient norm reached {_fmt(peak)} at step {int(series.steps[index])}, "
        f"{ratio:.3g}x its median ({_fmt(median)}) over the {int(earlier.sum())} earlier "
        "steps. Clip gradients (e.g. clipnorm=1.0 or global_clipnorm) or lower the "
        "learning rate.",
        ratio=ratio,
        grad_norm=peak,
        grad_norm_step=int(series.steps[index]),
        median=median,
        median_steps=int(earlier.sum()),
    )


def saturated_output(rec: Record) -> dict | None:
    """(c) loss broke on a saturated final sigmoid/softmax: use from_logits."""
    if rec.phase != "loss" or rec.step is None:
        return None
    entries = [e for e in rec.schema.find(kind="logits") if e.before_final_activation]
    if not entries:
        return None
    best, output = -math.inf, None
    vector = rec.vector(rec.step)
    if vector is not None:
        for entry in entries:
            values = rec.schema.values(vector, entry)
            magnitude = max(abs(values["min"]), abs(values["max"]))
            if math.isfinite(magnitude) and magnitude > best:
                best, output = magnitude, entry.layer
    elif rec.series is not None:
        values = _abs_logits(rec.series)
        index = rec.series.index_of(rec.step)
        if values is not None and index is not None and math.isfinite(values[index]):
            best = float(values[index])
            output = entries[0].layer if len(entries) == 1 else None
    if not best > SATURATED_LOGIT:
        return None
    where = f" of output {output}" if output else ""
    return _hint(
        "saturated_output",
        "Saturated sigmoid/softmax fed to the loss",
        f"At step {rec.step} the logits{where} reached |{_fmt(best)}| (above "
        f"{SATURATED_LOGIT:g}): the final sigmoid/softmax outputs exactly 0 or 1 in "
        "float32, and a cross-entropy computed on these probabilities takes log(0). "
        "Remove the final activation and use from_logits=True (or compute the loss "
        "from the logits).",
        max_abs_logit=best,
        threshold=SATURATED_LOGIT,
        output=output,
        step=rec.step,
    )


def input_nonfinite(rec: Record) -> dict | None:
    """(d) the non-finite value came in with the data."""
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
    return _hint(
        "input_nonfinite",
        "Non-finite input data",
        text,
        input=name,
        kind=kind,
        step=rec.step,
        finite_steps_before=clean_before,
    )


def adam_epsilon(rec: Record) -> dict | None:
    """(e) update broke while a variable's gradient was exactly zero."""
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
    optimizer = rec.summary.get("optimizer")
    return _hint(
        "adam_epsilon",
        "Optimizer update divided by ~0",
        f"All gradients were finite at step {rec.step}, yet the update made "
        f"{rec.incident.get('tensor')} non-finite; the {entry.tensor} was exactly 0 "
        f"at that step ({len(zero)} variable(s) with a zero gradient). Adaptive "
        "optimizers (Adam, RMSprop) divide by sqrt(v) + epsilon: raise epsilon "
        "(e.g. 1e-7 -> 1e-4, more under float16).",
        variable=str(rec.incident.get("tensor")),
        zero_gradient=entry.tensor,
        grad_norm=0.0,
        zero_gradients=len(zero),
        optimizer=optimizer if isinstance(optimizer, str) else None,
        step=rec.step,
    )


def backward_origin(rec: Record) -> dict | None:
    """(f) the forward pass and loss were finite; a gradient was not."""
    if rec.phase != "backward" or rec.step is None or not rec.incident.get("layer"):
        return None
    if diagnosis.from_loss_scaler(rec.incident):
        return None  # the loss scaler's rule, not one op's gradient
    loss = None
    output_min = output_max = None
    vector = rec.vector(rec.step)
    if vector is not None:
        for entry in rec.schema.entries:
            if entry.phase not in ("input", "forward", "loss"):
                continue
            if diagnosis.entry_nonfinite(vector, entry):
                return None
            values = rec.schema.values(vector, entry)
            if entry.kind == "loss" and entry.layer is None:
                loss = values["value"]
            if entry.kind == "activation" and entry.layer == rec.incident["layer"]:
                output_min, output_max = values["min"], values["max"]
    elif rec.series is not None:
        loss = rec.series.value("loss", rec.step)
    if loss is None or not math.isfinite(loss):
        return None
    layer = rec.incident["layer"]
    return _hint(
        "backward_origin",
        "Finite forward pass, non-finite gradient",
        f"At step {rec.step} the forward pass and the loss ({_fmt(loss)}) were finite, "
        f"but the {rec.incident.get('tensor')} was {rec.incident.get('kind', 'NaN')}: "
        f"an op in {layer} has an infinite derivative at a finite input, typically "
        "sqrt, log, pow or a division at 0 (d/dx sqrt(x) is infinite at x = 0). Add "
        "an epsilon (sqrt(x + 1e-12)), clip the input away from 0, or use a safe op.",
        layer=layer,
        tensor=str(rec.incident.get("tensor")),
        step=rec.step,
        loss=float(loss),
        output_min=output_min,
        output_max=output_max,
    )


def explosion_without_nan(rec: Record) -> dict | None:
    """(g) a blow-up that has not (yet) produced NaN/Inf."""
    if rec.incident or not rec.explosion or rec.series is None:
        return None
    onset, signal = rec.explosion.get("step"), rec.explosion.get("signal")
    if not isinstance(onset, int) or not isinstance(signal, str):
        return None
    values = _signal(rec.series, signal)
    if values is None:
        return None
    finite = np.isfinite(values)
    before = values[finite & (rec.series.steps < onset)]
    after = values[finite & (rec.series.steps >= onset)]
    if not len(before) or not len(after):
        return None
    median, peak = float(np.median(before)), float(np.max(after))
    if not median > 0 or peak / median < EXPLOSION_CONFIRM_RATIO:
        return None
    lr = rec.series.value("lr", onset)
    lr_text = f" (lr = {_fmt(lr)} at onset)" if lr is not None and lr > 0 else ""
    return _hint(
        "explosion",
        "Training is exploding",
        f"The {signal} started to explode at step {onset}: it peaked at {_fmt(peak)}, "
        f"{peak / median:.3g}x its median before ({_fmt(median)}), without NaN/Inf so "
        f"far. Lower the learning rate{lr_text} or clip gradients (clipnorm / "
        "global_clipnorm).",
        step=onset,
        signal=signal,
        median_before=median,
        peak=peak,
        ratio=peak / median,
        lr=lr if lr is not None and math.isfinite(lr) else None,
    )


RULES: tuple[Callable[[Record], dict | None], ...] = (
    input_nonfinite,
    backward_origin,
    adam_epsilon,
    saturated_output,
    logits_rising,
    grad_norm_spike,
    explosion_without_nan,
)


def compute_hints(rec: Record) -> list[dict]:
    """All hints the record supports, most specific first."""
    hints = []
    for rule in RULES:
        hint = rule(rec)
        if hint is not None:
            hints.append(hint)
    return hints
