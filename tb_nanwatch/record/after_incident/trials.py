"""Counterfactual remedy trials: re-run the failure with each remedy applied.

After training stops at an incident or an explosion (and in ``tb-nanwatch
replay``), :func:`run_trials` tries each remedy the cause offers on a copy of
the model (:mod:`tb_nanwatch.record.after_incident.trial_replica`; the trained model and the
user's optimizer are never touched) and says whether it kept the run finite:

* a step-local cause (bad input data, the optimizer's update, a float16
  overflow, a math error in the forward pass, the loss or the backward pass)
  re-runs from the reproduction bundle: the batch and the weights (and, for
  an update, the optimizer's state) from before the step, the same batch
  :data:`BUNDLE_STEPS` times;
* a cause that grew over many steps (an overflow after growth, unscaled data,
  an explosion) re-runs from the rewind point (a copy of the weights and the
  optimizer's state some steps before) through the recorded batches, then
  through them again: twice the span, at least :data:`MIN_REWIND_STEPS` steps.

Each step runs at its recorded learning rate (changed by the schedule
remedies). Outcome: ``fixed`` when the loss and every weight stayed finite
through the trial and its signal (an explosion's signal; for an incident, the
loss) stayed under the explosion line, ``explosion_factor`` x its lowest
value over the trial's first :data:`REFERENCE_STEPS` steps; else
``not_fixed``; or ``not_tried`` and why. A fix whose loss did not go down
(the last pass over the batches against the first) has ``learning`` False.
The run without a remedy goes first (the baseline): when it does not fail,
no trial can tell a fix and every remedy is ``not_tried``. All trials share
one wall-clock budget (``trial_budget_s``), checked between steps; a trial
never raises (a failure is a warning and ``not_tried``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import posixpath
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tb_nanwatch.evidence import run_dir_box
from tb_nanwatch.evidence import trials as evidence_trials
from tb_nanwatch.evidence.options import WatchOptions
from tb_nanwatch.evidence.trials import TRIALS_FILE, TRIALS_VERSION, Trial
from tb_nanwatch.record.after_incident import schedules as _schedules  # noqa: F401 - registers
from tb_nanwatch.record.after_incident import trial_remedies
from tb_nanwatch.record.after_incident.bundle import BUNDLE_DIR, ReproBundle, rebuild_batch
from tb_nanwatch.record.after_incident.trial_replica import (
    Replica,
    Start,
    TrialSkipped,
    Variant,
    short,
)

# Causes that grew over many steps: their trials start from a rewind point.
FROM_REWIND = ("growth_overflow", "explosion", "unscaled_data")
BUNDLE_STEPS = 10
MIN_REWIND_STEPS = 20
REFERENCE_STEPS = 5
# A trial is "learning" when its loss fell by at least this fraction.
LEARNING_DROP = 0.05
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


class TrialList(list):
    """The trials (``list[Trial]``, in the order the cause offered the
    remedies) plus ``baseline`` (the run without a remedy) and ``plan`` (what
    was re-run, in words)."""

    baseline: Trial | None = None
    plan: str = ""


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


def run_trials(
    model: keras.Model,
    cause: dict | None,
    data: TrialData,
    loss_fn: Callable | None,
    options: WatchOptions,
    progress: Progress | None = None,
) -> TrialList:
    """Tries each remedy ``cause["remedy_ids"]`` offers; see the module docstring.

    ``progress`` gets one line per remedy (default: stderr). Never raises.
    """
    say = progress or _to_stderr
    ids = [r for r in (cause or {}).get("remedy_ids") or [] if not trial_remedies.is_advice(r)]
    trials = TrialList()
    if not ids:
        return trials
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
    runner = _Runner(model, loss_fn, episode, _Judge.of(cause, options), options.trial_budget_s)
    trials.plan = episode.description
    with _quiet_tensorflow():
        trials.baseline = runner.baseline(say)
        for number, remedy in enumerate(ids, 1):
            try:
                trial = runner.trial(remedy, cause, trials.baseline)
            except Exception as error:  # noqa: BLE001 - one remedy's failure is not the rest's
                warnings.warn(f"NanWatch trial {remedy} failed: {error!r}", stacklevel=2)
                trial = Trial(remedy, "not_tried", why=f"failed: {short(error)}")
            trials.append(trial)
            say(
                f"NanWatch trial {number}/{len(ids)}: {remedy}: {evidence_trials.trial_text(trial)}"
            )
    return trials


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


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# -- what the trials re-run --------------------------------------------------------------


def plan(model: keras.Model, cause: dict, data: TrialData) -> Episode:
    """The episode the trials of ``cause`` re-run, or TrialSkipped saying why none."""
    size = sum(_bytes(v) for v in model.weights)
    if size > MAX_TRIAL_BYTES:
        raise TrialSkipped(
            f"the model's variables ({size / 2**20:.0f} MB) are above the trials' size "
            f"limit ({MAX_TRIAL_BYTES / 2**20:.0f} MB)"
        )
    config = _optimizer_config(model, data)
    builders = [_from_bundle, _from_rewind]
    if cause.get("id") in FROM_REWIND:
        builders = [_from_rewind]  # the incident step alone starts from grown weights
    reasons = []
    for build in builders:
        try:
            return build(cause, data, config)
        except TrialSkipped as skipped:
            reasons.append(str(skipped))
    raise TrialSkipped("; ".join(reasons))


def _bytes(variable: Any) -> int:
    return int(np.prod(variable.shape)) * tf.as_dtype(variable.dtype).size


def _optimizer_config(model: keras.Model, data: TrialData) -> dict:
    optimizer = data.optimizer
    if optimizer is None and data.bundle is not None:
        optimizer = data.bundle.info.get("optimizer_config")
    if optimizer is None:
        optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, dict):
        return optimizer
    if optimizer is None:
        raise TrialSkipped("the optimizer is not known (record it with the bundle)")
    return keras.optimizers.serialize(optimizer)


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
        schedule=_schedule(config, _iteration(saved.optimizer, saved.step)),
    )


def _from_rewind(cause: dict, data: TrialData, config: dict) -> Episode:
    point = data.rewind
    if point is None:
        raise TrialSkipped(f"no rewind point ({data.rewind_missing or 'none was saved'})")
    batches = [rebuild_batch(point.structure, flat) for flat in point.batches]
    if not batches:
        raise TrialSkipped("the rewind point holds no batches")
    batches = [b if isinstance(b, list) else [b] for b in batches]
    steps = max(2 * len(batches), MIN_REWIND_STEPS)
    return Episode(
        batches=batches,
        rates=[float(r) if _number(r) else None for r in point.learning_rates],
        steps=steps,
        start=Start(dict(point.weights), True, dict(point.optimizer), config),
        description=(
            f"from the rewind point at step {point.step}: its {len(batches)} recorded "
            f"batch{'es' * (len(batches) != 1)}, cycled for {steps} steps"
        ),
        schedule=_schedule(config, _iteration(point.optimizer, point.step)),
    )


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _schedule(config: dict, iteration: int) -> Callable[[int], float] | None:
    """The learning-rate schedule of the optimizer ``config`` as a function of
    the trial step (None: a constant rate)."""
    body = config.get("config", {})
    if config.get("class_name") == "LossScaleOptimizer":
        body = body.get("inner_optimizer", {}).get("config", {})
    rate = body.get("learning_rate")
    if not isinstance(rate, dict):
        return None
    schedule = keras.optimizers.schedules.deserialize(rate)
    return lambda step: float(schedule(iteration + step))


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
    in a few steps is not fixed, even while it is still finite)."""

    signal: str
    factor: float

    @classmethod
    def of(cls, cause: dict, options: WatchOptions) -> _Judge:
        signal = (cause.get("evidence") or {}).get("signal")
        explosion = cause.get("id") == "explosion" and signal in _SIGNALS
        return cls(signal if explosion else "loss", options.explosion_factor)

    def above_line(self, values: list[float]) -> bool:
        if not values:
            return False
        reference = min(values[:REFERENCE_STEPS])
        return reference > 0 and values[-1] > self.factor * reference


