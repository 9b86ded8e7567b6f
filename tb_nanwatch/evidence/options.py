"""The watcher's options: each one's single default and its validation.

Both front ends (:class:`~tb_nanwatch.record.callback.NanWatch` and
:class:`~tb_nanwatch.record.custom_loop.StepWatcher`) build a
:class:`WatchOptions` from their keyword arguments (whose defaults are this
class's); the journal and the incident rules read it. Pure Python: no
TensorFlow, so the synthetic runs and the tests build it too.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

ON_NONFINITE = ("stop", "raise", "continue", "skip", "rewind")
# The modes that undo a non-finite step inside the compiled step (see record/after_incident/recovery.py).
RECOVERING = ("skip", "rewind")
# Which weights the reproduction bundle holds (see NanWatch's docstring).
PRE_STEP_WEIGHTS = ("every_step", "on_suspect", "off")
# The largest flight-recorder window: the journal keeps ``window`` full stats
# vectors in memory (a few MB each for a large model at the bound).
MAX_WINDOW = 100_000
# Remedy trials and rewind points (see record/after_incident/rewind_points.py and record/after_incident/trials.py).
DEFAULT_REWIND_EVERY = 50


def positive_int(name: str, value, allow_zero: bool = False, maximum: int | None = None) -> int:
    """``value`` if it is an int >= 1 (>= 0 with ``allow_zero``) and at most
    ``maximum``, else a ValueError naming ``name``. A bool is not an int here."""
    low = 0 if allow_zero else 1
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, np.integer))
        or value < low
        or (maximum is not None and value > maximum)
    ):
        bound = f">= {low}" if maximum is None else f"in [{low}, {maximum}]"
        raise ValueError(f"{name} must be an int {bound}, got {value!r}")
    return int(value)


def finite_number(name: str, value, low: float, low_inclusive: bool = True) -> float:
    """``value`` if it is a finite real number above ``low`` (or equal with
    ``low_inclusive``), else a ValueError naming ``name``. A bool is not a number here."""
    is_number = isinstance(value, (int, float, np.integer, np.floating))
    if isinstance(value, bool) or not is_number or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < low or (value == low and not low_inclusive):
        bound = f">= {low:g}" if low_inclusive else f"> {low:g}"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    return float(value)


def a_bool(name: str, value) -> bool:
    """``value`` if it is a bool, else a ValueError naming ``name``."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def one_of(name: str, value, allowed: tuple[str, ...]) -> str:
    """``value`` if it is one of ``allowed``, else a ValueError naming ``name``."""
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class WatchOptions:
    """The options NanWatch and StepWatcher share (documented on NanWatch).

    Every field is checked at construction (a ValueError naming it) and
    normalised (an ``np.int64`` window becomes an int, ``min_loss_scale=0``
    a float). A field's default here is its only default: the front ends'
    keyword defaults read it (``WatchOptions.window``).
    """

    on_nonfinite: str = "stop"
    window: int = 32
    max_consecutive_skips: int = 20
    min_loss_scale: float = 1.0
    snapshot_every: int = 1000
    flush_secs: float = 10.0
    pre_step_weights: str = "on_suspect"
    explosion_factor: float = 1e3
    rewind_every: int = DEFAULT_REWIND_EVERY
    rewind_memory_mb: float = 2048.0
    rewind_disk_mb: float = 8192.0
    remedy_trials: bool = True
    trial_budget_s: float = 120.0
    max_skips: int = 10
    max_rewinds: int = 3

    def __post_init__(self) -> None:
        checked = {
            "on_nonfinite": one_of("on_nonfinite", self.on_nonfinite, ON_NONFINITE),
            "pre_step_weights": one_of("pre_step_weights", self.pre_step_weights, PRE_STEP_WEIGHTS),
            "window": positive_int("window", self.window, maximum=MAX_WINDOW),
            "max_consecutive_skips": positive_int(
                "max_consecutive_skips", self.max_consecutive_skips, allow_zero=True
            ),
            "snapshot_every": positive_int("snapshot_every", self.snapshot_every, allow_zero=True),
            "flush_secs": finite_number("flush_secs", self.flush_secs, 0.0, low_inclusive=False),
            "explosion_factor": finite_number(
                "explosion_factor", self.explosion_factor, 10.0, low_inclusive=False
            ),
            "min_loss_scale": finite_number("min_loss_scale", self.min_loss_scale, 0.0),
            "rewind_every": positive_int("rewind_every", self.rewind_every, allow_zero=True),
            "rewind_memory_mb": finite_number("rewind_memory_mb", self.rewind_memory_mb, 0.0),
            "rewind_disk_mb": finite_number("rewind_disk_mb", self.rewind_disk_mb, 0.0),
            "remedy_trials": a_bool("remedy_trials", self.remedy_trials),
            "trial_budget_s": finite_number(
                "trial_budget_s", self.trial_budget_s, 0.0, low_inclusive=False
            ),
            "max_skips": positive_int("max_skips", self.max_skips, allow_zero=True),
            "max_rewinds": positive_int("max_rewinds", self.max_rewinds, allow_zero=True),
        }
        if self.on_nonfinite in RECOVERING and self.pre_step_weights == "off":
            raise ValueError(
                f"on_nonfinite={self.on_nonfinite!r} needs the weights from before a step: "
                "pre_step_weights must be 'on_suspect' or 'every_step', got 'off'"
            )
        for name, value in checked.items():
            object.__setattr__(self, name, value)  # frozen: normalised once, here

    @property
    def recovers(self) -> bool:
        """Whether a non-finite step is undone in the compiled step ("skip", "rewind")."""
        return self.on_nonfinite in RECOVERING

    @classmethod
    def from_arguments(cls, arguments: dict[str, Any]) -> WatchOptions:
        """The options among a front end's constructor arguments (same names)."""
        return cls(**{f.name: arguments[f.name] for f in dataclasses.fields(cls)})
