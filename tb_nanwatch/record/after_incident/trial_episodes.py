"""What a remedy trial re-runs: the episode, from the bundle or the rewind point.

* a step-local cause (bad input data, the optimizer's update, a float16
  overflow, a math error in the forward pass, the loss or the backward pass)
  re-runs from the reproduction bundle: the batch and the weights (and, for
  an update, the optimizer's state) from before the step, the same batch
  :data:`BUNDLE_STEPS` times;
* a cause that grew over many steps (an overflow after growth, unscaled data,
  an explosion) re-runs from the rewind point (every variable and the
  optimizer's state some steps before) through the recorded batches, the
  whole span through the incident, then through them again: twice the span,
  at least :data:`MIN_REWIND_STEPS` steps.

Each step runs at its recorded learning rate; past the recorded ones, at the
rate the user's schedule gives (:attr:`Episode.schedule`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tb_nanwatch.record.after_incident.bundle import ReproBundle, rebuild_batch
from tb_nanwatch.record.after_incident.rewind_file import load_rewind_point
from tb_nanwatch.record.after_incident.trial_replica import Start, TrialSkipped, inner_optimizer

# Causes that grew over many steps: their trials start from a rewind point.
FROM_REWIND = ("growth_overflow", "explosion", "unscaled_data")
BUNDLE_STEPS = 10
MIN_REWIND_STEPS = 20
# Above this much variable memory the model is not copied for trials.
MAX_TRIAL_BYTES = 2 * 1024**3


@dataclasses.dataclass
class TrialData:
    """What the trials start from: the reproduction bundle, the rewind point
    (``record/after_incident/rewind_file.py``'s ``RewindPoint``) or why there is none, and the
    run's optimizer (the object, or its Keras serialization)."""

    bundle: ReproBundle | None = None
    rewind: Any = None
    rewind_missing: str = ""
    optimizer: Any = None
    # The recorded loss of each step by the run's step number (the journal's
    # series): the no-remedy re-run is checked against it. None: not given,
    # the re-run is not checked (said in the plan).
    recorded_losses: dict[int, float] | None = None


def trial_data_of_run(
    run_dir: str,
    summary: dict,
    saved: ReproBundle | None,
    losses: dict[int, float],
    optimizer: Any = None,
    max_bytes: int | None = None,
) -> TrialData:
    """What the trials of the run written in ``run_dir`` start from: the
    bundle ``saved``, the rewind point its run ``summary`` names (its arrays
    read within ``max_bytes``, by default the bundles' limit) or why there is
    none, and the recorded ``losses`` by step (the rewind point's own for its
    steps), which the no-remedy re-run must reproduce."""
    if summary.get("rewind_point"):
        point = load_rewind_point(run_dir, max_bytes)
        return TrialData(
            saved,
            rewind=point,
            optimizer=optimizer,
            recorded_losses={**losses, **point.recorded_losses()},
        )
    missing = summary.get("rewind_point_not_taken") or "none was saved"
    return TrialData(saved, rewind_missing=missing, optimizer=optimizer, recorded_losses=losses)


@dataclasses.dataclass
class Episode:
    """The steps a trial re-runs: the batches (cycled), the recorded rate of
    each (None: not known), how many steps, and where they start."""

    batches: list[list]
    rates: list[float | None]
    steps: int
    start: Start
    description: str
    schedule: Callable[[int], float] | None = None  # the rate at a trial step, from its schedule
    first_step: int | None = None  # the run's step of the trial's first step
    span: int = 1  # the recorded steps the trial's first pass re-runs
    growth: bool = False  # a cause that grew over the span (judged on the recorded level)
    from_bundle: bool = False  # it starts from the reproduction bundle


def plan(model: keras.Model, cause: dict, data: TrialData, from_rewind: bool = False) -> Episode:
    """The episode the trials of ``cause`` re-run (``from_rewind``: only from
    the rewind point), or TrialSkipped saying why none."""
    size = sum(_bytes(v) for v in model.weights)
    if size > MAX_TRIAL_BYTES:
        raise TrialSkipped(
            f"the model's variables ({size / 2**20:.0f} MB) are above the trials' size "
            f"limit ({MAX_TRIAL_BYTES / 2**20:.0f} MB)"
        )
    config = _optimizer_config(data)
    optimizer = optimizer_object(model, data)
    if optimizer is None and config is None:
        raise TrialSkipped("the optimizer is not known (record it with the bundle)")
    builders = [_from_bundle, _from_rewind]
    if cause.get("id") in FROM_REWIND or from_rewind:
        builders = [_from_rewind]  # the incident step alone starts from grown weights
    reasons = []
    for build in builders:
        try:
            episode = build(cause, data, config)
        except TrialSkipped as skipped:
            reasons.append(str(skipped))
            continue
        iteration = _iteration(episode.start.optimizer_state, episode.first_step or 0)
        episode.schedule = _schedule(optimizer, config, iteration)
        episode.growth = cause.get("id") in FROM_REWIND and build is _from_rewind
        episode.from_bundle = build is _from_bundle
        return episode
    raise TrialSkipped("; ".join(reasons))


def _bytes(variable: Any) -> int:
    return int(np.prod(variable.shape)) * tf.as_dtype(variable.dtype).size


def optimizer_object(model: keras.Model, data: TrialData) -> Any:
    """The user's optimizer object the trials train with (None: only its config is known)."""
    if data.optimizer is not None and not isinstance(data.optimizer, dict):
        return data.optimizer
    return getattr(model, "optimizer", None)


def _optimizer_config(data: TrialData) -> dict | None:
    """The optimizer's recorded Keras serialization (for a copy, or when the
    object is not at hand), None when not recorded."""
    if isinstance(data.optimizer, dict):
        return data.optimizer
    if data.bundle is not None and isinstance(data.bundle.info.get("optimizer_config"), dict):
        return data.bundle.info["optimizer_config"]
    return None


def _from_bundle(cause: dict, data: TrialData, config: dict) -> Episode:
    saved = data.bundle
    if saved is None:
        raise TrialSkipped("no reproduction bundle")
    if not saved.weights:
        raise TrialSkipped(
            "the bundle holds no weights from before the step (pre_step_weights='off', or "
            "'on_suspect' for an update-phase incident)"
        )
    if saved.incomplete_why:
        raise TrialSkipped(saved.incomplete_why)
    if not saved.info.get("exact", True):
        raise TrialSkipped("the bundle is not exact: its batch or weights are not the step's")
    batch = saved.batch if isinstance(saved.batch, list) else [saved.batch]
    lr = (cause.get("evidence") or {}).get("lr")
    state = "its optimizer state" if saved.optimizer else "a fresh optimizer state"
    return Episode(
        batches=[batch],
        rates=[float(lr) if finite_number(lr) else None],
        steps=BUNDLE_STEPS,
        start=Start(saved.weights, False, dict(saved.optimizer), config),
        description=(
            f"step {saved.step} from its reproduction bundle ({state}), its batch "
            f"{BUNDLE_STEPS} times"
        ),
        first_step=int(saved.step),
        span=1,
    )


def _from_rewind(cause: dict, data: TrialData, config: dict) -> Episode:
    point = data.rewind
    if point is None:
        raise TrialSkipped(f"no rewind point ({data.rewind_missing or 'none was saved'})")
    batches = [rebuild_batch(point.structure, flat) for flat in point.batches]
    if not batches:
        raise TrialSkipped("the rewind point holds no batches")
    batches = [b if isinstance(b, list) else [b] for b in batches]
    steps = max(2 * len(batches), MIN_REWIND_STEPS)  # through the incident, then again
    last = point.step + len(batches) - 1
    return Episode(
        batches=batches,
        rates=[float(r) if finite_number(r) else None for r in point.learning_rates],
        steps=steps,
        start=Start(dict(point.weights), True, dict(point.optimizer), config),
        description=(
            f"from the rewind point at step {point.step}: its {len(batches)} recorded "
            f"batch{'es' * (len(batches) != 1)} (steps {point.step}-{last}), cycled for "
            f"{steps} steps"
        ),
        first_step=int(point.step),
        span=len(batches),
    )


def finite_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _schedule(optimizer: Any, config: dict | None, iteration: int) -> Callable[[int], float] | None:
    """The learning-rate schedule of the user's optimizer (its own object, a
    custom class included; else the recorded ``config``'s) as a function of
    the trial step (None: a constant rate, or a schedule that cannot be rebuilt)."""
    inner = inner_optimizer(optimizer)
    schedule = getattr(inner, "_learning_rate", None)
    if isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
        return lambda step: float(np.asarray(schedule(iteration + step)))
    if optimizer is not None or config is None:
        return None
    body = config.get("config", {})
    if config.get("class_name") == "LossScaleOptimizer":
        body = body.get("inner_optimizer", {}).get("config", {})
    rate = body.get("learning_rate")
    if not isinstance(rate, dict):
        return None
    try:
        rebuilt = keras.optimizers.schedules.deserialize(rate)
    except Exception:  # noqa: BLE001 - an unregistered schedule: the recorded rates only
        return None
    return lambda step: float(np.asarray(rebuilt(iteration + step)))


def _iteration(state: dict[str, np.ndarray], default: int) -> int:
    for path, value in state.items():
        if path.rsplit("/", 1)[-1] in ("iteration", "iterations") and np.size(value) == 1:
            return int(np.asarray(value).reshape(()))
    return default