class _Runner:
    """Runs the trials of one episode under one wall-clock budget."""

    def __init__(
        self,
        model: keras.Model,
        loss_fn: Callable | None,
        episode: Episode,
        judge: _Judge,
        budget_s: float,
    ) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.episode = episode
        self.judge = judge
        self.budget_s = budget_s
        self.deadline = time.monotonic() + budget_s

    def baseline(self, say: Progress) -> Trial:
        """The run as recorded: it must fail for a trial to tell a fix."""
        result = self.attempt("none", Variant())
        text = evidence_trials.trial_text(result)
        say(f"NanWatch trials: {self.episode.description}; as recorded: {text}")
        return result

    def trial(self, remedy: str, cause: dict, baseline: Trial) -> Trial:
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
        variant = variants[0]
        alone = self.attempt(remedy, variant)
        partner = trial_remedies.partner(remedy)
        if alone.outcome != "not_fixed" or partner not in (cause.get("remedy_ids") or ()):
            return alone
        return self._with_partner(alone, variant, partner, recorded)

    def _with_partner(
        self, alone: Trial, variant: Variant, partner: str, recorded: trial_remedies.Recorded
    ) -> Trial:
        """Inputs and targets both far from unit scale: one data remedy alone
        may not be enough; tried again with the other (said in the setting)."""
        try:
            both = trial_remedies.together(variant, trial_remedies.variants(partner, recorded)[0])
        except TrialSkipped:
            return alone
        together = self.attempt(alone.remedy, both)
        if together.outcome != "fixed":
            return alone
        return dataclasses.replace(together, why=f"alone it did not help: {alone.why}")

    def _recorded(self, cause: dict) -> trial_remedies.Recorded:
        episode = self.episode
        before = (cause.get("evidence") or {}).get("lr_before")
        rate_before = float(before) if _number(before) else _rate_before_jump(episode.rates)
        warmup = len(episode.batches) if len(episode.batches) > 1 else episode.steps // 2
        return trial_remedies.Recorded(episode.batches, rate_before, warmup)

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

    def attempt(self, remedy: str, variant: Variant) -> Trial:
        """One re-run of the episode with ``variant``; never raises."""
        try:
            replica = Replica(self.model, self.loss_fn, self.episode.start, variant)
            return self._steps(remedy, variant, replica)
        except TrialSkipped as skipped:
            return Trial(remedy, "not_tried", setting=variant.setting, why=str(skipped))
        except Exception as error:  # noqa: BLE001 - one trial's failure is not the run's
            warnings.warn(f"NanWatch trial {remedy} failed: {error!r}", stacklevel=2)
            return Trial(
                remedy, "not_tried", setting=variant.setting, why=f"failed: {short(error)}"
            )

    def _steps(self, remedy: str, variant: Variant, replica: Replica) -> Trial:
        episode, losses, signal = self.episode, [], []
        first_rate = replica.rate
        outcome = lambda o, why="": _trial(remedy, o, variant.setting, losses, why)  # noqa: E731
        for step in range(episode.steps):
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
            losses.append(result.loss)
            signal.append(getattr(result, self.judge.signal))
            if not result.finite:
                return outcome("not_fixed", f"non-finite at step {step + 1} of {episode.steps}")
            if self.judge.above_line(signal):
                return outcome(
                    "not_fixed",
                    f"the {self.judge.signal} crossed the explosion line at step {step + 1}",
                )
        return _learning(outcome("fixed"), losses, len(episode.batches))

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
    if os.path.lexists(path) and not os.path.islink(path):
        _check_ours(path, True)  # a symlink is refused below, unread
    relative = f"{BUNDLE_DIR}/{TRIALS_FILE}"
    return run_dir_box.safe_write_bytes(run_dir, relative, text.encode("utf-8"), make_dirs=True)


def _check_ours(path: str, exists: bool) -> None:
    if not exists:
        return
    try:
        with tf.io.gfile.GFile(path, "r") as f:
            previous = json.loads(f.read(1 << 20))
        ours = isinstance(previous, dict) and previous.get("version") == TRIALS_VERSION
    except (ValueError, OSError, tf.errors.OpError):
        ours = False
    if not ours or "trials" not in previous:
        raise ValueError(f"{path} exists and is not a trials file: not replaced")
