"""Deterministic scenarios for the training-setup tests (XLA, steps_per_execution,
tf.distribute, mixed precision, model kinds, custom loops).

Each builder returns ``(model, fit_kwargs, truth)`` like ``scenarios.py``;
``truth`` is derived from how the data was constructed. The origins differ from
the recorder tests' scenarios.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from scenarios import Log

BATCH = 8


@keras.saving.register_keras_serializable("setup_tests")
class Ratio(keras.layers.Layer):
    """numerator[:, :1] / denominator: +inf where the denominator is exactly 0."""

    def call(self, inputs):
        num, den = inputs
        return num[:, :1] / den


@keras.saving.register_keras_serializable("setup_tests")
class RowNorm(keras.layers.Layer):
    """[h, ||h||]: finite at h = 0, its gradient there is NaN."""

    def call(self, h):
        return tf.concat([h, tf.sqrt(tf.reduce_sum(h * h, axis=-1, keepdims=True))], -1)


def ratio_data(zero_step: int = 9, steps: int = 12, zero_row: int = 5, seed: int = 11):
    rng = np.random.RandomState(seed)
    num = rng.uniform(0.5, 1.5, (steps * BATCH, 3)).astype("float32")
    den = rng.uniform(0.5, 1.5, (steps * BATCH, 1)).astype("float32")
    den[zero_step * BATCH + zero_row] = 0.0
    y_main = np.ones((steps * BATCH, 1), "float32")
    y_aux = np.zeros((steps * BATCH, 1), "float32")
    return num, den, y_main, y_aux


def ratio_multi_io(zero_step: int = 9, steps: int = 12, zero_row: int = 5, compile_kwargs=None):
    """Two inputs, two outputs; the denominator input has an exact zero at
    ``zero_step`` (row ``zero_row`` of the batch: the second replica's shard
    when a batch of 8 is split over 2 replicas). ``Ratio`` divides by it."""
    num, den, y_main, y_aux = ratio_data(zero_step, steps, zero_row)
    keras.utils.set_random_seed(11)
    a = keras.Input((3,), name="num")
    b = keras.Input((1,), name="den")
    hidden = keras.layers.Dense(4, activation="tanh", name="hidden")(a)
    ratio = Ratio(name="ratio")([a, b])
    merged = keras.layers.Concatenate(name="merge")([hidden, ratio])
    main = keras.layers.Dense(1, name="main")(merged)
    aux = keras.layers.Dense(1, name="aux")(hidden)
    model = keras.Model({"num": a, "den": b}, {"main": main, "aux": aux}, name="ratio_case")
    model.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss={"main": "mse", "aux": "mse"},
        **(compile_kwargs or {}),
    )
    truth = {"step": zero_step, "phase": "forward", "layer": "ratio", "kind": "inf"}
    fit_kwargs = dict(
        x={"num": num, "den": den},
        y={"main": y_main, "aux": y_aux},
        batch_size=BATCH,
        shuffle=False,
    )
    return model, fit_kwargs, truth


class SubclassedNet(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.pick = keras.layers.Dense(1, kernel_initializer="ones", trainable=False, name="pick")
        self.log = Log(name="log")
        self.head = keras.layers.Dense(1, name="head")

    def call(self, x):
        return self.head(self.log(self.pick(x)))


def falling_sum(nan_step: int, steps: int, features: int = 2, seed: int = 12) -> np.ndarray:
    """Rows whose feature sum falls by 0.2 a batch and is negative from nan_step."""
    rng = np.random.RandomState(seed)
    x = rng.uniform(-0.02, 0.02, (steps * BATCH, features)).astype("float32")
    for step in range(steps):
        x[step * BATCH : (step + 1) * BATCH, 0] += 0.2 * (nan_step - step) - 0.1
    return x


def subclassed(nan_step: int = 4, steps: int = 8):
    """A subclassed model: the frozen ``pick`` sums the features; log of a negative."""
    x = falling_sum(nan_step, steps)
    keras.utils.set_random_seed(12)
    model = SubclassedNet(name="subclassed_case")
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    y = np.zeros((len(x), 1), "float32")
    truth = {"step": nan_step, "phase": "forward", "layer": "log", "kind": "nan"}
    return model, dict(x=x, y=y, batch_size=BATCH, shuffle=False), truth


def recurrent(nan_step: int = 3, steps: int = 6):
    """Embedding-free sequence model: LSTM -> GRU -> Dense; a NaN in the input."""
    rng = np.random.RandomState(13)
    x = rng.uniform(-1, 1, (steps * BATCH, 5, 3)).astype("float32")
    x[nan_step * BATCH + 2, 4, 1] = np.nan
    keras.utils.set_random_seed(13)
    inp = keras.Input((5, 3), name="sequence")
    h = keras.layers.LSTM(4, return_sequences=True, name="lstm")(inp)
    h = keras.layers.GRU(4, name="gru")(h)
    out = keras.layers.Dense(1, name="head")(h)
    model = keras.Model(inp, out, name="recurrent_case")
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    y = np.ones((len(x), 1), "float32")
    truth = {"step": nan_step, "phase": "input", "layer": "sequence", "kind": "nan"}
    return model, dict(x=x, y=y, batch_size=BATCH, shuffle=False), truth


def attention(nan_step: int = 3, steps: int = 6):
    """MultiHeadAttention, then a log of a second input that turns negative."""
    rng = np.random.RandomState(14)
    seq = rng.uniform(-1, 1, (steps * BATCH, 4, 6)).astype("float32")
    scale = np.zeros((steps * BATCH, 1), "float32")
    for step in range(steps):
        scale[step * BATCH : (step + 1) * BATCH] = 0.2 * (nan_step - step) - 0.1
    keras.utils.set_random_seed(14)
    s = keras.Input((4, 6), name="seq")
    c = keras.Input((1,), name="scale")
    att = keras.layers.MultiHeadAttention(2, 3, name="attention")(s, s)
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(att)
    logged = Log(name="log_scale")(c)
    merged = keras.layers.Concatenate(name="merge")([pooled, logged])
    out = keras.layers.Dense(1, name="head")(merged)
    model = keras.Model([s, c], out, name="attention_case")
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    y = np.zeros((steps * BATCH, 1), "float32")
    truth = {"step": nan_step, "phase": "forward", "layer": "log_scale", "kind": "nan"}
    return model, dict(x=[seq, scale], y=y, batch_size=BATCH, shuffle=False), truth


def frozen_norm(zero_step: int = 5, steps: int = 8):
    """A frozen encoder feeding RowNorm; an all-zero input row at zero_step."""
    rng = np.random.RandomState(15)
    x = rng.uniform(0.5, 1.5, (steps * BATCH, 3)).astype("float32")
    x[zero_step * BATCH + 6] = 0.0
    keras.utils.set_random_seed(15)
    inp = keras.Input((3,), name="x")
    h = keras.layers.Dense(3, use_bias=False, trainable=False, name="frozen_encoder")(inp)
    n = RowNorm(name="row_norm")(h)
    out = keras.layers.Dense(1, name="head")(n)
    model = keras.Model(inp, out, name="frozen_case")
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    y = np.ones((len(x), 1), "float32")
    truth = {"step": zero_step, "phase": "backward", "layer": "row_norm", "kind": "nan"}
    return model, dict(x=x, y=y, batch_size=BATCH, shuffle=False), truth


def healthy_small(steps: int = 10):
    rng = np.random.RandomState(16)
    x = rng.normal(size=(steps * BATCH, 4)).astype("float32")
    y = (x @ rng.normal(size=(4, 1))).astype("float32")
    keras.utils.set_random_seed(16)
    inp = keras.Input((4,), name="x")
    h = keras.layers.Dense(8, activation="relu", name="hidden")(inp)
    out = keras.layers.Dense(1, name="head")(h)
    model = keras.Model(inp, out, name="healthy_small")
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model, dict(x=x, y=y, batch_size=BATCH, shuffle=False), None


def mixed_log_negative(nan_step: int = 4, steps: int = 10):
    """Under mixed_float16: log of a negative from nan_step; every later step
    is skipped by the loss scaler (NaN gradients), never applied."""
    x = falling_sum(nan_step, steps, seed=17)
    keras.utils.set_random_seed(17)
    inp = keras.Input((2,), name="x")
    picked = keras.layers.Dense(
        1, kernel_initializer="ones", use_bias=False, trainable=False, name="pick"
    )(inp)
    logged = Log(name="log")(picked)
    # A zero head: every gradient is exactly 0 while the log is finite, so
    # the loss scaler never skips before nan_step.
    out = keras.layers.Dense(1, dtype="float32", kernel_initializer="zeros", name="head")(logged)
    model = keras.Model(inp, out, name="mixed_log_case")
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    y = np.zeros((len(x), 1), "float32")
    truth = {"step": nan_step, "phase": "forward", "layer": "log", "kind": "nan"}
    return model, dict(x=x, y=y, batch_size=BATCH, shuffle=False), truth
