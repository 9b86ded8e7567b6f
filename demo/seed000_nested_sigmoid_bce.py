"""Seed 000: a nested base model + Dense(6, sigmoid) + binary cross-entropy, Adam,
under a distribution strategy.

The base model standardizes each image by its own standard deviation (as many
input pipelines do). Batch 37 holds all-zero padding images, the way a TPU input
pipeline pads its last batch: 0 / 0 inside the nested base model.

What NaN Watch shows: first non-finite step 37, phase forward, layer
``base_model/per_image_std`` (a path inside the nested model), kind nan; the
logit extremes and gradient norms of the steps before it are finite.
"""

from __future__ import annotations

try:
    from demo._common import main_with_log_dir, progress_lines
except ImportError:  # run as a script
    from _common import main_with_log_dir, progress_lines

import keras
import numpy as np
import tensorflow as tf

import tb_nanwatch

PAD_STEP = 37
BATCH = 16


@keras.saving.register_keras_serializable("demo")
class PerImageStandardize(keras.layers.Layer):
    """(x - mean) / std per image, without an epsilon."""

    def call(self, x):
        mean = tf.reduce_mean(x, axis=[1, 2, 3], keepdims=True)
        std = tf.math.reduce_std(x, axis=[1, 2, 3], keepdims=True)
        return (x - mean) / std


def build_model() -> keras.Model:
    inp = keras.Input((16, 16, 3))
    h = PerImageStandardize(name="per_image_std")(inp)
    h = keras.layers.Conv2D(8, 3, activation="relu", name="conv1")(h)
    h = keras.layers.Conv2D(8, 3, activation="relu", name="conv2")(h)
    h = keras.layers.GlobalAveragePooling2D(name="pool")(h)
    base = keras.Model(inp, h, name="base_model")
    return keras.Sequential(
        [
            keras.Input((16, 16, 3)),
            base,
            keras.layers.Dense(6, activation="sigmoid", name="labels"),
        ],
        name="seed000",
    )


def run(log_dir: str) -> dict:
    """Trains until the padded batch; returns the incident."""
    keras.utils.set_random_seed(0)
    rng = np.random.RandomState(0)
    steps = 60
    x = rng.uniform(0, 1, (steps * BATCH, 16, 16, 3)).astype("float32")
    x[PAD_STEP * BATCH + 12 :][:4] = 0.0  # four zero-padding images in batch 37
    y = (rng.uniform(size=(steps * BATCH, 6)) > 0.5).astype("float32")
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        model = build_model()
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="binary_crossentropy")
    watch = tb_nanwatch.NanWatch(log_dir)
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=1,
        shuffle=False,
        callbacks=[watch, progress_lines(steps)],
        verbose=0,
    )
    return watch.incident


if __name__ == "__main__":
    main_with_log_dir(run, "demo_logs/seed000_nested_sigmoid_bce")
