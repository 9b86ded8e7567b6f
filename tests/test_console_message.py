"""The console message at the incident: own lines, readable place, where to look, the cause."""

from __future__ import annotations

import os

import keras
import numpy as np
import tensorflow as tf

import tb_nanwatch
from tb_nanwatch import session


def fit(model: keras.Model, loss, run_dir: str, x: np.ndarray, verbose: int = 0) -> dict:
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss)
    watch = tb_nanwatch.NanWatch(run_dir)
    y = np.ones((len(x), 1), "float32")
    model.fit(x, y, batch_size=4, shuffle=False, callbacks=[watch], verbose=verbose)
    return watch.incident


def message_lines(err: str) -> list[str]:
    """The NanWatch message's lines: from its 'NanWatch:' line to the bundle line."""
    lines = err.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("NanWatch: first"))
    end = next(i for i in range(start, len(lines)) if "reproduction bundle" in lines[i])
    return lines[start : end + 1]


def test_loss_phase_message(tmp_path, capfd):
    def log_of_zero(y, p):  # finite predictions, a loss of -inf
        return tf.reduce_mean(tf.math.log(tf.abs(p - p)))

    inp = keras.Input((3,), name="features")
    model = keras.Model(inp, keras.layers.Dense(1, name="head")(inp))
    run_dir = str(tmp_path / "run")
    incident = fit(model, log_of_zero, run_dir, np.ones((8, 3), "float32"), verbose=2)
    assert incident["phase"] == "loss"
    err = capfd.readouterr().err
    lines = message_lines(err)
    assert "\nNanWatch: first" in err  # starts on a line of its own
    assert lines[0].startswith("NanWatch: first Inf at step 0 (epoch 0, batch 0)")
    assert "born in the loss phase, in the loss" in lines[0]
    assert "None" not in "\n".join(lines)
    assert lines[1].startswith("  cause ") and lines[1].count(". ") <= 3
    assert f"  run dir: {run_dir}" in lines
    assert any(f"tb-nanwatch report {run_dir}" in line for line in lines)
    bundle_dir = tb_nanwatch.load_bundle(run_dir).directory
    assert lines[-1].startswith(f"  reproduction bundle: {bundle_dir}")
    assert os.path.isdir(bundle_dir)


def test_forward_phase_message_names_the_layer(tmp_path, capfd):
    class Root(keras.layers.Layer):
        def call(self, x):
            return tf.sqrt(x)

    inp = keras.Input((3,), name="features")
    model = keras.Model(inp, keras.layers.Dense(1, name="head")(Root(name="root")(inp)))
    x = np.ones((8, 3), "float32")
    x[5, 1] = -4.0  # sqrt of a negative at step 1
    run_dir = str(tmp_path)
    incident = fit(model, "mse", run_dir, x)
    assert (incident["phase"], incident["layer"]) == ("forward", "root")
    lines = message_lines(capfd.readouterr().err)
    assert lines[0] == (
        "NanWatch: first NaN at step 1 (epoch 0, batch 1), born in the forward phase, "
        "in layer root (output of root)"
    )
    assert lines[1].startswith("  cause forward_math: ")


def test_place_in_words_never_none():
    assert session.incident_place({"phase": "loss", "layer": None, "tensor": "total loss"}) == (
        "the loss"
    )
    input_incident = {"phase": "input", "layer": "features", "tensor": "model input features"}
    assert session.incident_place(input_incident) == "the model input features"
    unowned = {"phase": "backward", "layer": None, "tensor": "the loss scaler's scaled gradients"}
    assert session.incident_place(unowned) == "the loss scaler's scaled gradients"
