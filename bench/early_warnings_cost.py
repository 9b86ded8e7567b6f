"""What the early warnings cost, beside the step time they ride on.

    python bench/early_warnings_cost.py          # ~30 s on 2 CPUs

* ``observe_us``: one step of :class:`tb_nanwatch.evidence.warning_watch.EarlyWarnings`
  (the forecasts' host arithmetic, on the journal's worker thread, off the
  training thread) for schemas of 4, 50 and 200 layers, median of 2000 steps;
* ``schedule_ms``: the learning-rate schedule read ahead at train begin over
  100,000 and 1,000,000 steps (``CosineDecayRestarts``, one vectorized call);
* ``step_ms``: the median step of a small MLP under ``fit`` with NanWatch, for scale.

Prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tb_nanwatch import NanWatch  # noqa: E402
from tb_nanwatch.evidence.warning_watch import EarlyWarnings  # noqa: E402
from tb_nanwatch.record.in_step.schedule_ahead import planned_rates  # noqa: E402
from tb_nanwatch.record.writing.synthetic import build_schema  # noqa: E402


def observe_us(layers: int, steps: int = 2000) -> float:
    schema = build_schema(layers)
    watch = EarlyWarnings(schema, {"dtype_policy": "float32"})
    vectors = np.random.default_rng(0).random((steps, schema.size)).astype(np.float32) + 0.5
    times = []
    for step, vector in enumerate(vectors):
        start = time.perf_counter()
        watch.observe(step, vector)
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e6)


def schedule_ms(steps: int) -> float:
    schedule = keras.optimizers.schedules.CosineDecayRestarts(0.1, 1000)
    optimizer = keras.optimizers.SGD(schedule)
    start = time.perf_counter()
    planned_rates(optimizer, steps)
    return (time.perf_counter() - start) * 1e3


class _StepTimes(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_begin(self, batch, logs=None) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None) -> None:
        self.times.append(time.perf_counter() - self._start)


def step_ms(steps: int = 400) -> float:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * 32, 32)).astype("float32")
    y = rng.normal(size=(steps * 32, 1)).astype("float32")
    model = keras.Sequential(
        [keras.Input((32,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(1)]
    )
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    timer = _StepTimes()
    with tempfile.TemporaryDirectory() as log_dir:
        model.fit(x, y, batch_size=32, callbacks=[NanWatch(log_dir), timer], verbose=0)
    return float(np.median(timer.times[20:]) * 1e3)


def main() -> None:
    result = {
        "observe_us": {layers: round(observe_us(layers), 1) for layers in (4, 50, 200)},
        "schedule_ms": {steps: round(schedule_ms(steps), 1) for steps in (100_000, 1_000_000)},
        "step_ms": round(step_ms(), 3),
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
