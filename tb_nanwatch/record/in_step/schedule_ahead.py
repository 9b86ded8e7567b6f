"""The learning-rate schedule read ahead over the planned steps, at train begin.

The rates of every planned step come from one call of the optimizer's
``LearningRateSchedule`` on the vector of step numbers (a schedule written
with Python branches is called step by step, at most ``MAX_ONE_BY_ONE``
times); the rule that reads them is
:func:`tb_nanwatch.evidence.early_warnings.schedule_jump`.
"""

from __future__ import annotations

import logging

import keras
import numpy as np

from tb_nanwatch.evidence import early_warnings

logger = logging.getLogger("tb_nanwatch")

MAX_STEPS = 1_000_000
MAX_ONE_BY_ONE = 5_000
WHEN_UNKNOWN = 100_000  # steps read ahead when fit does not know how many it plans


def planned_rates(optimizer, steps: int) -> np.ndarray | None:
    """The rate of each of the next ``steps`` steps (from the optimizer's
    iterations), None when the rate is no schedule or cannot be read."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer's
    schedule = getattr(inner, "_learning_rate", None)
    if not isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule) or steps < 2:
        return None
    start = int(np.asarray(inner.iterations.numpy() if hasattr(inner, "iterations") else 0))
    count = min(int(steps), MAX_STEPS)
    iterations = np.arange(start, start + count, dtype=np.float32)
    try:
        rates = np.asarray(keras.ops.convert_to_numpy(schedule(iterations)), np.float64)
        if rates.shape == (count,):
            return rates
    except Exception:  # noqa: BLE001 - a schedule with Python branches: one by one
        pass
    count = min(count, MAX_ONE_BY_ONE)
    return np.array(
        [float(keras.ops.convert_to_numpy(schedule(step))) for step in range(start, start + count)]
    )


def schedule_warnings(optimizer, steps: int | None) -> list[dict]:
    """``[schedule_jump]`` when the planned rates jump, else []. Never raises."""
    try:
        rates = planned_rates(optimizer, int(steps or 0))
        found = None if rates is None else early_warnings.schedule_jump(rates)
    except Exception as error:  # noqa: BLE001 - the watcher's own failure is a warning
        logger.warning("NanWatch could not read the learning-rate schedule ahead: %r", error)
        return []
    return [found] if found is not None else []


def planned_steps(params: dict | None) -> int:
    """The steps ``fit`` plans (its callbacks' ``params``); ``WHEN_UNKNOWN``
    when it does not know (a dataset of unknown length)."""
    params = params or {}
    steps, epochs = params.get("steps"), params.get("epochs")
    if not isinstance(steps, int) or not isinstance(epochs, int):
        return WHEN_UNKNOWN
    return steps * epochs
