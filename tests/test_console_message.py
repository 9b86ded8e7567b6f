"""The console message at the incident: own lines, readable place, where to look, the cause."""

from __future__ import annotations

import os

import keras
import numpy as np
import tensorflow as tf

import tb_nanwatch


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
    assert ("\n" + err).count("\nNanWatch: first") == 1  # one block, on lines of its own
    assert lines[0] == (
        "NanWatch: first non-finite value (inf) at step 0 (epoch 0, batch 0), "
        "born in the loss phase, in the loss (loss of output head)"
    )
    assert "None" not in "\n".join(lines)
    assert lines[1].startswith("  cause ")  # loss_math or logits_as_probabilities
    assert lines[2].startswith("  first remedy: ")
    assert lines[3] == f"  run dir: {run_dir}   details: tb-nanwatch report {run_dir}"
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
        "NanWatch: first non-finite value (nan) at step 1 (epoch 0, batch 1), "
        "born in the forward phase, at layer root (output of root)"
    )
    assert lines[1].startswith("  cause forward_math: ")
