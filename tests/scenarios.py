"""Small deterministic training scenarios with a known first non-finite step.

Each builder returns ``(model, fit_kwargs, truth)``: ``truth`` is what the
diagnosis must say, derived from how the data or model was constructed.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

BATCH = 8


@keras.saving.register_keras_serializable("tests")
class Log(keras.layers.Layer):
    def call(self, x):
        return tf.math.log(x)


@keras.saving.register_keras_serializable("tests")
class Norm(keras.layers.Layer):
    """L2 norm of each row: sqrt(sum x^2); its gradient at an all-zero row is NaN."""

    def call(self, x):
        return tf.sqrt(tf.reduce_sum(x * x, axis=-1, keepdims=True))


def _rows(steps: int, features: int, seed: int = 0) -> np.ndarray:
    return (
        np.random.RandomState(seed).uniform(0.5, 1.5, (steps * BATCH, features)).astype("float32")
    )


def forward_log_negative(nan_step: int = 6, steps: int = 12):
    """The input's first feature falls by 0.1 a batch; ``log`` sees a negative at nan_step."""
    x = _rows(steps, 3)
    for step in range(steps):
        x[step * BATCH : (step + 1) * BATCH, 0] = 0.55 - 0.1 * step + 0.01 * (nan_step - 5.5)
    assert (x[nan_step * BATCH :, 0] < 0).all() and (x[: nan_step * BATCH, 0] > 0).all()
    inp = keras.Input((3,), name="features")
    first = keras.layers.Lambda(lambda t: t[:, :1], name="pick")(inp)
    logged = Log(name="log")(first)
    h = keras.layers.Concatenate(name="concat")([logged, inp])
    out = keras.layers.Dense(1, name="head")(h)
    model = keras.Model(inp, out, name="forward_case")
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    y = np.zeros((len(x), 1), "float32")
    truth = {"step": nan_step, "phase": "forward", "layer": "log", "kind": "nan"}
    return model, dict(x=x, y=y, batch_size=BATCH, shuffle=False), truth


def input_nan(nan_step: int = 7, steps: int = 12):
    x = _rows(steps, 4, seed=1)
    x[nan_step * BATCH + 3, 2] = np.nan
    inp = keras.Input((4,), name="pixels")
    h = keras.layers.Dense(6, activation="relu", name="hidden")(inp)
    out = keras.layers.Dense(1, name="head")(h)
    model = keras.Model(inp, out, name="input_case")
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    y = np.ones((len(x), 1), "float32")
    truth = {"step": nan_step, "phase": "input", "layer": "pixels", "kind": "nan"}
    return model, dict(x=x, y=y, batch_size=BATCH, shuffle=False), truth


def softmax_log_loss(y_true, logits):
    """A hand-written cross-entropy: softmax, then -log(p[true class]), no epsilon."""
    shifted = logits - tf.reduce_max(logits, axis=-1, keepdims=True)
    probs = tf.exp(shifted) / tf.reduce_sum(tf.exp(shifted), axis=-1, keepdims=True)
    return -tf.math.log(tf.reduce_sum(y_true * probs, axis=-1))


def loss_log_zero(outlier_step: int = 5, steps: int = 10):
    """An outlier batch (inputs x 1e4) makes a true-class probability exactly 0."""
    rng = np.random.RandomState(2)
    x = rng.uniform(-1, 1, (steps * BATCH, 4)).astype("float32")
    x[outlier_step * BATCH : (outlier_step + 1) * BATCH] *= 1e4
    labels = rng.randint(0, 3, steps * BATCH)
    y = np.eye(3, dtype="float32")[labels]
    inp = keras.Input((4,), name="x")
    h = keras.layers.Dense(8, activation="tanh", name="hidden")(inp)
    h = keras.layers.Dense(8, name="proj")(inp)
    out = keras.layers.Dense(3, name="logits")(h)
    model = keras.Model(inp, out, name="loss_case")
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss=softmax_log_loss)
    truth = {"step": outlier_step, "phase": "loss", "layer": None, "kind": "inf"}
    return model, dict(x=x, y=y, batch_size=BATCH, shuffle=False), truth


def backward_sqrt_zero(zero_step: int = 4, steps: int = 10):
    """An all-zero row reaches ``Norm``: sqrt(0) is finite, its gradient is not."""
    x = _rows(steps, 3, seed=3)
    x[zero_step * BATCH + 1] = 0.0
    inp = keras.Input((3,), name="x")
    h = keras.layers.Dense(4, use_bias=False, name="encode")(inp)
    n = Norm(name="norm")(h)
    out = keras.layers.Dense(1, name="head")(n)
    model = keras.Model(inp, out, name="backward_case")
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    y = np.ones((len(x), 1), "float32")
    truth = {"step": zero_step, "phase": "backward", "layer": "norm", "kind": "nan"}
    return model, dict(x=x, y=y, batch_size=BATCH, shuffle=False), truth


