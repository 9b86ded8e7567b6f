"""NanWatch as a tf_keras (Keras 2) callback: ``fit`` of a tf_keras model is
watched (never broken), with the same record as a Keras 3 model."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import numpy as np
import tensorflow as tf
import tf_keras

import tb_nanwatch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BATCH = 8


class Log(tf_keras.layers.Layer):
    def call(self, x):
        return tf.math.log(x)


def _fit(model, x, y, log_dir, **watch_kwargs):
    watch = tb_nanwatch.NanWatch(str(log_dir), **watch_kwargs)
    history = model.fit(x, y, batch_size=BATCH, shuffle=False, callbacks=[watch], verbose=0)
    return watch, history


def test_a_loss_going_inf_under_tf_keras_fit_is_a_loss_incident(tmp_path, caplog):
    tf_keras.utils.set_random_seed(0)
    rng = np.random.RandomState(0)
    x = rng.uniform(0.5, 1.5, (10 * BATCH, 4)).astype("float32")
    y = rng.uniform(0.5, 1.5, (10 * BATCH, 1)).astype("float32")
    y[6 * BATCH + 3] = 0.0  # step 6: the loss divides by it

    def ratio_loss(y_true, y_pred):
        return tf.reduce_mean(tf.square(y_pred) / y_true)

    model = tf_keras.Sequential(
        [tf_keras.layers.Dense(3, activation="tanh", name="hidden", input_shape=(4,))]
        + [tf_keras.layers.Dense(1, name="head")]
    )
    model.compile(optimizer=tf_keras.optimizers.SGD(0.01), loss=ratio_loss)
    with caplog.at_level(logging.WARNING, logger="tb_nanwatch"):
        watch, history = _fit(model, x, y, tmp_path)
    incident = watch.incident
    assert (incident["step"], incident["phase"], incident["kind"]) == (6, "loss", "inf")
    assert len(history.history["loss"]) == 1  # fit ended normally, stopped after the step
    journal = watch.journal
    assert journal.steps == 7 and journal.status == "stopped"
    assert journal.summary()["framework"].startswith("tf_keras ")
    layers = [e.layer for e in journal.schema.entries if e.phase == "forward"]
    assert layers[:2] == ["hidden", "head"]
    grads = [e.tensor for e in journal.schema.entries if e.kind == "grad_var"]
    assert "gradient of hidden/kernel" in grads
    said = [r.getMessage() for r in caplog.records if "tf_keras" in r.getMessage()]
    assert len(said) == 1  # what does not work under tf_keras, said once
    bundle = tb_nanwatch.load_bundle(str(tmp_path))
    assert bundle.step == 6 and bundle.y[3, 0] == 0
    # The model's own train step is back after fit.
    assert "train_step" not in model.__dict__


def test_a_nested_tf_keras_layer_making_nan_is_named_by_its_path(tmp_path):
    tf_keras.utils.set_random_seed(1)
    rng = np.random.RandomState(1)
    x = rng.uniform(0.5, 1.5, (8 * BATCH, 3)).astype("float32")
    x[4 * BATCH + 2, 0] = -1.0  # step 4: log of a negative in the nested model
    y = np.zeros((len(x), 1), "float32")
    inner = tf_keras.Sequential([Log(name="log", input_shape=(3,))], name="inner")
    inp = tf_keras.Input((3,), name="features")
    out = tf_keras.layers.Dense(1, name="head")(inner(inp))
    model = tf_keras.Model(inp, out, name="outer")
    model.compile(optimizer="adam", loss="mse")
    healthy, _ = _fit(model, np.abs(x), y, tmp_path / "healthy")
    assert healthy.incident is None and healthy.journal.steps == 8
    watch, _ = _fit(model, x, y, tmp_path / "nan")  # a second fit of the same model
    incident = watch.incident
    assert (incident["step"], incident["phase"], incident["kind"]) == (4, "forward", "nan")
    assert incident["layer"] == "inner/log"
    inputs = [e.layer for e in watch.journal.schema.entries if e.phase == "input"]
    assert inputs == ["features", "target"]


def test_no_tf_keras_is_imported_for_a_keras_3_model(tmp_path):
    code = (
        "import sys, numpy as np, keras, tb_nanwatch\n"
        "m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])\n"
        "m.compile(optimizer='sgd', loss='mse')\n"
        f"w = tb_nanwatch.NanWatch({str(tmp_path)!r})\n"
        "m.fit(np.ones((4, 2)), np.ones((4, 1)), callbacks=[w], verbose=0)\n"
        "assert w.journal.steps == 1\n"
        "print('tf_keras' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3"),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "False"


def test_tf_keras_mixed_precision_skips_are_skips_not_incidents(tmp_path):
    tf_keras.utils.set_random_seed(3)
    tf_keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = tf_keras.Sequential(
            [tf_keras.layers.Dense(3, input_shape=(4,), name="hidden")]
            + [tf_keras.layers.Dense(1, name="head", dtype="float32")]
        )
        optimizer = tf_keras.mixed_precision.LossScaleOptimizer(
            tf_keras.optimizers.SGD(0.01), initial_scale=2.0**8
        )
        model.compile(optimizer=optimizer, loss="mse")
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")
    x = np.ones((8 * BATCH, 4), "float32")
    x[3 * BATCH] = 3e4  # the float16 gradients of step 3 overflow: the loss scaler skips it
    watch, _ = _fit(model, x, np.ones((len(x), 1), "float32"), tmp_path)
    journal = watch.journal
    assert watch.incident is None and journal.steps == 8
    assert journal.skipped_steps == [3]
    _, window = journal.flight_window()
    scale = window[:, journal.schema.header_index("loss_scale")]
    assert scale[3] == 2 * scale[4] > 0  # halved after the skipped step
