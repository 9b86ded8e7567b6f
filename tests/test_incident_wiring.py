"""What the watch session does around an incident, seen from outside: the op
and source line by replay in the report, the console message, the run-summary
keys the cause verdict reads (weights at start, dtype policy)."""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest
import tensorflow as tf
from nanwatch_testlib import report_json
from test_replay import BATCH, backward_sqrt, forward_log, loop_until_incident

import tb_nanwatch
from tb_nanwatch.evidence.options import WatchOptions
from tb_nanwatch.record.after_incident import replay
from tb_nanwatch.record.run_info import base_run_info


def _report(log_dir) -> dict:
    (run,) = report_json(log_dir)
    return run


def _fit(model, x, run_dir, **watch):
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    y = np.zeros((len(x), 1), "float32")
    model.fit(
        x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
        callbacks=[tb_nanwatch.NanWatch(str(run_dir), **watch)],
    )  # fmt: skip


def test_fit_names_the_op_and_source_line_in_the_report_and_the_console(tmp_path, capfd):
    model, x, where, source = forward_log()
    _fit(model, x, tmp_path / "run")
    run = _report(tmp_path)
    op = run["first_nonfinite"]["op"]
    assert (op["type"], op["source"], op["reproduced"]) == ("Log", source, True)
    err = capfd.readouterr().err
    message = err[err.index("NanWatch: first non-finite") :]
    assert ("\n" + err).count("\nNanWatch: first non-finite") == 1  # on a line of its own
    assert "at layer log (output of log)" in message and "None" not in message.splitlines()[1]
    assert f"tb-nanwatch report {tmp_path / 'run'}" in message
    assert f"reproduction bundle: {tmp_path / 'run'}/repro/step_" in message
    assert "cause forward_math" in message
    assert f"op Log (log/Log), forward phase, at {source}; reproduced" in err


def test_custom_loop_replays_with_its_loss_fn(tmp_path):
    loss_fn = keras.losses.MeanSquaredError()
    run_dir = str(tmp_path / "run")
    _, _, source = loop_until_incident(backward_sqrt, run_dir, loss_fn, loss_fn=loss_fn)
    op = _report(tmp_path)["first_nonfinite"]["op"]
    assert (op["type"], op["source"], op["reproduced"]) == ("SqrtGrad", source, True)


def test_a_failing_replay_is_a_warning_and_the_incident_stays(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("replay broke")

    monkeypatch.setattr(replay, "replay_step", broken)
    model, x, where, source = forward_log()
    with pytest.warns(RuntimeWarning, match="could not replay"):
        _fit(model, x, tmp_path / "run")
    run = _report(tmp_path)
    assert run["first_nonfinite"]["phase"] == "forward"
    assert run["first_nonfinite"]["op"] is None


def test_run_summary_holds_the_weights_checked_at_start_and_the_dtype_policy(tmp_path):
    inp = keras.Input((3,))
    hidden = keras.layers.Dense(4, name="pretrained")(inp)
    model = keras.Model(inp, keras.layers.Dense(1, name="head")(hidden))
    kernel = model.get_layer("pretrained").kernel
    broken = kernel.numpy()
    broken[1, 2] = np.nan
    kernel.assign(broken)

    class _Recorder:  # what base_run_info reads of a recorder
        strategy = tf.distribute.get_strategy()
        tapped_layers: list = []
        steps_per_execution = 1

    info = base_run_info(_Recorder(), model, None, WatchOptions())
    assert info["weights_at_start"] == {"checked": 4, "nonfinite": [kernel.path]}
    assert info["dtype_policy"] == "float32"
    x = np.ones((4 * BATCH, 3), "float32")
    _fit(model, x, tmp_path / "run")
    run = _report(tmp_path)
    assert run["first_nonfinite"]["step"] == 0
    assert run["cause"]["id"] == "nonfinite_weights"
    assert kernel.path in json.dumps(run["cause"]["evidence"])


def test_entries_are_named_by_the_models_inputs_and_outputs(tmp_path):
    inp = keras.Input((3,), name="features")
    hidden = keras.layers.Dense(4, name="hidden")(inp)
    out = keras.layers.Dense(1, activation="sigmoid", name="prob")(hidden)
    model = keras.Model(inp, out)
    model.compile(optimizer="sgd", loss="binary_crossentropy")
    watch = tb_nanwatch.NanWatch(str(tmp_path / "run"))
    model.fit(np.ones((16, 3)), np.ones((16, 1)), batch_size=8, verbose=0, callbacks=[watch])
    tensors = [e.tensor for e in watch.journal.schema.entries]
    assert "model input features" in tensors
    assert "target" in tensors
    assert "logits of model output prob (before the final activation)" in tensors
    assert "loss of output prob" in tensors
    assert not any("keras_tensor" in t or "target target" in t for t in tensors)
    assert not any("binary_crossentropy" in t for t in tensors)


def test_a_layer_the_loss_does_not_reach_has_no_gradient_entry(tmp_path):
    # "side" feeds nothing the loss depends on: its gradient does not exist,
    # and must not read as a dead (zero) gradient.
    inp = keras.Input((3,), name="features")
    used = keras.layers.Dense(1, name="used")(inp)
    side = keras.layers.Dense(2, name="side")(inp)
    model = keras.Model(inp, [used, side])
    model.compile(optimizer="sgd", loss=["mse", None])
    watch = tb_nanwatch.NanWatch(str(tmp_path / "run"))
    model.fit(np.ones((16, 3)), np.ones((16, 1)), batch_size=8, verbose=0, callbacks=[watch])
    grad_out = {e.layer for e in watch.journal.schema.entries if e.kind == "grad_out"}
    assert "used" in grad_out and "side" not in grad_out
