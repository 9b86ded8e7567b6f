"""Counterfactual remedy trials: re-run the failure with each remedy applied.

After training stops at an incident or an explosion (and in ``tb-nanwatch
replay``), :func:`run_trials` tries each remedy the cause offers on **the
user's own objects** (:mod:`tb_nanwatch.record.after_incident.trial_replica`):
the model as trained (every variable, adapted preprocessing layers, BatchNorm
statistics and the dropout seed states included), the user's loss and
optimizer object (its class and schedule), from the recorded state. Every
model and optimizer variable is copied before the trials and restored after
each trial and at the end: afterwards the model and optimizer hold exactly
their trained state. Only a change that cannot run on them (the float32
policy, a loss reading logits) uses a copy of the model, and its setting says
so.

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

**Fidelity before verdicts.** The run without a remedy goes first (the
baseline) and must reproduce the recorded run: its loss at each of the first
:data:`REPRODUCE_STEPS` steps must be within :data:`RTOL` x |recorded| +
:data:`ATOL` (relative 1e-3 + absolute 1e-6, float32; :data:`RTOL_LATER`,
1e-2 relative, after the first step, or within :data:`SPREAD_MARGIN` x what a
re-run nudged by :data:`ROUNDING_NUDGE` moves) of the recorded loss of the
same step (``TrialData.recorded_losses``, the journal's series), or both
non-finite. When it does not, every remedy is ``cannot_verify``, its why
"cannot verify: the re-run diverged from the recorded run at step k
(recorded L1, re-run L2)" (or the recorded losses are not known): never
"did not help". A bundle holds the trainable weights alone (not the dropout
seed states nor BatchNorm's statistics of its step): when its re-run does not
reproduce the step, the episode from the rewind point (every variable) is
tried instead. Without recorded losses (a direct call) the check is not
made and ``fidelity`` says so.

Each step runs at its recorded learning rate (changed by the schedule
remedies). Outcome: ``fixed`` when the loss and every weight stayed finite
through the trial and its signal (an explosion's signal; for an incident, the
loss) stayed under the explosion line, ``explosion_factor`` x its smallest
positive value over the trial's first :data:`REFERENCE_STEPS` steps (never a
reference of 0), and, for a growth trial whose recorded run exploded, the
loss stayed under :data:`LEVEL_SHARE` of the highest loss the recorded run
reached; else ``not_fixed``; or ``not_tried`` and why. A fix whose loss did
not go down (the last pass over the batches against the first) has
``learning`` False. When the baseline does not fail, no trial can tell a fix
and every remedy is ``not_tried``. All trials share one wall-clock budget
(``trial_budget_s``), checked between steps; a trial never raises (a failure
is a warning and ``not_tried``). The budget scales with the step time: the
no-remedy re-run's second step (the first one traces) is timed, and when
every trial's full episode at that pace (the remedies plus the re-run,
``steps x step time`` each) needs more than ``trial_budget_s``, the budget
becomes that, at most :data:`MAX_BUDGET_SCALE` x ``trial_budget_s``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import posixpath
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tb_nanwatch.evidence import remedies, run_dir_box
from tb_nanwatch.evidence import trials as evidence_trials
from tb_nanwatch.evidence.options import WatchOptions
from tb_nanwatch.evidence.printable import printable
from tb_nanwatch.evidence.trials import MAX_TRIALS_BYTES, TRIALS_FILE, TRIALS_VERSION, Trial
from tb_nanwatch.record.after_incident import schedules as _schedules  # noqa: F401 - registers
from tb_nanwatch.record.after_incident import trial_remedies
from tb_nanwatch.record.after_incident.bundle import BUNDLE_DIR, ReproBundle, rebuild_batch
from tb_nanwatch.record.after_incident.console import CONSOLE
from tb_nanwatch.record.after_incident.trial_replica import (
    COPY_NOTE,
    Replica,
    Start,
    TrainedState,
    TrialSkipped,
    Variant,
    inner_optimizer,
    output_units,
    short,
)

# Causes that grew over many steps: their trials start from a rewind point.
FROM_REWIND = ("growth_overflow", "explosion", "unscaled_data")
BUNDLE_STEPS = 10
MIN_REWIND_STEPS = 20
REFERENCE_STEPS = 5
# The no-remedy re-run reproduces the recorded run when its loss at each of
# the first REPRODUCE_STEPS steps is within RTOL x |recorded| + ATOL of the
# recorded loss (float32), or both are non-finite. The first step has the
# recorded weights, batch and random state: only the order of float sums can
# differ (the recorded step also computed the statistics). From the second
# step that rounding has gone through an update, which an adaptive optimizer
# magnifies (ResNet50 + Adam: 1.9e-3 at the second step), hence RTOL_LATER.
REPRODUCE_STEPS = 3
RTOL = 1e-3
RTOL_LATER = 1e-2
ATOL = 1e-6
# When the first step matched and a later one did not, the re-run is run again
# with its start nudged by ROUNDING_NUDGE (relative, about what the recorded
# step's statistics change by rounding): a later step within SPREAD_MARGIN x
# that probe's difference is what rounding alone explains.
ROUNDING_NUDGE = 1e-6
SPREAD_MARGIN = 10.0
# A growth trial fails when its loss reaches this share of the highest loss
# the recorded run reached over the span (when the recorded run exploded).
LEVEL_SHARE = 0.5
# A trial is "learning" when its loss fell by at least this fraction.
LEARNING_DROP = 0.05
# The most the trials' budget grows for slow steps, x trial_budget_s.
MAX_BUDGET_SCALE = 4.0
# Above this much variable memory the model is not copied for trials.
MAX_TRIAL_BYTES = 2 * 1024**3
# The explosion signals a trial can follow (others: the loss).
_SIGNALS = ("loss", "grad_norm", "logits")

Progress = Callable[[str], None]


@dataclasses.dataclass
class TrialData:
    """What the trials start from: the reproduction bundle, the rewind point
    (``record/after_incident/rewind_points.py``'s ``RewindPoint``) or why there is none, and the
    run's optimizer (the object, or its Keras serialization)."""

    bundle: ReproBundle | None = None
    rewind: Any = None
    rewind_missing: str = ""
    optimizer: Any = None
    # The recorded loss of each step by the run's step number (the journal's
    # series): the no-remedy re-run is checked against it. None: not given,
    # the re-run is not checked (said in the plan).
    recorded_losses: dict[int, float] | None = None


class TrialList(list):
    """The trials (``list[Trial]``, in the order the cause offered the
    remedies) plus ``baseline`` (the run without a remedy) and ``plan`` (what
    was re-run, in words)."""

    baseline: Trial | None = None
    plan: str = ""
    fidelity: str = ""  # whether the re-run reproduced the recorded run, in words
    compiled: str = ""  # how the re-runs' steps ran: "xla", "graph", "graph (why not XLA)"


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


def run_trials(
    model: keras.Model,
    cause: dict | None,
    data: TrialData,
    loss_fn: Callable | None,
    options: WatchOptions,
    progress: Progress | None = None,
) -> TrialList:
    """Tries each remedy ``cause["remedy_ids"]`` offers; see the module docstring.

    ``progress`` gets one line per remedy (default: the console's updating
    progress line). Never raises.
    """
    say = progress or _to_console
    ids = [r for r in (cause or {}).get("remedy_ids") or [] if not trial_remedies.is_advice(r)]
    trials = TrialList()
    if not ids:
        return trials
    optimizer = _optimizer_object(model, data)
    try:
        episode = plan(model, cause, data)
    except TrialSkipped as skipped:
        trials.extend(Trial(r, "not_tried", why=str(skipped)) for r in ids)
        say(f"NanWatch trials: none run: {skipped}")
        return trials
    except Exception as error:  # noqa: BLE001 - the trials never break the caller
        warnings.warn(f"NanWatch could not prepare the remedy trials: {error!r}", stacklevel=2)
        trials.extend(Trial(r, "not_tried", why=f"could not prepare: {short(error)}") for r in ids)
        return trials
    try:
        if optimizer is not None and not getattr(optimizer, "built", True):
            optimizer.build(model.trainable_variables)  # as its first step would: fresh state
        trained = TrainedState(model, optimizer, int(options.rewind_memory_mb * 2**20))
    except Exception as error:  # noqa: BLE001 - without a copy of the state, no trial
        why = f"the trained state could not be kept ({short(error)})"
        trials.extend(Trial(r, "not_tried", why=why) for r in ids)
        return trials
    judge = _Judge.of(cause, options, episode, data.recorded_losses)
    user = UserRun(model, loss_fn, optimizer, trained)
    runner = _Runner(user, episode, judge, options.trial_budget_s)
    runner.runs = len(ids) + 1
    trials.plan = episode.description
    try:
        with _quiet_tensorflow():
            trials.baseline = runner.baseline(say, data.recorded_losses)
            if trials.baseline.outcome == "cannot_verify" and episode.from_bundle:
                runner = _from_rewind_instead(runner, model, cause, data, options, say)
                trials.baseline, trials.plan = runner.baseline_trial, runner.episode.description
            trials.fidelity = runner.fidelity
            trials.compiled = ", ".join(sorted(runner.compiled))
            for number, remedy in enumerate(ids, 1):
                for done in runner.tried(remedy, cause, trials.baseline):
                    trials.append(done)
                    text = evidence_trials.trial_text(done)
                    say(f"NanWatch trial {number}/{len(ids)}: {done.remedy}: {text}")
    finally:
        trained.restore()  # the user's model and optimizer exactly as trained
        trained.close()
    return trials


def _from_rewind_instead(
    runner: _Runner,
    model: keras.Model,
    cause: dict,
    data: TrialData,
    options: WatchOptions,
    say: Progress,
) -> _Runner:
    """The bundle's re-run did not reproduce the recorded step (the bundle
    holds the trainable weights alone: not the dropout seed states, nor
    BatchNorm's statistics of the step): the episode from the rewind point,
    which holds every variable, when there is one and it reproduces; else
    ``runner`` as it was. The budget stays the one shared deadline."""
    try:
        episode = plan(model, cause, data, from_rewind=True)
    except TrialSkipped:
        return runner
    judge = _Judge.of(cause, options, episode, data.recorded_losses)
    other = _Runner(runner.user, episode, judge, runner.budget_s)
    other.started, other.runs, other.compiled = runner.started, runner.runs, runner.compiled
    other.deadline = runner.deadline
    say(f"NanWatch trials: from the bundle, {runner.fidelity}; from the rewind point instead")
    baseline = other.baseline(say, data.recorded_losses)
    if baseline.outcome == "cannot_verify":
        return runner
    return other


@contextlib.contextmanager
def _quiet_tensorflow() -> Iterator[None]:
    """TensorFlow's retracing warnings off (each trial traces its own step)."""
    logger = tf.get_logger()
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _to_console(line: str) -> None:
    CONSOLE.progress(printable(line))


# -- what the trials re-run --------------------------------------------------------------


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
    optimizer = _optimizer_object(model, data)
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


def _optimizer_object(model: keras.Model, data: TrialData) -> Any:
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
    if not saved.info.get("exact", True):
        raise TrialSkipped("the bundle is not exact: its batch or weights are not the step's")
    batch = saved.batch if isinstance(saved.batch, list) else [saved.batch]
    lr = (cause.get("evidence") or {}).get("lr")
    state = "its optimizer state" if saved.optimizer else "a fresh optimizer state"
    return Episode(
        batches=[batch],
        rates=[float(lr) if _number(lr) else None],
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
        rates=[float(r) if _number(r) else None for r in point.learning_rates],
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


def _number(value: object) -> bool:
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


# -- running one trial -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Judge:
    """When a trial failed: a non-finite step, or its signal above the explosion
    line (an explosion's signal; else the loss: a loss that climbs a thousandfold
    in a few steps is not fixed, even while it is still finite), or, for a
    growth trial, its loss at the level the recorded run reached.

    The line is ``factor`` x the smallest positive value of the trial's first
    REFERENCE_STEPS steps (never a reference of 0: a loss that starts at
    exactly 0 is measured from its first positive value, else from the
    recorded run's smallest positive loss over the span). ``level``: the
    highest loss the recorded run reached over the span when it exploded
    (above its own line; None otherwise or when not recorded): a trial whose
    loss reaches LEVEL_SHARE of it failed as the recorded run did.
    """

    signal: str
    factor: float
    floor: float | None = None
    level: float | None = None

    @classmethod
    def of(
        cls,
        cause: dict,
        options: WatchOptions,
        episode: Episode | None = None,
        recorded: dict[int, float] | None = None,
    ) -> _Judge:
        signal = (cause.get("evidence") or {}).get("signal")
        explosion = cause.get("id") == "explosion" and signal in _SIGNALS
        signal = signal if explosion else "loss"
        floor = level = None
        if episode is not None and recorded and episode.first_step is not None:
            span = range(episode.first_step, episode.first_step + episode.span)
            losses = [recorded[s] for s in span if s in recorded]
            finite = [v for v in losses if math.isfinite(v)]
            positive = [v for v in finite if v > 0]
            floor = min(positive) if positive else None
            exploded = floor is not None and max(finite) > options.explosion_factor * floor
            if episode.growth and signal == "loss" and exploded:
                level = max(finite)
        return cls(signal, options.explosion_factor, floor, level)

    def reference(self, values: list[float]) -> float | None:
        early = [v for v in values[:REFERENCE_STEPS] if math.isfinite(v) and v > 0]
        if early:
            return min(early)
        if self.signal == "loss" and self.floor is not None:
            return self.floor
        later = [v for v in values if math.isfinite(v) and v > 0]
        return min(later) if later else None

    def above_line(self, values: list[float]) -> bool:
        if not values:
            return False
        reference = self.reference(values)
        return reference is not None and values[-1] > self.factor * reference

    def at_level(self, values: list[float]) -> bool:
        """Whether the loss reached the level the recorded run exploded to."""
        return self.level is not None and bool(values) and values[-1] >= LEVEL_SHARE * self.level


@dataclasses.dataclass(frozen=True)
class UserRun:
    """The user's own objects a trial trains: the model, the loss (a custom
    loop's ``loss_fn``; None: the compiled model's), the optimizer, and their
    trained state, restored after each trial (None: not kept)."""

    model: keras.Model
    loss_fn: Callable | None = None
    optimizer: Any = None
    trained: TrainedState | None = None


class _Runner:
    """Runs the trials of one episode under one wall-clock budget, on the
    user's model and optimizer, restoring their trained state after each."""

    def __init__(self, user: UserRun, episode: Episode, judge: _Judge, budget_s: float) -> None:
        self.model = user.model
        self.loss_fn = user.loss_fn
        self.episode = episode
        self.judge = judge
        self.budget_s = budget_s
        self.started = time.monotonic()
        self.deadline = self.started + budget_s
        self.runs = 1  # the episodes the budget covers (the remedies' and the baseline)
        self.paced = False
        self.optimizer = user.optimizer
        self.trained = user.trained
        self.user = user
        self.fidelity = ""
        self.compiled: set[str] = set()  # each re-run's Replica.compiled
        self.first_step_matched = False  # the last check's first step reproduced
        self.baseline_trial: Trial | None = None
        self._losses: list[float] = []
        # Combinations of remedies tried as their own remedy (see _with_partner).
        self.combined: list[Trial] = []
        self.tried_pairs: set[tuple[str, ...]] = set()
        self.offered: list[str] = []  # the remedy ids the cause offers, in order

    def baseline(self, say: Progress, recorded: dict[int, float] | None = None) -> Trial:
        """The run as recorded: it must reproduce the recorded run (else every
        remedy is ``cannot_verify``) and fail for a trial to tell a fix."""
        result = self.attempt("none", Variant())
        if result.outcome != "not_tried":
            losses = list(self._losses)
            diverged = self.check(losses, recorded)
            if diverged is not None and self.first_step_matched:
                diverged = self.check(losses, recorded, self._rounding_spread(losses))
            if diverged is not None:
                result = dataclasses.replace(result, outcome="cannot_verify", why=diverged)
            self._losses = losses
        text = evidence_trials.trial_text(result)
        fidelity = f"; {self.fidelity}" if self.fidelity else ""
        say(f"NanWatch trials: {self.episode.description}; as recorded: {text}{fidelity}")
        self.baseline_trial = result
        return result

    def _rounding_spread(self, losses: list[float]) -> list[float]:
        """How far rounding alone carries the re-run: at each of its first
        steps, |loss - loss of the re-run whose start was nudged by
        ROUNDING_NUDGE| (an adaptive optimizer's first updates amplify a
        rounding difference, such as the one the recorded step's statistics
        make, by orders of magnitude). [] when the probe could not run."""
        probe = self.attempt(
            "none", Variant(setting="nudged", start_noise=ROUNDING_NUDGE), limit=REPRODUCE_STEPS
        )
        if probe.outcome == "not_tried":
            return []
        return [abs(a - b) for a, b in zip(self._losses, losses, strict=False)]

    def check(
        self,
        losses: list[float],
        recorded: dict[int, float] | None,
        spread: list[float] | None = None,
    ) -> str | None:
        """Whether the no-remedy re-run reproduced the recorded run over its
        first REPRODUCE_STEPS steps: None when it did (or when no recorded
        losses were given: then ``fidelity`` says it was not checked), else
        the ``cannot verify: ...`` why. ``spread``: after the first step, a
        difference within SPREAD_MARGIN x the rounding probe's is reproduced."""
        episode = self.episode
        self.first_step_matched = False
        if recorded is None or episode.first_step is None:
            self.fidelity = "the re-run was not checked against a recorded run (no recorded losses)"
            return None
        steps = range(episode.first_step, episode.first_step + min(REPRODUCE_STEPS, episode.span))
        compared = []
        for i, step in enumerate(steps):
            if i >= len(losses):
                break
            want = recorded.get(step)
            if want is None:
                continue
            got = losses[i]
            compared.append(step)
            noise = SPREAD_MARGIN * spread[i] if spread and i < len(spread) and i > 0 else 0.0
            if not _same_loss(want, got, RTOL if i == 0 else RTOL_LATER, noise):
                self.fidelity = (
                    f"the re-run diverged from the recorded run at step {step} "
                    f"(recorded {want:.7g}, re-run {got:.7g}"
                    + (f"; rounding alone moves it {spread[i]:.2g}" if noise else "")
                    + ")"
                )
                return f"cannot verify: {self.fidelity}"
            self.first_step_matched = True
            if not math.isfinite(want):
                break  # the recorded run ends here
        if not compared:
            self.fidelity = (
                f"the recorded losses of steps {steps.start}-{steps.stop - 1} are not known"
            )
            return f"cannot verify: {self.fidelity}"
        gaps = [
            abs(losses[s - episode.first_step] - recorded[s]) / max(abs(recorded[s]), ATOL)
            for s in compared
            if math.isfinite(recorded[s])
        ]
        self.fidelity = _reproduced(compared, gaps, spread)
        return None

    def tried(self, remedy: str, cause: dict, baseline: Trial) -> list[Trial]:
        """``remedy``'s trial, then the combinations it was tried in (each its
        own remedy); never raises."""
        try:
            trial = self.trial(remedy, cause, baseline)
        except Exception as error:  # noqa: BLE001 - one remedy's failure is not the rest's
            warnings.warn(f"NanWatch trial {remedy} failed: {error!r}", stacklevel=2)
            trial = Trial(remedy, "not_tried", why=f"failed: {short(error)}")
        return [trial, *self.take_combined()]

    def trial(self, remedy: str, cause: dict, baseline: Trial) -> Trial:
        if baseline.outcome == "cannot_verify":
            return Trial(remedy, "cannot_verify", why=baseline.why)
        if baseline.outcome == "not_tried":
            return Trial(remedy, "not_tried", why=f"the run as recorded: {baseline.why}")
        if baseline.outcome == "fixed":
            return Trial(
                remedy,
                "not_tried",
                why=f"the re-run without a remedy did not fail ({baseline.steps} steps): "
                "no trial can tell a fix",
            )
        recorded = self._recorded(cause)
        try:
            variants = trial_remedies.variants(remedy, recorded)
        except TrialSkipped as skipped:
            return Trial(remedy, "not_tried", why=str(skipped))
        if len(variants) > 1:
            return self._in_turn(remedy, variants)
        self.offered = list(cause.get("remedy_ids") or ())
        variant = variants[0]
        alone = self.attempt(remedy, variant)
        partner = trial_remedies.partner(remedy)
        if alone.outcome == "not_fixed" and partner in (cause.get("remedy_ids") or ()):
            self._with_partner(alone, variant, partner, recorded)
        return alone

    def _with_partner(
        self, alone: Trial, variant: Variant, partner: str, recorded: trial_remedies.Recorded
    ) -> None:
        """Inputs and targets both far from unit scale: one data remedy alone
        may not be enough; the two together are tried as their own remedy
        (``combined``: a Trial whose ``together`` names both, its id
        ``first+second`` in the order the cause offers them), once a pair.
        ``alone`` keeps its own outcome."""
        order = [r for r in self.offered if r in (alone.remedy, partner)]
        pair = tuple(order) if len(order) == 2 else (alone.remedy, partner)
        if pair in self.tried_pairs:
            return
        self.tried_pairs.add(pair)
        try:
            other = trial_remedies.variants(partner, recorded)[0]
        except TrialSkipped:
            return
        first, second = (variant, other) if pair[0] == alone.remedy else (other, variant)
        both = self.attempt(
            evidence_trials.combined_id(pair), trial_remedies.together(first, second)
        )
        if both.outcome in ("fixed", "not_fixed"):
            self.combined.append(dataclasses.replace(both, together=pair))

    def take_combined(self) -> list[Trial]:
        """The combination trials run since the last call."""
        found, self.combined = self.combined, []
        return found

    def _recorded(self, cause: dict) -> trial_remedies.Recorded:
        episode = self.episode
        before = (cause.get("evidence") or {}).get("lr_before")
        rate_before = float(before) if _number(before) else _rate_before_jump(episode.rates)
        warmup = len(episode.batches) if len(episode.batches) > 1 else episode.steps // 2
        evidence = cause.get("evidence") or {}
        layer = evidence.get("layer") or (cause.get("incident") or {}).get("layer")
        layer = layer if isinstance(layer, str) and layer else None
        loss = self.loss_fn if self.loss_fn is not None else getattr(self.model, "loss", None)
        activation = remedies.expected_activation(
            remedies.loss_name(loss), output_units(self.model)
        )
        return trial_remedies.Recorded(episode.batches, rate_before, warmup, layer, activation)

    def _in_turn(self, remedy: str, variants: list[Variant]) -> Trial:
        """Each variant in turn (a rate's factors): the first that does not
        fail is the answer; else all of them, said in one trial."""
        tried = []
        for variant in variants:
            result = self.attempt(remedy, variant)
            if result.outcome != "not_fixed":
                return result
            tried.append(result)
        last = tried[-1]
        return dataclasses.replace(
            last,
            setting=", ".join(t.setting for t in tried),
            why=f"failed at every factor; {last.setting}: {last.why}",
        )

    def attempt(self, remedy: str, variant: Variant, limit: int | None = None) -> Trial:
        """One re-run of the episode with ``variant``; never raises. The user's
        model and optimizer get their trained state back after it."""
        self._losses = []
        setting = f"{variant.setting} ({COPY_NOTE})" if variant.needs_copy else variant.setting
        variant = dataclasses.replace(variant, setting=setting)
        replica = None
        try:
            optimizer = self.optimizer
            if optimizer is None:
                optimizer = self.episode.start.optimizer_config
            replica = Replica(self.model, self.loss_fn, self.episode.start, variant, optimizer)
            return self._steps(remedy, variant, replica, limit)
        except TrialSkipped as skipped:
            return Trial(remedy, "not_tried", setting=variant.setting, why=str(skipped))
        except Exception as error:  # noqa: BLE001 - one trial's failure is not the run's
            warnings.warn(f"NanWatch trial {remedy} failed: {error!r}", stacklevel=2)
            return Trial(
                remedy, "not_tried", setting=variant.setting, why=f"failed: {short(error)}"
            )
        finally:
            if replica is not None:
                replica.close()
                if replica.ran:
                    self.compiled.add(replica.compiled)
            if self.trained is not None:
                self.trained.restore()

    def _steps(
        self, remedy: str, variant: Variant, replica: Replica, limit: int | None = None
    ) -> Trial:
        episode, losses, signal = self.episode, self._losses, []
        first_rate = replica.rate
        outcome = lambda o, why="": _trial(remedy, o, variant.setting, losses, why)  # noqa: E731
        traced = None  # when the first step (which traces) ended
        for step in range(episode.steps if limit is None else min(limit, episode.steps)):
            if time.monotonic() > self.deadline:
                return outcome(
                    "not_tried",
                    f"over the time budget (trial_budget_s={self.budget_s:g}) after "
                    f"{step} of {episode.steps} steps",
                )
            raw = episode.batches[step % len(episode.batches)]
            batch = variant.transform(raw) if variant.transform else raw
            if batch is None:
                continue
            rate = self._rate(step, first_rate)
            replica.set_rate(variant.rate(step, rate) if variant.rate else rate)
            result = replica.run(batch)
            if remedy == "none":  # the re-run's second step sets the pace
                traced = self._pace(traced)
            losses.append(result.loss)
            signal.append(getattr(result, self.judge.signal))
            if not result.finite:
                return outcome("not_fixed", f"non-finite at step {step + 1} of {episode.steps}")
            if self.judge.above_line(signal):
                return outcome(
                    "not_fixed",
                    f"the {self.judge.signal} crossed the explosion line at step {step + 1}",
                )
            if self.judge.at_level(losses):
                return outcome(
                    "not_fixed",
                    f"the loss reached the level the recorded run exploded to "
                    f"({self.judge.level:.3g}) at step {step + 1}",
                )
        return _learning(outcome("fixed"), losses, len(episode.batches))

    def _pace(self, traced: float | None) -> float:
        """After the no-remedy re-run's first step: its end; after its second,
        the budget scaled once to that step's time (:meth:`_scale_budget`)."""
        now = time.monotonic()
        if traced is None:
            return now
        if not self.paced:
            self.paced = True
            self._scale_budget(now - traced)
        return traced

    def _scale_budget(self, step_s: float) -> None:
        """The budget for ``runs`` episodes at ``step_s`` a step, when more
        than ``trial_budget_s`` (at most MAX_BUDGET_SCALE x it)."""
        needed = step_s * self.episode.steps * self.runs
        budget = min(max(self.budget_s, needed), MAX_BUDGET_SCALE * self.budget_s)
        self.deadline = max(self.deadline, self.started + budget)

    def _rate(self, step: int, first_rate: float) -> float:
        """The recorded rate of trial step ``step``, else the schedule's, else
        the last recorded one, else the optimizer's own."""
        episode = self.episode
        if step < len(episode.rates) and episode.rates[step] is not None:
            return episode.rates[step]
        if episode.schedule is not None:
            return episode.schedule(step)
        known = [r for r in episode.rates if r is not None]
        return known[-1] if known else first_rate


def _reproduced(compared: list[int], gaps: list[float], spread: list[float] | None) -> str:
    """The fidelity line of a re-run that reproduced the recorded steps ``compared``."""
    largest = f"; largest relative difference {max(gaps):.1e}" if gaps else ""
    first = f"within {RTOL:g} relative + {ATOL:g} at the first"
    if spread:
        probe = ", ".join(f"{d:.2g}" for d in spread[1:])
        within = (
            f"{first}, after it within {RTOL_LATER:g} or {SPREAD_MARGIN:g}x the difference "
            f"rounding alone makes (a re-run nudged by {ROUNDING_NUDGE:g}: {probe})"
        )
    else:
        within = f"{first}, {RTOL_LATER:g} after it"
    return (
        f"the re-run reproduced the recorded losses of steps {compared[0]}-{compared[-1]} "
        f"({within}{largest})"
    )


def _same_loss(recorded: float, rerun: float, rtol: float, noise: float = 0.0) -> bool:
    """The re-run's loss is the recorded one: both non-finite, or within
    rtol x |recorded| + ATOL, or within ``noise``."""
    if not (math.isfinite(recorded) and math.isfinite(rerun)):
        return not math.isfinite(recorded) and not math.isfinite(rerun)
    return abs(rerun - recorded) <= max(rtol * abs(recorded) + ATOL, noise)


def _rate_before_jump(rates: list[float | None]) -> float | None:
    """The rate before the largest rise between consecutive recorded steps."""
    known = [r for r in rates if r is not None and r > 0]
    rises = [(b / a, a) for a, b in zip(known, known[1:], strict=False)]
    if not rises:
        return None
    ratio, before = max(rises)
    return before if ratio > 1 else None


def _trial(remedy: str, outcome: str, setting: str, losses: list[float], why: str) -> Trial:
    return Trial(
        remedy,
        outcome,
        steps=len(losses),
        setting=setting,
        why=why,
        loss_first=losses[0] if losses else None,
        loss_last=losses[-1] if losses else None,
    )


def _learning(trial: Trial, losses: list[float], span: int) -> Trial:
    """Whether the loss went down: the last pass over the batches against the first."""
    if len(losses) < 2:
        return trial
    span = min(span, len(losses) // 2) or 1
    first, last = float(np.mean(losses[:span])), float(np.mean(losses[-span:]))
    return dataclasses.replace(trial, learning=bool(last < first * (1 - LEARNING_DROP)))


# -- words and the file ------------------------------------------------------------------


def tried_lines(trials: list[Trial]) -> list[str]:
    """The console's lines: each trial in words, working remedies first."""
    by_id = evidence_trials.by_remedy(trials)
    order = evidence_trials.rank([t.remedy for t in trials], trials)
    return [f"{remedy}: {evidence_trials.trial_text(by_id[remedy])}" for remedy in order]


def write_trials(run_dir: str, step: int, cause: dict, trials: TrialList) -> str:
    """Writes ``<run dir>/repro/trials.json``; returns its path.

    Never through a symlink, never outside the run dir, and never over a file
    that is not a trials file (a ValueError says so).
    """
    body = {
        "version": TRIALS_VERSION,
        "step": step,
        "cause": cause.get("id"),
        "plan": trials.plan,
        "fidelity": trials.fidelity,
        "compiled": trials.compiled,
        "baseline": None if trials.baseline is None else trials.baseline.to_json(),
        "trials": [t.to_json() for t in trials],
    }
    text = json.dumps(body, indent=1, allow_nan=True)
    directory = posixpath.join(run_dir, BUNDLE_DIR)
    path = posixpath.join(directory, TRIALS_FILE)
    if run_dir_box.is_remote(run_dir):
        tf.io.gfile.makedirs(directory)
        exists = tf.io.gfile.exists(path)
        _check_ours(path, exists)
        if exists:
            tf.io.gfile.remove(path)  # some file systems do not truncate on open
        with tf.io.gfile.GFile(path, "w") as f:
            f.write(text)
        return path
    relative = f"{BUNDLE_DIR}/{TRIALS_FILE}"
    try:  # only inside the run dir, a regular file, never waiting on a FIFO
        previous = run_dir_box.read_inside(run_dir, relative, MAX_TRIALS_BYTES, relative)
    except FileNotFoundError:
        previous = None
    except run_dir_box.RunDirError as error:
        raise run_dir_box.RunDirError(f"not written: {error}") from None
    if previous is not None:
        _check_ours(path, True, previous)
    return run_dir_box.safe_write_bytes(run_dir, relative, text.encode("utf-8"), make_dirs=True)


def _check_ours(path: str, exists: bool, data: bytes | None = None) -> None:
    """A ValueError unless ``path`` (its bytes ``data``, read here when None)
    is absent or a trials file."""
    if not exists:
        return
    try:
        if data is None:
            with tf.io.gfile.GFile(path, "rb") as f:
                data = f.read(MAX_TRIALS_BYTES)
        previous = json.loads(data)
        ours = isinstance(previous, dict) and previous.get("version") == TRIALS_VERSION
    except (ValueError, OSError, tf.errors.OpError):
        ours = False
    if not ours or "trials" not in previous:
        raise ValueError(f"{path} exists and is not a trials file: not replaced")
