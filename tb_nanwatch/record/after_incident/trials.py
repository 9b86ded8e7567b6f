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
so. What a trial re-runs (from the bundle or the rewind point) is decided in
:mod:`~tb_nanwatch.record.after_incident.trial_episodes`; the outcomes go to
``repro/trials.json`` (:mod:`~tb_nanwatch.record.after_incident.trials_file`).

**Fidelity before verdicts.** The run without a remedy goes first (the
baseline) and must reproduce the recorded run
(:mod:`~tb_nanwatch.record.after_incident.fidelity`); when it does not,
every remedy is ``cannot_verify``, never "did not help". A bundle holds the
trainable weights alone (not the dropout seed states nor BatchNorm's
statistics of its step): when its re-run does not reproduce the step, the
episode from the rewind point (every variable) is tried instead. Without
recorded losses (a direct call) the check is not made and ``fidelity`` says
so.

Outcome: ``fixed`` when the loss and every weight stayed finite
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
import logging
import math
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tb_nanwatch.evidence import remedies
from tb_nanwatch.evidence import trials as evidence_trials
from tb_nanwatch.evidence.options import WatchOptions
from tb_nanwatch.evidence.printable import printable
from tb_nanwatch.evidence.trials import Trial
from tb_nanwatch.record.after_incident import fidelity, trial_remedies
from tb_nanwatch.record.after_incident import schedules as _schedules  # noqa: F401 - registers
from tb_nanwatch.record.after_incident.console import CONSOLE
from tb_nanwatch.record.after_incident.trial_episodes import (
    Episode,
    TrialData,
    finite_number,
    optimizer_object,
    plan,
)
from tb_nanwatch.record.after_incident.trial_replica import (
    COPY_NOTE,
    Replica,
    TrainedState,
    TrialSkipped,
    Variant,
    output_units,
    short,
)

REFERENCE_STEPS = 5
# A growth trial fails when its loss reaches this share of the highest loss
# the recorded run reached over the span (when the recorded run exploded).
LEVEL_SHARE = 0.5
# A trial is "learning" when its loss fell by at least this fraction.
LEARNING_DROP = 0.05
# The most the trials' budget grows for slow steps, x trial_budget_s.
MAX_BUDGET_SCALE = 4.0
# The explosion signals a trial can follow (others: the loss).
_SIGNALS = ("loss", "grad_norm", "logits")

Progress = Callable[[str], None]


class TrialList(list):
    """The trials (``list[Trial]``, in the order the cause offered the
    remedies) plus ``baseline`` (the run without a remedy) and ``plan`` (what
    was re-run, in words)."""

    baseline: Trial | None = None
    plan: str = ""
    fidelity: str = ""  # whether the re-run reproduced the recorded run, in words
    compiled: str = ""  # how the re-runs' steps ran: "xla", "graph", "graph (why not XLA)"


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
    optimizer = optimizer_object(model, data)
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
            for number, remedy in enumerate(ids, 1):
                for done in runner.tried(remedy, cause, trials.baseline):
                    trials.append(done)
                    text = evidence_trials.trial_text(done)
                    say(f"NanWatch trial {number}/{len(ids)}: {done.remedy}: {text}")
            trials.compiled = ", ".join(sorted(runner.compiled))  # every re-run's, remedies' too
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
            losses = self._losses  # attempt() binds a new list: the probe leaves this one
            found = self.compare(losses, recorded)
            if found.diverged and found.first_step_matched:
                found = self.compare(losses, recorded, self._rounding_spread(losses))
            self.fidelity = found.line
            if found.diverged:
                result = dataclasses.replace(result, outcome="cannot_verify", why=found.why)
        text = evidence_trials.trial_text(result)
        fidelity = f"; {self.fidelity}" if self.fidelity else ""
        say(f"NanWatch trials: {self.episode.description}; as recorded: {text}{fidelity}")
        self.baseline_trial = result
        return result

    def _rounding_spread(self, losses: list[float]) -> list[float]:
        """How far rounding alone carries the re-run: at each of its first
        steps, |loss - loss of the re-run whose start was nudged by
        fidelity.ROUNDING_NUDGE| (an adaptive optimizer's first updates amplify a
        rounding difference, such as the one the recorded step's statistics
        make, by orders of magnitude). [] when the probe could not run."""
        probe = self.attempt(
            "none",
            Variant(setting="nudged", start_noise=fidelity.ROUNDING_NUDGE),
            limit=fidelity.REPRODUCE_STEPS,
        )
        if probe.outcome == "not_tried":
            return []
        return [abs(a - b) for a, b in zip(self._losses, losses, strict=False)]

    def compare(
        self, losses: list[float], recorded: dict[int, float] | None, spread=None
    ) -> fidelity.Fidelity:
        """Whether the no-remedy re-run's ``losses`` reproduced the recorded run
        (:func:`~tb_nanwatch.record.after_incident.fidelity.compare`)."""
        first, span = self.episode.first_step, self.episode.span
        return fidelity.compare(losses, recorded, first, span, spread)

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
        rate_before = float(before) if finite_number(before) else _rate_before_jump(episode.rates)
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
