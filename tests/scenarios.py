"""The training scenarios of the write-side tests, and the helpers that run them.

Each builder returns ``(model, fit_kwargs, truth)``: ``truth`` is what the
diagnosis must say (step, phase, layer, kind), derived from how the data or
model was constructed. The first group are origin cases of each phase; the
second the setups users run (multi-I/O, subclassed, RNN, attention, frozen
layers, mixed precision). :func:`fit` trains a scenario under ``fit`` with a
``NanWatch``; :func:`train_custom_loop` trains ``ratio_multi_io``'s model
with a hand-written loop and a ``StepWatcher``.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from nanwatch_testlib import TRIAL_BUDGET_S

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


def dead_relu_head(inputs):
    """A Dense(1) ReLU head named ``dead_head`` that never fires (zero kernel, bias
    -1): its gradients are exactly 0."""
    return keras.layers.Dense(
        1,
        activation="relu",
        kernel_initializer="zeros",
        bias_initializer=keras.initializers.Constant(-1.0),
        name="dead_head",
    )(inputs)


def update_adam_eps0(steps: int = 6):
    """A ReLU head that never fires has exactly-zero gradients; Adam(eps=0) makes 0/0."""
    x = _rows(steps, 3, seed=4)
    inp = keras.Input((3,), name="x")
    live = keras.layers.Dense(1, name="live")(inp)
    dead = dead_relu_head(inp)
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


# The origin cases of each phase (and a nested model, a fan-out).
ORIGIN_CASES = [
    forward_log_negative,
    input_nan,
    loss_log_zero,
    backward_sqrt_zero,
    update_adam_eps0,
    nested_model,
    backward_fan_out,
]


# -- the setups users run ---------------------------------------------------------


@keras.saving.register_keras_serializable("tests")
class Ratio(keras.layers.Layer):
    """numerator[:, :1] / denominator: +inf where the denominator is exactly 0."""

    def call(self, inputs):
        num, den = inputs
        return num[:, :1] / den


@keras.saving.register_keras_serializable("tests")
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


# -- running a scenario --------------------------------------------------------------


def fit(build, log_dir, epochs=1, compile_kwargs=None, **watch_kwargs):
    """Trains ``build()``'s model with ``fit`` and a ``NanWatch(log_dir, **watch_kwargs)``.

    ``compile_kwargs`` recompiles the model with them (``jit_compile``,
    ``steps_per_execution``). Returns ``(model, watch, truth, history)``.
    """
    import tb_nanwatch

    keras.utils.set_random_seed(0)
    model, kwargs, truth = build()
    if compile_kwargs:
        model.compile(optimizer=model.optimizer, loss=model.loss, **compile_kwargs)
    watch_kwargs.setdefault("trial_budget_s", TRIAL_BUDGET_S)
    watch = tb_nanwatch.NanWatch(str(log_dir), **watch_kwargs)
    history = model.fit(**kwargs, epochs=epochs, callbacks=[watch], verbose=0)
    return model, watch, truth, history


def origin(incident):
    """The incident's step, phase, layer and kind (what a scenario's truth names)."""
    assert incident is not None
    return {k: incident[k] for k in ("step", "phase", "layer", "kind")}


def train_custom_loop(build, log_dir, jit_compile=False, **watch_kwargs):
    """Trains ``build``'s two-output model (``ratio_multi_io``) with a
    hand-written loop and a StepWatcher; returns ``(watcher, truth)``."""
    import tb_nanwatch

    model, kwargs, truth = build()
    optimizer = keras.optimizers.SGD(0.01)
    loss_fn = keras.losses.MeanSquaredError()
    watcher = tb_nanwatch.StepWatcher(str(log_dir), model, optimizer, **watch_kwargs)

    @tf.function(jit_compile=jit_compile)
    def train_step(x, y):
        with tf.GradientTape() as tape, watcher.forward(tape, x, y) as rec:
            y_pred = model(x, training=True)
            # In the order of the model's outputs (as fit's compiled loss has them).
            per_output = {k: loss_fn(y[k], y_pred[k]) for k in ("main", "aux")}
            loss = rec.loss(tf.add_n(list(per_output.values())), y_pred=y_pred, outputs=per_output)
        grads = tape.gradient(loss, rec.sources(model.trainable_variables))
        grads = rec.gradients(grads)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=False))
        rec.after_update()
        return loss

    x, y = kwargs["x"], kwargs["y"]
    n = len(next(iter(y.values())))
    for start in range(0, n, BATCH):
        xb = {k: tf.constant(v[start : start + BATCH]) for k, v in x.items()}
        yb = {k: tf.constant(v[start : start + BATCH]) for k, v in y.items()}
        train_step(xb, yb)
        if watcher.end_step():
            break
    watcher.close()
    return watcher, truth
