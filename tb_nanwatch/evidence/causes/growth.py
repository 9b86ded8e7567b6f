"""Rules on growth: training exploded, before or without a NaN/Inf.

The verdicts ``growth_overflow`` (the first non-finite value is the overflow
of a growth) and ``explosion`` (no NaN/Inf yet), and the signs that show a
growth on the card: logits rising, a gradient-norm spike, an explosion.
"""

from __future__ import annotations

import math

import numpy as np

from tb_nanwatch.evidence import diagnosis
from tb_nanwatch.evidence.causes.case import (
    Case,
    Finding,
    abs_logits,
    entry_name,
    largest_tensor,
    output_words,
    signal,
)
from tb_nanwatch.evidence.options import WatchOptions
from tb_nanwatch.evidence.recorded import Series
from tb_nanwatch.evidence.remedies import fmt

# The series steps replayed through the explosion rule before an incident.
SERIES_REPLAY = 2048
SERIES_SIGNALS = (("loss", None), ("grad_norm", None), ("logits", None))
# Logits rising: at least this many consecutive increases, growing this much;
# or, for noisy series, a steady trend: over the last TREND_STEPS finite steps
# (at least TREND_MIN_STEPS), the medians of TREND_SEGMENTS equal segments
# strictly increase and the last is TREND_GROWTH x the first.
MIN_RISING_STEPS = 5
MIN_RISING_GROWTH = 1.5
TREND_STEPS = 200
TREND_MIN_STEPS = 50
TREND_SEGMENTS = 5
TREND_GROWTH = 2.0
# Gradient-norm spike: peak in the last steps vs the median before them.
SPIKE_WINDOW = 10
SPIKE_RATIO = 1000.0
MIN_BASELINE_STEPS = 10
# Explosion sign: the signal's peak after onset vs its median before.
EXPLOSION_CONFIRM_RATIO = 10.0


def growth_candidates(case: Case) -> list[dict]:
    """Signals above the explosion line at the incident step, earliest onset
    first: the series (loss, gradient norm, logits) and the flight window
    (those and every layer's max |x|) replayed through the one explosion rule
    (:class:`~tb_nanwatch.evidence.diagnosis.ExplosionDetector`)."""
    default = WatchOptions.explosion_factor
    factor = case.rec.summary.get("explosion_factor", default)
    factor = factor if isinstance(factor, (int, float)) and factor > 10 else default
    found: list[dict] = []
    # The targets' largest |x| (outputs growing toward it while the loss falls
    # steadily are a regression learning its scale, as in the run's own rule).
    targets = [s.max_abs for s in case.data_scales() if s.target]
    target_abs = max(targets) if targets else math.nan
    series = case.rec.series
    if series is not None and case.step is not None and len(series):
        keep = series.steps <= case.step
        steps = series.steps[keep][-SERIES_REPLAY:]
        detector = diagnosis.ExplosionDetector(SERIES_SIGNALS, factor=factor)
        learning = diagnosis.LearningScale(case.rec.schema)
        columns = _series_signals(series, keep)
        losses = series.columns.get("loss")
        losses = losses[keep][-len(steps) :] if losses is not None else None
        for row, step in enumerate(steps):
            if losses is not None:
                _learned(detector, learning.step(float(losses[row]), target_abs))
            detector.update(int(step), columns[row - len(steps)])
        found += detector.pending()
    flight = case.rec.flight
    if flight is not None and case.step is not None:
        reader = diagnosis.SignalReader(flight.schema)
        detector = diagnosis.ExplosionDetector(reader.signals, factor=factor)
        learning = diagnosis.LearningScale(flight.schema)
        loss = flight.schema.header_index("loss")
        for step in flight.steps:
            if step <= case.step:
                vector = flight.vector(step)
                _learned(detector, learning.update(vector, float(vector[loss])))
                detector.update(step, reader.values(vector))
        found += detector.pending()
    return sorted(found, key=lambda o: o["step"])


def _learned(detector: diagnosis.ExplosionDetector, scale: float | None) -> None:
    if scale is not None:
        detector.raise_scale(scale)


def _series_signals(series: Series, keep: np.ndarray) -> np.ndarray:
    def column(name: str) -> np.ndarray:
        values = signal(series, name)
        return np.full(int(keep.sum()), np.nan) if values is None else values[keep]

    return np.stack([column(name) for name, _ in SERIES_SIGNALS], axis=1)


