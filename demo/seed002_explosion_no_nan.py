"""Seed 002: the loss climbs by orders of magnitude and never turns NaN.

A regression whose learning rate is raised past stability at step 60 (standing
in for a backend whose numerics differ). Training stops before float32
overflows, so there is no non-finite value at all.

What NaN Watch shows: no incident; an explosion onset near step 60 and the
signal (loss, gradient norm or logits) that moved first.
"""

from __future__ import annotations

try:
    from demo._common import main_with_log_dir, progress_lines
except ImportError:
    from _common import main_with_log_dir, progress_lines

import keras
import numpy as np

import tb_nanwatch

JUMP_STEP = 60


def run(log_dir: str) -> dict | None:
    """Trains through the learning-rate jump; returns the incident (None: nothing is non-finite)."""
    keras.utils.set_random_seed(2)
    rng = np.random.RandomState(2)
    steps = 200
    x = rng.normal(size=(steps * 16, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1))).astype("float32")
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, name="hidden"),
            keras.layers.Dense(1, name="out"),
        ],
        name="seed002",
    )
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([JUMP_STEP], [0.01, 0.2])
    model.compile(optimizer=keras.optimizers.SGD(schedule), loss="mse")
    watch = tb_nanwatch.NanWatch(log_dir)
    # The user gives up once the running-mean loss passes 1e12, before float32 overflows.
    give_up = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: setattr(
            model, "stop_training", model.stop_training or logs["loss"] > 1e12
        )
    )
    model.fit(
        x,
        y,
        batch_size=16,
        epochs=1,
        shuffle=False,
        callbacks=[watch, give_up, progress_lines(steps)],
        verbose=0,
    )
    return watch.incident


if __name__ == "__main__":
    main_with_log_dir(run, "demo_logs/seed002_explosion_no_nan")