def update_adam_eps0(steps: int = 6):
    """A ReLU head that never fires has exactly-zero gradients; Adam(eps=0) makes 0/0."""
    x = _rows(steps, 3, seed=4)
    inp = keras.Input((3,), name="x")
    live = keras.layers.Dense(1, name="live")(inp)
    dead = keras.layers.Dense(
        1,
        activation="relu",
        kernel_initializer="zeros",
        bias_initializer=keras.initializers.Constant(-1.0),
        name="dead_head",
    )(inp)
    out = keras.layers.Add(name="sum")([live, dead])
    model = keras.Model(inp, out, name="update_case")
    model.compile(optimizer=keras.optimizers.Adam(0.01, epsilon=0.0), loss="mse")
    y = np.ones((len(x), 1), "float32")
    truth = {"step": 0, "phase": "update", "layer": "dead_head", "kind": "nan"}
    return model, dict(x=x, y=y, batch_size=BATCH, shuffle=False), truth


def nested_model(nan_step: int = 3, steps: int = 8):
    x = _rows(steps, 2, seed=5)
    for step in range(steps):
        x[step * BATCH : (step + 1) * BATCH, 1] = 0.25 - 0.1 * step
    backbone = keras.Sequential(
        [
            keras.Input((2,)),
            keras.layers.Dense(
                2, kernel_initializer="identity", trainable=False, name="block1_dense"
            ),
            Log(name="block2_log"),
        ],
        name="backbone",
    )
    model = keras.Sequential(
        [keras.Input((2,)), backbone, keras.layers.Dense(1, name="head")], name="nested_case"
    )
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    y = np.zeros((len(x), 1), "float32")
    truth = {"step": nan_step, "phase": "forward", "layer": "backbone/block2_log", "kind": "nan"}
    return model, dict(x=x, y=y, batch_size=BATCH, shuffle=False), truth


def mlp(seed: int = 0, depth: int = 3, width: int = 16, features: int = 8):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((features,), name="x")
    h = inp
    for i in range(depth):
        h = keras.layers.Dense(width, activation="relu", name=f"dense_{i}")(h)
    out = keras.layers.Dense(1, name="head")(h)
    return keras.Model(inp, out, name="mlp")


def healthy(steps: int = 60):
    rng = np.random.RandomState(6)
    x = rng.normal(size=(steps * BATCH, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1))).astype("float32")
    model = mlp()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    return model, dict(x=x, y=y, batch_size=BATCH, shuffle=False), None


def exploding(jump_step: int = 40, steps: int = 70):
    """Linear regression whose learning rate jumps far past stability at jump_step."""
    rng = np.random.RandomState(7)
    x = rng.normal(size=(steps * BATCH, 4)).astype("float32")
    y = (x @ rng.normal(size=(4, 1))).astype("float32")
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, name="linear")])
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([jump_step], [0.01, 1.6])
    model.compile(optimizer=keras.optimizers.SGD(schedule), loss="mse")
    return model, dict(x=x, y=y, batch_size=BATCH, shuffle=False), {"jump_step": jump_step}


def mixed_precision_skips(steps: int = 40):
    """Gradients of ~1e3 overflow float16 at the initial loss scale 2^15: early skips."""
    rng = np.random.RandomState(8)
    x = (rng.normal(size=(steps * BATCH, 4)) * 30).astype("float32")
    y = (x @ rng.normal(size=(4, 1))).astype("float32")
    keras.utils.set_random_seed(8)
    inp = keras.Input((4,), name="x")
    h = keras.layers.Dense(8, name="hidden")(inp)
    out = keras.layers.Dense(1, dtype="float32", name="head")(h)
    model = keras.Model(inp, out, name="mixed_case")
    model.compile(optimizer=keras.optimizers.SGD(1e-5), loss="mse")
    return model, dict(x=x, y=y, batch_size=BATCH, shuffle=False), None


def backward_fan_out(zero_step: int = 3, steps: int = 8):
    """``encode``'s output feeds both ``norm`` and ``concat``; ``norm`` runs first.

    The NaN is born in norm's backward pass (sqrt at an all-zero row); the
    gradient of the shared tensor is the sum of both consumers' shares, so
    only per-consumer input gradients can tell ``norm`` from ``concat``.
    """
    x = _rows(steps, 3, seed=9)
    x[zero_step * BATCH + 2] = 0.0
    inp = keras.Input((3,), name="x")
    h = keras.layers.Dense(4, use_bias=False, name="encode")(inp)
    n = Norm(name="norm")(h)
    c = keras.layers.Concatenate(name="concat")([h, n])
    out = keras.layers.Dense(1, name="head")(c)
    model = keras.Model(inp, out, name="fan_out_case")
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    y = np.ones((len(x), 1), "float32")
    truth = {"step": zero_step, "phase": "backward", "layer": "norm", "kind": "nan"}
    return model, dict(x=x, y=y, batch_size=BATCH, shuffle=False), truth