def growth_overflow(case: Case) -> Finding | None:
    """Loss, gradient norm, logits or activations grew by orders of magnitude
    up to the first non-finite value, which is then an overflow."""
    if diagnosis.from_loss_scaler(case.rec.incident) and case.incident.get("layer") is None:
        return None  # the scaler's own rule: see fp16_overflow
    candidates = growth_candidates(case)
    if not candidates:
        return None
    onset = candidates[0]
    signal_words = signal_text(case, onset["signal"])
    grown = signal_words + (f" of {onset['layer']}" if onset.get("layer") else "")
    entry, largest = largest_tensor(case)
    layer = entry_name(entry) if entry is not None else None
    jump = case.rate_jump()
    jump_text = (
        f"; the learning rate jumped from {fmt(jump['from'])} to {fmt(jump['to'])} at step "
        f"{jump['step']}"
        if jump
        else ""
    )
    return Finding(
        f"The {grown} grew {fmt(onset['factor'])}x from step {onset['step']} on, until "
        f"the first non-finite value ({case.text()}) overflowed: training was exploding"
        + (f"; {output_words(entry)} had already reached {fmt(largest)}" if entry else "")
        + jump_text
        + ".",
        {
            "onset_step": onset["step"],
            "signal": signal_words,
            "layer": onset.get("layer"),
            "growth_factor": onset["factor"],
            "first_nonfinite_step": case.step,
            "largest_layer": layer,
            "largest_max_abs": largest,
            "lr": jump["to"] if jump else case.header("lr", onset["step"]),
            "lr_before": jump["from"] if jump else None,
            "lr_change": jump,
        },
    )


def signal_text(case: Case, name: str) -> str:
    """A signal as the texts name it: the model's outputs are "logits" only
    where they feed a sigmoid/softmax or a from-logits loss."""
    return case.output_word() if name == "logits" else name


def explosion(case: Case) -> Finding | None:
    """No NaN/Inf, but an explosion onset."""
    onset = case.rec.explosion
    if not onset or not isinstance(onset.get("step"), int):
        return None
    step, name = onset["step"], signal_text(case, str(onset.get("signal")))
    where = f" of {onset['layer']}" if onset.get("layer") else ""
    factor = onset.get("factor")
    jump = lr_jump(onset)
    jump_text = (
        f"; the learning rate jumped from {fmt(jump['from'])} to {fmt(jump['to'])} at step "
        f"{jump['step']}"
        if jump
        else ""
    )
    return Finding(
        f"The {name}{where} exploded from step {step} on"
        + (f" ({fmt(factor)}x its reference level)" if factor is not None else "")
        + f", without NaN/Inf so far{jump_text}.",
        {
            "onset_step": step,
            "signal": name,
            "layer": onset.get("layer"),
            "growth_factor": factor,
            "lr": jump["to"] if jump else case.header("lr", step),
            "lr_before": jump["from"] if jump else None,
            "lr_change": jump,
        },
    )


def lr_jump(onset: dict) -> dict | None:
    """The explosion record's learning-rate jump before the onset ``{"step",
    "from", "to"}`` (finite numbers), or None."""
    jump = onset.get("lr_change")
    if not isinstance(jump, dict) or not isinstance(jump.get("step"), int):
        return None
    values = [jump.get("from"), jump.get("to")]
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
        return None
    # The rates were recorded in float32: 7 significant digits are all they hold.
    rounded = [float(f"{v:.7g}") for v in values]
    return {"step": jump["step"], "from": rounded[0], "to": rounded[1]}


def explosion_sign(case: Case) -> Finding | None:
    """Sign: a blow-up that has not (yet) produced NaN/Inf, confirmed by the series."""
    rec = case.rec
    if rec.incident or not rec.explosion or rec.series is None:
        return None
    onset, name = rec.explosion.get("step"), rec.explosion.get("signal")
    if not isinstance(onset, int) or not isinstance(name, str):
        return None
    values = signal(rec.series, name)
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
    lr_text = f" (lr = {fmt(lr, 4)} at onset)" if lr is not None and lr > 0 else ""
    name = signal_text(case, name)
    # One ratio per signal: the record's factor (value / reference level), the
    # card's; the series' peak / median only for a record written without it.
    factor, value, reference = (rec.explosion.get(k) for k in ("factor", "value", "reference"))
    if not all(isinstance(v, (int, float)) for v in (factor, value, reference)):
        factor, value, reference = peak / median, peak, median
    idle = optimizer_idle(rec.series, onset, int(rec.series.steps[-1]))
    advice = (
        f"Lower the learning rate{lr_text} or clip gradients (clipnorm / global_clipnorm)."
        if idle is None
        else NOT_THE_OPTIMIZER.format(idle=idle, what=name)
    )
    return Finding(
        f"The {name} started to explode at step {onset}: it reached {fmt(value, 4)}, "
        f"{fmt(factor)}x its reference level ({fmt(reference, 4)}), without NaN/Inf so "
        f"far. {advice}",
        {
            "step": onset,
            "signal": name,
            "value": value,
            "reference": reference,
            "factor": factor,
            "lr": lr if lr is not None and math.isfinite(lr) else None,
        },
    )


OVERCONFIDENT = (
    "The model is becoming over-confident: lower the learning rate, add label "
    "smoothing or regularization, and compute the loss from logits."
)
OUTPUTS_GROWING = (
    "The outputs kept growing: lower the learning rate or clip gradients, and check "
    "the scale of the targets."
)
OUTPUTS_TITLE = "Outputs grew until the loss broke"


