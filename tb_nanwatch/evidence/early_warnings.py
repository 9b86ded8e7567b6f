"""The rules that warn before the NaN: one function a kind, pure arithmetic.

Each rule reads numbers the recorder already has (the planned learning
rates, the first step's statistics, the recent per-step record) and returns
a warning (:func:`warning`) or None. The kinds and their rules:

``schedule_jump``
    At train begin the learning-rate schedule is read over the planned steps.
    Step ``i`` is a jump when its rate is more than ``JUMP_FACTOR`` (10) times
    the rate of step ``i - 1``, above the largest rate of every step before it
    (by more than ``ABOVE_SLACK``, 1%: a restart's rounding is not above),
    and a discontinuity: its rise is more than ``JUMP_FACTOR`` times the rise
    of the steps on either side (a fall counts as no rise, so a one-step
    spike is a jump). A warm-up ramp (even one from 0), decays and
    warm restarts back to the initial rate are not jumps.
``probabilities_expected``
    The loss reads probabilities (``from_logits=False``, or a loss that reads
    probabilities by name) and an output that is not a softmax or sigmoid is
    not probabilities at the first step: below 0, above 1, or (for a
    categorical loss) rows that cannot sum to 1 (``units * max < 0.99`` or
    ``units * min > 1.01``).
``data_scale``
    A float model input, or a regression loss's target, reaches
    ``|x| >= DATA_SCALE`` (1e3) at the first step. Integer inputs (ids), inputs
    whose first layer normalizes or looks ids up (``Normalization``,
    ``Rescaling``, ``Embedding``, ...) and a classification loss's targets
    are not checked.
``overflow_forecast``
    A watched signal (a layer's max |activation|, the largest |logit|, the
    loss, the global gradient norm) grows geometrically: over the last
    ``WINDOW`` (16) steps ``log|x|`` fits a line with ``R^2 >= MIN_R2`` (0.9),
    growing by more than ``MIN_GROWTH`` (5%) a step, and the last half of
    the window grows at least ``KEEPS_PACE`` (0.7) as fast as the whole
    (growth that slows to a plateau does not), and it is half-way to its
    limit on the log scale (``|x| >= sqrt(limit)``: the early growth of a
    signal far below its limit is no evidence). Extrapolated, it passes its
    limit within ``HORIZON`` (50) steps, and no further than the window
    itself grew (the factor still to go is at most the window's growth, so
    a forecast reaches about ``WINDOW`` steps ahead). The limits: float16's
    65504 (float32's 3.4e38) for an activation or an output; ``log`` of that
    for the logits of a hand-written softmax or log (the loss is none of
    Keras', whose softmax is stable, and the output has a final softmax or
    sigmoid or the loss is named for one, a log or an exp: ``exp``
    overflows, or a probability underflows to exactly 0, past 11.09 and
    88.72); float32's for the loss and the gradient norm. The predicted step
    is the first extrapolated past the limit; a signal already past its
    limit is no forecast.
``loss_scale_collapse``
    Under mixed precision the dynamic loss scale halved on ``HALVINGS`` (8)
    consecutive steps. The halvings from the initial scale at the start of a
    run (until a step keeps its scale) are the scaler finding a scale the
    gradients fit, and count only when the step before held NaN gradients
    (an overflow is Inf, which a lower scale cures; no scale cures a NaN).
    The predicted step is where, halving on, it falls below the
    ``min_loss_scale`` floor or the ``max_consecutive_skips`` limit ends the
    run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from tb_nanwatch.evidence.remedies import NORMALIZING_LAYERS

KINDS = (
    "schedule_jump",
    "probabilities_expected",
    "data_scale",
    "overflow_forecast",
    "loss_scale_collapse",
)

JUMP_FACTOR = 10.0
ABOVE_SLACK = 0.01
DATA_SCALE = 1e3
WINDOW = 16
MIN_R2 = 0.9
MIN_GROWTH = 1.05
KEEPS_PACE = 0.7
HORIZON = 50
HALF_WAY = 0.5
HALVINGS = 8
ROW_SUM_SLACK = 0.01

FLOAT16_MAX = 65504.0
FLOAT32_MAX = float(np.finfo(np.float32).max)
BFLOAT16_MAX = 3.3895313892515355e38

# First layers that bring raw inputs to unit scale, or read them as ids.
SCALING_LAYERS = NORMALIZING_LAYERS | frozenset(
    {
        "Embedding",
        "CategoryEncoding",
        "IntegerLookup",
        "StringLookup",
        "Hashing",
        "TextVectorization",
        "Discretization",
    }
)
PROBABILITY_LOSSES = ("crossentropy", "kldivergence", "kld")
# Words of Keras' own loss names (their softmax and log are stable), and of
# the names of hand-written losses that take an exp or a log of the outputs.
KERAS_LOSS_WORDS = (
    "crossentropy",
    "kldivergence",
    "kld",
    "hinge",
    "poisson",
    "cosine",
    "squared",
    "absolute",
    "huber",
    "logcosh",
    "ctc",
    "dice",
    "tversky",
)
EXP_WORDS = ("softmax", "sigmoid", "logit", "log", "exp", "entropy", "likelihood", "nll")
REGRESSION_LOSSES = ("squared", "absolute", "huber", "logcosh", "mse", "mae", "mape", "msle")


def warning(step: int, kind: str, predicted_step: int | None, message: str, evidence: dict) -> dict:
    """One warning as recorded: ``{"step", "kind", "predicted_step", "message", "evidence"}``."""
    return {
        "step": int(step),
        "kind": kind,
        "predicted_step": None if predicted_step is None else int(predicted_step),
        "message": message,
        "evidence": evidence,
    }


def _loss_key(loss_name: str | None) -> str:
    return (loss_name or "").lower().replace("_", "")


def reads_probabilities(loss_name: str | None, from_logits: bool | None) -> bool:
    """Whether the loss reads probabilities (not logits)."""
    key = _loss_key(loss_name)
    return from_logits is False or (
        from_logits is None and any(word in key for word in PROBABILITY_LOSSES)
    )


def exp_limited(loss_name: str | None, before_final_activation: bool) -> bool:
    """Whether an output's logits pass through a hand-written ``exp``: the
    loss is none of Keras' (theirs are stable) and reads the outputs as
    logits or probabilities (a final softmax or sigmoid, or a loss named for
    them, a log, an exp or a likelihood)."""
    key = _loss_key(loss_name)
    if not key or any(word in key for word in KERAS_LOSS_WORDS + REGRESSION_LOSSES):
        return False
    return before_final_activation or any(word in key for word in EXP_WORDS)


def is_regression(loss_name: str | None) -> bool:
    """Whether the loss, by its name, is a regression loss (its targets are values)."""
    key = _loss_key(loss_name)
    return "crossentropy" not in key and any(word in key for word in REGRESSION_LOSSES)


# -- schedule_jump --------------------------------------------------------------


def schedule_jump(rates: Sequence[float] | np.ndarray, step: int = 0) -> dict | None:
    """The first jump of the planned rates (``rates[i]``: the rate of step i), or None."""
    r = np.asarray(rates, np.float64)
    if r.size < 2 or not np.isfinite(r).all():
        return None
    rise = np.diff(r)  # rise[i - 1]: from step i - 1 to step i
    before_max = np.maximum.accumulate(r)[:-1]
    # The rises beside it (a fall counts as none: a one-step spike is a jump too).
    neighbours = np.maximum(
        np.concatenate([[0.0], rise[:-1]]), np.concatenate([rise[1:], [0.0]])
    ).clip(min=0.0)
    jumps = (
        (r[1:] > JUMP_FACTOR * r[:-1])
        & (r[1:] > before_max * (1 + ABOVE_SLACK))  # a restart's rounding is not above
        & (rise > JUMP_FACTOR * neighbours)
        & (r[:-1] >= 0)
    )
    found = np.flatnonzero(jumps)
    if not found.size:
        return None
    i = int(found[0]) + 1
    evidence = {
        "jump_step": i,
        "rate_before": float(r[i - 1]),
        "rate": float(r[i]),
        "largest_before": float(before_max[i - 1]),
        "planned_steps": int(r.size),
    }
    message = (
        f"the learning-rate schedule jumps at step {i} from {r[i - 1]:.3g} to {r[i]:.3g} "
        f"({r[i] / max(r[i - 1], 1e-300):.3g}x), above any rate before it"
    )
    return warning(step, "schedule_jump", i, message, evidence)


# -- probabilities_expected -----------------------------------------------------------


def probabilities_expected(
    outputs: Sequence[dict], loss_name: str | None, from_logits: bool | None, step: int = 0
) -> dict | None:
    """The first output that is no probabilities for a loss that reads them.

    ``outputs``: one dict an output, ``{"name", "min", "max", "units",
    "activation"}`` (the step's min and max of the output, its last
    dimension and final activation; None where not known)."""
    if not reads_probabilities(loss_name, from_logits):
        return None
    categorical = "categorical" in _loss_key(loss_name)
    for output in outputs:
        if output.get("activation") in ("softmax", "sigmoid"):
            continue  # probabilities by construction
        low, high = output.get("min"), output.get("max")
        if low is None or high is None or not (math.isfinite(low) and math.isfinite(high)):
            continue
        why = _not_probabilities(low, high, output.get("units") if categorical else None)
        if why is None:
            continue
        evidence = {"output": output.get("name"), "min": low, "max": high, "loss": loss_name}
        message = (
            f"the loss reads probabilities, but output {output.get('name')} {why} at step "
            f"{step} (min {low:.3g}, max {high:.3g}): logits into a probability loss?"
        )
        return warning(step, "probabilities_expected", None, message, evidence)
    return None


def _not_probabilities(low: float, high: float, units: int | None) -> str | None:
    if low < 0:
        return "is negative"
    if high > 1:
        return "is above 1"
    if units and units > 1:
        if units * high < 1 - ROW_SUM_SLACK or units * low > 1 + ROW_SUM_SLACK:
            return "has rows that cannot sum to 1"
    return None


# -- data_scale -----------------------------------------------------------------------


def data_scale(
    inputs: Sequence[dict], loss_name: str | None, first_layer: str | None, step: int = 0
) -> dict | None:
    """The first float input or regression target with ``|x| >= DATA_SCALE``.

    ``inputs``: one dict an input entry, ``{"name", "min", "max", "dtype",
    "target"}``."""
    for item in inputs:
        if item.get("target"):
            if not is_regression(loss_name):
                continue
        elif first_layer in SCALING_LAYERS or "int" in str(item.get("dtype") or ""):
            continue
        low, high = item.get("min"), item.get("max")
        if low is None or high is None or not (math.isfinite(low) and math.isfinite(high)):
            continue
        largest = max(abs(low), abs(high))
        if largest < DATA_SCALE:
            continue
        what = "regression target" if item.get("target") else "input"
        evidence = {"input": item.get("name"), "min": low, "max": high, "threshold": DATA_SCALE}
        message = (
            f"the {what} {item.get('name')} reaches {largest:.3g} at step {step} (|x| >= "
            f"{DATA_SCALE:g}): unnormalized data overflows the first updates"
        )
        return warning(step, "data_scale", None, message, evidence)
    return None


# -- overflow_forecast ----------------------------------------------------------------


def growth_fit(logs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per column of ``logs`` ([steps, signals] of log|x|): the slope of a
    least-squares line, its R^2 and the slope of the last half of the rows."""
    n = logs.shape[0]
    t = np.arange(n, dtype=np.float64) - (n - 1) / 2.0
    centred = logs - logs.mean(axis=0)
    slope = (t @ centred) / float(t @ t)
    total = (centred**2).sum(axis=0)
    explained = slope**2 * float(t @ t)
    with np.errstate(divide="ignore", invalid="ignore"):
        r2 = np.where(total > 0, explained / total, 0.0)
    half = logs[n // 2 :]
    th = np.arange(half.shape[0], dtype=np.float64) - (half.shape[0] - 1) / 2.0
    recent = (th @ (half - half.mean(axis=0))) / float(th @ th)
    return slope, r2, recent


def overflow_steps(logs: np.ndarray, limits: np.ndarray) -> np.ndarray:
    """Per signal, steps until its extrapolated growth passes its limit
    (``inf`` where the rule does not hold: see the module docstring)."""
    ahead = np.full(logs.shape[1], np.inf)
    if logs.shape[0] < WINDOW or not logs.shape[1]:
        return ahead
    now = logs[-1]
    # Early growth far below the limit is no evidence; checked first, it
    # spares the fit on almost every step of a healthy run.
    near = np.flatnonzero(now >= HALF_WAY * np.log(limits))
    if not near.size:
        return ahead
    logs, now, limits = logs[-WINDOW:, near], now[near], limits[near]
    finite = np.isfinite(logs).all(axis=0)
    slope, r2, recent = growth_fit(np.where(np.isfinite(logs), logs, 0.0))
    ok = finite & (slope > math.log(MIN_GROWTH)) & (r2 >= MIN_R2) & (recent >= KEEPS_PACE * slope)
    to_go = np.log(limits) - now
    ok &= to_go <= slope * (WINDOW - 1)  # extrapolated no further than the window grew
    with np.errstate(divide="ignore", invalid="ignore"):
        steps = np.ceil(to_go / slope)
    ahead[near] = np.where(ok & (steps >= 1) & (steps <= HORIZON), steps, np.inf)
    return ahead


def overflow_forecast(
    step: int, signal: str, value: float, limit: float, ahead: float, slope: float
) -> dict:
    """The warning of a signal whose growth passes ``limit`` in ``ahead`` steps."""
    predicted = int(step + ahead)
    evidence = {
        "signal": signal,
        "value": float(value),
        "limit": float(limit),
        "growth_per_step": float(math.exp(slope)) if math.isfinite(slope) else slope,
        "window": WINDOW,
    }
    message = (
        f"{signal} grows geometrically ({evidence['growth_per_step']:.3g}x a step, now "
        f"{value:.3g}): it passes {limit:.5g} at about step {predicted}"
    )
    return warning(step, "overflow_forecast", predicted, message, evidence)


# -- loss_scale_collapse -----------------------------------------------------------------


def halving_streak(scales: Sequence[float]) -> int:
    """How many consecutive halvings end ``scales`` (a loss scale per step)."""
    streak = 0
    for before, after in zip(scales[-2::-1], scales[::-1], strict=False):
        if not (math.isfinite(before) and before > 0 and 0 <= after <= before * 0.5 * (1 + 1e-6)):
            break
        streak += 1
    return streak


def loss_scale_collapse(
    step: int, streak: int, scale: float, floor: float = 1.0, max_skips: int = 0
) -> dict | None:
    """A warning when ``streak`` (the halvings in a row that count, see the
    module docstring) reached ``HALVINGS``, else None; ``scale``: the scale now."""
    if streak < HALVINGS:
        return None
    to_floor = math.floor(math.log2(scale / floor)) + 1 if floor > 0 and scale > 0 else 149
    ahead = max(to_floor, 1)
    if max_skips:
        ahead = min(ahead, max(max_skips - streak, 1))
    evidence = {"loss_scale": scale, "halvings": streak, "floor": floor}
    message = (
        f"the loss scale halved on {streak} steps in a row (now {scale:g}): the gradients "
        "stay non-finite at every scale tried, and the run is about to stall"
    )
    return warning(step, "loss_scale_collapse", step + ahead, message, evidence)


def dtype_limit(policy: str | None) -> float:
    """The largest finite value of a dtype policy's compute dtype."""
    name = str(policy or "")
    if "bfloat16" in name:
        return BFLOAT16_MAX
    if "float16" in name:
        return FLOAT16_MAX
    return FLOAT32_MAX
