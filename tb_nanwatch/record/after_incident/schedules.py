"""The learning-rate schedules a live remedy sets (``live_remedies.py``).

Registered with Keras (package ``tb_nanwatch``): a model saved after a rewind
(its reproduction bundle's ``model.keras``, the recorded optimizer config the
trials rebuild) names them, and Keras finds them by their registered name
(``tb_nanwatch>ScaledSchedule``), whatever module the saved config names
(run dirs written before this module held them name
``tb_nanwatch.record.live_remedies`` or
``tb_nanwatch.record.after_incident.live_remedies``). Whatever loads or
rebuilds a recorded model or optimizer imports this module first.
"""

from __future__ import annotations

import keras

LearningRateSchedule = keras.optimizers.schedules.LearningRateSchedule


@keras.saving.register_keras_serializable(package="tb_nanwatch")
class ScaledSchedule(LearningRateSchedule):
    """A learning-rate schedule times a constant (a rate scaled on a schedule)."""

    def __init__(self, schedule: LearningRateSchedule, scale: float) -> None:
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
class HeldRate(LearningRateSchedule):
    """A constant learning rate in place of a schedule (a rate held)."""

    def __init__(self, rate: float) -> None:
        self.rate = float(rate)

    def __call__(self, step):
        return keras.ops.cast(self.rate, "float32")

    def get_config(self) -> dict:
        return {"rate": self.rate}