def _rising_words(case: Case, first: int, last: int) -> tuple[str, str, str | None]:
    """(the quantity, the advice, the sign's title) for logits or a regression's
    outputs that climbed over steps ``first``-``last``; the advice never
    contradicts the recorded numbers (a rate of 0: no update made them grow)."""
    logits = case.output_word() == "logits"
    what = "|logit|" if logits else "|output|"
    idle = optimizer_idle(case.rec.series, first, last)
    if idle is not None:
        advice = NOT_THE_OPTIMIZER.format(idle=idle, what="logits" if logits else "outputs")
    else:
        advice = OVERCONFIDENT if logits else OUTPUTS_GROWING
    return what, advice, None if logits else OUTPUTS_TITLE


NOT_THE_OPTIMIZER = (
    "{idle}: no update of the optimizer made the {what} grow, so a lower learning rate "
    "or clipped gradients cannot stop it; look for what scales them inside the model or "
    "the loss (a temperature, a schedule or a constant of its own)."
)


def optimizer_idle(series: Series | None, first: int, last: int) -> str | None:
    """What the record says when the optimizer moved nothing over steps
    ``first``-``last``: ``"The learning rate was 0 over steps A-B"`` (every
    recorded finite rate 0), with ``"and the gradient norm 0 at step C"`` when
    the last finite one was 0; None otherwise or when not recorded."""
    if series is None or "lr" not in series.columns:
        return None
    inside = (series.steps >= first) & (series.steps <= last)
    rates = series.columns["lr"][inside]
    rates = rates[np.isfinite(rates)]
    if not len(rates) or np.any(rates != 0):
        return None
    said = f"the learning rate was 0 over steps {first}-{last}"
    norms = series.columns.get("grad_norm")
    if norms is not None:
        finite = inside & np.isfinite(norms)
        if finite.any() and norms[finite][-1] == 0:
            said += f" and the gradient norm 0 at step {int(series.steps[finite][-1])}"
    return said[0].upper() + said[1:]


def logits_rising(case: Case) -> Finding | None:
    """Sign: |logits| rose step after step before the loss became non-finite."""
    rec = case.rec
    if rec.phase != "loss" or rec.series is None or rec.step is None:
        return None
    values = abs_logits(rec.series)
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
        what, advice, title = _rising_words(case, int(steps[first]), int(steps[end]))
        return Finding(
            f"The largest {what} rose for {rises} consecutive steps, from {fmt(low, 4)} "
            f"(step {int(steps[first])}) to {fmt(high, 4)} (step {int(steps[end])}), before "
            f"the loss became {rec.incident.get('kind', 'non-finite')} at step {rec.step}. "
            + advice,
            {
                "steps": rises,
                "first": low,
                "last": high,
                "first_step": int(steps[first]),
                "last_step": int(steps[end]),
            },
            title,
        )
    return _logits_trend(case, values, steps, end)


def _logits_trend(case: Case, values: np.ndarray, steps: np.ndarray, end: int) -> Finding | None:
    """The noisy form of logits rising: segment medians of |logits| climbing steadily."""
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
    climb = np.array_split(window_steps, TREND_SEGMENTS)[-1]  # the last stretch: the climb
    what, advice, title = _rising_words(case, int(climb[0]), last_step)
    return Finding(
        f"The largest {what} climbed steadily over the {len(window)} steps before the "
        f"incident: its median over {TREND_SEGMENTS} successive stretches went "
        + " -> ".join(fmt(m, 4) for m in medians)
        + f" (steps {first_step}-{last_step}), before the loss became "
        f"{case.incident.get('kind', 'non-finite')} at step {case.step}. " + advice,
        {
            "steps": len(window),
            "first": medians[0],
            "last": medians[-1],
            "first_step": first_step,
            "last_step": last_step,
        },
        title,
    )


def grad_norm_spike(case: Case) -> Finding | None:
    """Sign: the global gradient norm x1000 above its earlier median."""
    series, step = case.rec.series, case.step
    if series is None or step is None or "grad_norm" not in series.columns:
        return None
    norms = series.columns["grad_norm"].astype(np.float64)
    finite = np.isfinite(norms)
    recent = finite & (series.steps <= step) & (series.steps >= step - SPIKE_WINDOW)
    earlier = finite & (series.steps < step - SPIKE_WINDOW)
    if not recent.any() or earlier.sum() < MIN_BASELINE_STEPS:
        return None
    median = float(np.median(norms[earlier]))
    index = np.flatnonzero(recent)[np.argmax(norms[recent])]
    peak = float(norms[index])
    if not median > 0 or peak / median < SPIKE_RATIO:
        return None
    ratio = peak / median
    return Finding(
        f"The global gradient norm reached {fmt(peak, 4)} at step {int(series.steps[index])}, "
        f"{ratio:.3g}x its median ({fmt(median, 4)}) over the {int(earlier.sum())} earlier "
        "steps. Clip gradients (e.g. clipnorm=1.0 or global_clipnorm) or lower the "
        "learning rate.",
        {
            "ratio": ratio,
            "grad_norm": peak,
            "grad_norm_step": int(series.steps[index]),
            "median": median,
            "median_steps": int(earlier.sum()),
        },
    )
