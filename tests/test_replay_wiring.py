"""The replay wired into a watched run: the op and source line reach the record.

At the incident the model is saved beside the bundle; when training stops the
incident's step is replayed once and ``first_nonfinite.op`` (report --json,
the incident the tab reads) names the op and this file's source line.
"""

from __future__ import annotations

import inspect
import io
import json
import os
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tb_nanwatch
from tb_nanwatch import bundle as bundle_module
from tb_nanwatch import cli, replay

BATCH = 4
STEPS = 6
BAD_STEP = 2


class WiringLog(keras.layers.Layer):
    def call(self, x):
        return tf.math.log(x)


def log_line() -> str:
    lines, first = inspect.getsourcelines(WiringLog.call)
    offset = next(i for i, line in enumerate(lines) if "tf.math.log" in line)
    return f"{inspect.getsourcefile(WiringLog.call)}:{first + offset}"


def data() -> tuple[np.ndarray, np.ndarray]:
    x = np.random.RandomState(0).uniform(0.5, 1.5, (STEPS * BATCH, 3)).astype("float32")
    x[BAD_STEP * BATCH + 1, 0] = -1.0  # log of a negative at BAD_STEP
    return x, np.ones((len(x), 1), "float32")


def log_model() -> keras.Model:
    inp = keras.Input((3,), name="features")
    out = keras.layers.Dense(1, name="head")(WiringLog(name="log")(inp))
    return keras.Model(inp, out, name="wiring")


def report_json(run_dir: str) -> dict:
    out, err = io.StringIO(), io.StringIO()
    assert cli.main(["report", run_dir, "--json"], out, err) == 0, err.getvalue()
    (run,) = json.loads(out.getvalue())["runs"]
    return run


def fit(run_dir: str, **watch_options) -> tb_nanwatch.NanWatch:
    model = log_model()
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    watch = tb_nanwatch.NanWatch(run_dir, **watch_options)
    x, y = data()
    model.fit(x, y, batch_size=BATCH, shuffle=False, epochs=1, callbacks=[watch], verbose=0)
    return watch


def assert_log_op(run_dir: str) -> None:
    first = report_json(run_dir)["first_nonfinite"]
    assert (first["step"], first["phase"], first["layer"]) == (BAD_STEP, "forward", "log")
    assert first["op"] == {
        "type": "Log",
        "name": "log/Log",
        "source": log_line(),
        "reproduced": True,
    }
    written = tb_nanwatch.load_bundle(run_dir)
    with open(os.path.join(written.directory, bundle_module.REPLAY_FILE)) as f:
        assert json.load(f)["op"]["source"] == log_line()


def test_fit_names_the_op_and_line_in_the_report(tmp_path, capfd):
    watch = fit(str(tmp_path))
    assert watch.incident["op"]["type"] == "Log"
    assert_log_op(str(tmp_path))
    saved = tb_nanwatch.load_bundle(str(tmp_path))
    assert saved.info["model"] == bundle_module.MODEL_FILE  # travels for `tb-nanwatch replay`
    assert os.path.exists(os.path.join(saved.directory, bundle_module.MODEL_FILE))
    err = capfd.readouterr().err
    assert "NanWatch replay of step 2: first non-finite value from op Log" in err
    assert log_line() in err


def test_raise_replays_before_raising(tmp_path):
    with pytest.raises(tb_nanwatch.callback.NonFiniteError):
        fit(str(tmp_path), on_nonfinite="raise")
    assert_log_op(str(tmp_path))


def test_custom_loop_with_loss_fn_names_the_op_and_line(tmp_path):
    model = log_model()
    optimizer = keras.optimizers.SGD(0.01)
    loss_fn = keras.losses.MeanSquaredError()
    watcher = tb_nanwatch.StepWatcher(str(tmp_path), model, optimizer, loss_fn=loss_fn)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape, watcher.forward(tape, x, y) as rec:
            y_pred = model(x, training=True)
            loss = rec.loss(loss_fn(y, y_pred), y_pred=y_pred)
        grads = rec.gradients(tape.gradient(loss, rec.sources(model.trainable_variables)))
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=False))
        rec.after_update()

    x, y = data()
    for start in range(0, len(x), BATCH):
        train_step(tf.constant(x[start : start + BATCH]), tf.constant(y[start : start + BATCH]))
        if watcher.end_step():
            break
    watcher.close()
    assert_log_op(str(tmp_path))
    assert tb_nanwatch.load_bundle(str(tmp_path)).info["replay_loss"] is not None


def test_loss_fn_must_be_callable(tmp_path):
    model = log_model()
    with pytest.raises(ValueError, match="loss_fn"):
        tb_nanwatch.StepWatcher(str(tmp_path), model, keras.optimizers.SGD(), loss_fn="mse")


def test_a_failing_replay_is_one_warning_and_the_run_ends_normally(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("replay exploded")

    monkeypatch.setattr(replay, "replay_step", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watch = fit(str(tmp_path))
    replay_warnings = [w for w in caught if "could not replay" in str(w.message)]
    assert len(replay_warnings) == 1 and "replay exploded" in str(replay_warnings[0].message)
    assert watch.incident["step"] == BAD_STEP and "op" not in watch.incident
    assert watch.journal.closed and watch.journal.status == "stopped"
    run = report_json(str(tmp_path))
    assert run["first_nonfinite"]["step"] == BAD_STEP and run["first_nonfinite"]["op"] is None


def test_an_update_phase_incident_is_not_replayed(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(replay, "replay_step", lambda *a, **k: calls.append(a))
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    # epsilon=0 with a zero gradient: 0/0 in the update, everything before it finite.
    model.compile(optimizer=keras.optimizers.Adam(epsilon=0.0), loss="mse")
    x = np.zeros((8, 3), "float32")
    watch = tb_nanwatch.NanWatch(str(tmp_path))
    model.fit(x, np.zeros((8, 1), "float32"), batch_size=4, callbacks=[watch], verbose=0)
    assert watch.incident["phase"] == "update" and calls == []
