"""A remedy set on the optimizer of a running model (``on_nonfinite="rewind"``).

The remedies whose trial can carry over to a live run change only the
optimizer (:data:`LIVE`): ``lower_lr`` (the rate by the factor its trial
found), ``fix_schedule`` (the rate held at its value before the jump),
``clip_gradients`` (``clipnorm``, as its trial) and ``raise_epsilon``. A
float learning rate is a variable, which the compiled step reads at each
step; a schedule, ``clipnorm`` and ``epsilon`` are read when the step is
traced, so those changes need the step traced again (:attr:`LiveChange.retrace`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable

import keras

from tb_nanwatch.evidence.trials import Trial
from tb_nanwatch.record.after_incident.trial_remedies import CLIPNORM, EPSILON

LIVE = ("lower_lr", "fix_schedule", "clip_gradients", "raise_epsilon")

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


@keras.saving.register_keras_serializable(package="tb_nanwatch")
class ScaledSchedule(_Schedule):
    """A learning-rate schedule times a constant (``lower_lr`` on a schedule)."""

    def __init__(self, schedule: _Schedule, scale: float) -> None:
        self.schedule = schedule
        self.scale = float(scale)

    def __call__(self, step):
        return keras.ops.multiply(self.schedule(step), self.scale)

    def get_config(self) -> dict:
        return {
            "schedule": keras.optimizers.schedules.serialize(self.schedule),
            "scale": self.scale,
        }

    @classmethod
    def from_config(cls, config: dict) -> ScaledSchedule:
        schedule = keras.optimizers.schedules.deserialize(config["schedule"])
        return cls(schedule, config["scale"])


@keras.saving.register_keras_serializable(package="tb_nanwatch")
class HeldRate(_Schedule):
    """A constant learning rate in place of a schedule (``fix_schedule``)."""

    def __init__(self, rate: float) -> None:
        self.rate = float(rate)

    def __call__(self, step):
        return keras.ops.cast(self.rate, "float32")

    def get_config(self) -> dict:
        return {"rate": self.rate}


def plan(remedy: str, trial: Trial, optimizer, cause: dict | None = None) -> LiveChange:
    """The change that sets ``remedy`` (whose trial is ``trial``) on
    ``optimizer`` (a LossScaleOptimizer's inner one); NotLive when it cannot."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if remedy == "lower_lr":
        return _lower_lr(inner, _factor(trial.setting))
    if remedy == "fix_schedule":
        return _held(inner, _rate_before(trial.setting, cause))
    if remedy == "clip_gradients":
        return LiveChange(remedy, f"clipnorm={CLIPNORM}", True, lambda: _clip(inner))
    if remedy == "raise_epsilon":
        if not hasattr(inner, "epsilon"):
            raise NotLive(f"{type(inner).__name__} has no epsilon")
        return LiveChange(
            remedy, f"epsilon={EPSILON:g}", True, lambda: setattr(inner, "epsilon", EPSILON)
        )
    raise NotLive(f"{remedy} changes more than the optimizer")


def _clip(inner) -> None:
    inner.clipnorm = CLIPNORM
    inner.global_clipnorm = None


def _lower_lr(inner, scale: float) -> LiveChange:
    rate = getattr(inner, "_learning_rate", None)
    if isinstance(rate, keras.Variable):
        old = float(rate.numpy())
        new = old * scale

        def assign() -> None:
            inner.learning_rate = new

        return LiveChange("lower_lr", f"lr x{scale:g} ({old:.3g} -> {new:.3g})", False, assign)
    if isinstance(rate, _Schedule):

        def wrap() -> None:
            inner.learning_rate = ScaledSchedule(rate, scale)

        return LiveChange("lower_lr", f"lr x{scale:g} (the schedule scaled)", True, wrap)
    raise NotLive("the learning rate is neither a number nor a LearningRateSchedule")


def _held(inner, held: float) -> LiveChange:
    rate = getattr(inner, "_learning_rate", None)
    setting = f"lr held at {held:.3g}"
    if isinstance(rate, keras.Variable):
        return LiveChange("fix_schedule", setting, False, lambda: rate.assign(held))
    if isinstance(rate, _Schedule) or callable(rate):

        def hold() -> None:
            inner.learning_rate = HeldRate(held)

        return LiveChange("fix_schedule", setting, True, hold)
    raise NotLive("the learning rate is neither a number nor a schedule")


def _factor(setting: str) -> float:
    """The rate's multiplier in a ``lower_lr`` trial's setting (``"lr x0.01"``)."""
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
