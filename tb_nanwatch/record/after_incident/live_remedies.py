"""A remedy set on the optimizer of a running model (``on_nonfinite="rewind"``).

A remedy whose catalogue entry says ``live`` has its trial's change set on the
running optimizer (a LossScaleOptimizer's inner one). This module reads the
kind of the change (:mod:`tb_nanwatch.evidence.changes`), never the remedy's
id; the kinds a live run can take change only the optimizer:

* :class:`~tb_nanwatch.evidence.changes.ScaleRate`: the rate times the factor
  its trial found (a schedule wrapped in a :class:`ScaledSchedule`);
* :class:`~tb_nanwatch.evidence.changes.HoldRate`: the rate held at its value
  before the jump (a schedule replaced by a :class:`HeldRate`);
* :class:`~tb_nanwatch.evidence.changes.OptimizerSettings`: the settings
  (``clipnorm``, ``epsilon``), as in its trial.

A float learning rate is a variable, which the compiled step reads at each
step; a schedule, ``clipnorm`` and ``epsilon`` are read when the step is
traced, so those changes need the step traced again (:attr:`LiveChange.retrace`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable

import keras

from tb_nanwatch.evidence import changes, remedies
from tb_nanwatch.evidence.trials import Trial
from tb_nanwatch.record.after_incident.schedules import HeldRate, ScaledSchedule
from tb_nanwatch.record.after_incident.trial_replica import inner_optimizer

_Schedule = keras.optimizers.schedules.LearningRateSchedule


class NotLive(Exception):
    """The remedy cannot be set on this run's optimizer; the message says why."""


@dataclasses.dataclass(frozen=True)
class LiveChange:
    """A remedy ready to set: ``apply()`` changes the optimizer; ``retrace``:
    the compiled step must be traced again to use it."""

    remedy: str
    setting: str
    retrace: bool
    apply: Callable[[], None]


def can_set(change: object) -> bool:
    """Whether a running optimizer can take ``change``'s kind."""
    return type(change) in _SETTERS


def is_live(remedy: str) -> bool:
    """Whether ``remedy``'s catalogue entry says a live run can take its trial's change."""
    entry = remedies.CATALOGUE.get(remedy)
    return entry is not None and entry.live and can_set(entry.trial)


def plan(remedy: str, trial: Trial, optimizer, cause: dict | None = None) -> LiveChange:
    """The change that sets ``remedy`` (whose trial is ``trial``) on
    ``optimizer`` (a LossScaleOptimizer's inner one); NotLive when it cannot."""
    if not is_live(remedy):
        raise NotLive(f"{remedy} changes more than the optimizer")
    change = remedies.CATALOGUE[remedy].trial
    inner = inner_optimizer(optimizer)
    return _SETTERS[type(change)](remedy, change, trial, inner, cause)


# -- each kind of change ---------------------------------------------------------------


def _settings(
    remedy: str, change: changes.OptimizerSettings, trial: Trial, inner, cause: dict | None
) -> LiveChange:
    for name, value in change.settings:
        if value is not None and not hasattr(inner, name):
            raise NotLive(f"{type(inner).__name__} has no {name}")

    def apply() -> None:
        for name, value in change.settings:
            setattr(inner, name, value)

    return LiveChange(remedy, change.words, True, apply)


def _scaled(
    remedy: str, change: changes.ScaleRate, trial: Trial, inner, cause: dict | None
) -> LiveChange:
    scale = _factor(trial.setting)
    rate = getattr(inner, "_learning_rate", None)
    if isinstance(rate, keras.Variable):
        old = float(rate.numpy())
        new = old * scale

        def assign() -> None:
            inner.learning_rate = new

        return LiveChange(remedy, f"lr x{scale:g} ({old:.3g} -> {new:.3g})", False, assign)
    if isinstance(rate, _Schedule):

        def wrap() -> None:
            inner.learning_rate = ScaledSchedule(rate, scale)

        return LiveChange(remedy, f"lr x{scale:g} (the schedule scaled)", True, wrap)
    raise NotLive("the learning rate is neither a number nor a LearningRateSchedule")


def _held(
    remedy: str, change: changes.HoldRate, trial: Trial, inner, cause: dict | None
) -> LiveChange:
    held = _rate_before(trial.setting, cause)
    rate = getattr(inner, "_learning_rate", None)
    setting = f"lr held at {held:.3g}"
    if isinstance(rate, keras.Variable):
        return LiveChange(remedy, setting, False, lambda: rate.assign(held))
    if isinstance(rate, _Schedule) or callable(rate):

        def hold() -> None:
            inner.learning_rate = HeldRate(held)

        return LiveChange(remedy, setting, True, hold)
    raise NotLive("the learning rate is neither a number nor a schedule")


def _factor(setting: str) -> float:
    """The rate's multiplier in a rate-scaling trial's setting (``"lr x0.01"``)."""
    found = re.search(r"lr x([0-9.eE+-]+)", setting or "")
    scale = float(found.group(1)) if found else math.nan
    if not (0 < scale < 1):
        raise NotLive(f"the factor of its trial is not known ({setting!r})")
    return scale


def _rate_before(setting: str, cause: dict | None) -> float:
    """The rate before the jump: the cause's evidence, else the trial's setting."""
    before = ((cause or {}).get("evidence") or {}).get("lr_before")
    if isinstance(before, (int, float)) and not isinstance(before, bool) and before > 0:
        return float(before)
    found = re.search(r"held at ([0-9.eE+-]+)", setting or "")
    if found is None:
        raise NotLive(f"the rate before the jump is not known ({setting!r})")
    return float(found.group(1))


# The setter of each kind of change a running optimizer can take.
_SETTERS: dict[type, Callable[..., LiveChange]] = {
    changes.OptimizerSettings: _settings,
    changes.ScaleRate: _scaled,
    changes.HoldRate: _held,
}
