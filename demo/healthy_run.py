"""A healthy run to compare against: same kind of model, nothing goes wrong."""

from __future__ import annotations

try:
    from demo._common import main_with_log_dir, progress_lines
except ImportError:
    from _common import main_with_log_dir, progress_lines

import keras
import numpy as np

import tb_nanwatch

STEPS = 200
BATCH = 16


def run(log_dir: str) -> dict | None:
    """Trains a small classifier for STEPS steps; returns the (absent) incident."""
    keras.utils.set_random_seed(4)
    rng = np.random.RandomState(4)
    x = rng.normal(size=(STEPS * BATCH, 12)).astype("float32")
    y = (x[:, :6] > 0).astype("float32")
    model = keras.Sequential(
        [
            keras.Input((12,)),
            keras.layers.Dense(32, activation="relu", name="hidden1"),
            keras.layers.Dense(32, activation="relu", name="hidden2"),
            keras.layers.Dense(6, activation="sigmoid", name="labels"),
        ],
        name="healthy",
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="binary_crossentropy")
    watch = tb_nanwatch.NanWatch(log_dir)
    model.fit(x, y, batch_size=BATCH, epochs=1, callbacks=[watch, progress_lines(STEPS)], verbose=0)
    return watch.incident


if __name__ == "__main__":
    main_with_log_dir(run, "demo_logs/healthy")
