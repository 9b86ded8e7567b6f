"""Run-summary keys about the model when training begins (read by the cause verdict)."""

from __future__ import annotations

import io
import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import tb_nanwatch
from tb_nanwatch import cli, model_at_start


def report_cause(run_dir: str) -> dict | None:
    out, err = io.StringIO(), io.StringIO()
    assert cli.main(["report", run_dir, "--json"], out, err) == 0, err.getvalue()
    (run,) = json.loads(out.getvalue())["runs"]
    return run["cause"]


def float_weight_count(model: keras.Model) -> int:
    return sum(1 for v in model.weights if keras.backend.is_float_dtype(v.dtype))


def embedding_model() -> keras.Model:
    inp = keras.Input((4,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(10, 3, name="table")(inp)
    h = keras.layers.BatchNormalization(name="norm")(keras.layers.Flatten()(h))
    return keras.Model(inp, keras.layers.Dense(1, name="head")(h))


def fit(model: keras.Model, run_dir: str, x, steps: int = 4) -> tb_nanwatch.NanWatch:
    watch = tb_nanwatch.NanWatch(run_dir)
    y = np.zeros((len(x), 1), "float32")
    model.fit(x, y, batch_size=len(x) // steps, shuffle=False, callbacks=[watch], verbose=0)
    return watch


def test_a_pretrained_nan_row_is_found_before_the_first_step(tmp_path):
    model = embedding_model()
    table = model.get_layer("table").embeddings
    values = table.numpy()
    values[7, 1] = np.nan  # a broken row of a "pretrained" table
    table.assign(values)
    model.compile(optimizer="sgd", loss="mse")
    x = np.tile(np.arange(4, dtype="int32"), (16, 1))
    x[9, 2] = 7  # the bad row is looked up at step 2
    watch = fit(model, str(tmp_path), x)
    summary = watch.journal.summary()
    assert summary["weights_at_start"] == {
        "checked": float_weight_count(model),  # BatchNorm's moving statistics included
        "nonfinite": [table.path],
    }
    assert summary["dtype_policy"] == "float32"
    assert watch.incident is not None
    assert report_cause(str(tmp_path))["id"] == "nonfinite_weights"


def test_a_nan_the_training_made_is_not_a_broken_weight(tmp_path):
    inp = keras.Input((3,))
    model = keras.Model(inp, keras.layers.Dense(1, name="head")(inp))
    model.get_layer("head").kernel.assign(np.full((3, 1), 2e38, "float32"))  # finite; x @ k is not
    model.compile(optimizer="sgd", loss="mse")
    watch = fit(model, str(tmp_path), np.ones((8, 3), "float32"))
    assert watch.incident is not None and watch.incident["phase"] == "forward"
    checked = watch.journal.summary()["weights_at_start"]
    assert checked == {"checked": 2, "nonfinite": []}
    assert report_cause(str(tmp_path))["id"] != "nonfinite_weights"


def test_mixed_precision_policy_is_recorded(tmp_path):
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        inp = keras.Input((3,))
        model = keras.Model(inp, keras.layers.Dense(1, dtype="float32")(keras.layers.Dense(2)(inp)))
        model.compile(optimizer="sgd", loss="mse")
        watch = fit(model, str(tmp_path), np.ones((8, 3), "float32"), steps=2)
    finally:
        keras.config.set_dtype_policy(previous)
    summary = watch.journal.summary()
    assert summary["dtype_policy"] == "mixed_float16"
    assert summary["weights_at_start"]["checked"] == 4


def test_step_watcher_records_the_same_keys(tmp_path):
    inp = keras.Input((3,))
    model = keras.Model(inp, keras.layers.Dense(1)(inp))
    kernel = model.layers[-1].kernel
    kernel.assign(np.array([[np.inf], [0.0], [0.0]], "float32"))
    loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)
    watcher = tb_nanwatch.StepWatcher(str(tmp_path), model, keras.optimizers.SGD(), loss_fn=loss_fn)
    info = watcher.session.run_info
    assert info["weights_at_start"] == {"checked": 2, "nonfinite": [kernel.path]}
    assert info["dtype_policy"] == "float32" and info["loss_from_logits"] is True
    watcher.close()


@pytest.mark.parametrize(
    ("loss", "expected"),
    [
        ("binary_crossentropy", False),
        (keras.losses.BinaryCrossentropy(from_logits=True), True),
        (keras.losses.SparseCategoricalCrossentropy(), False),
        ("mse", None),
        (lambda y, p: tf.reduce_mean(y - p), None),
        ({"a": keras.losses.CategoricalCrossentropy(from_logits=True), "b": "mse"}, None),
    ],
)
def test_loss_from_logits(loss, expected):
    assert model_at_start.loss_from_logits(loss) is expected


def test_a_failing_check_is_a_warning_not_an_error(monkeypatch):
    model = embedding_model()

    def broken(*args, **kwargs):
        raise RuntimeError("device gone")

    monkeypatch.setattr(tf.math, "is_finite", broken)
    with pytest.warns(RuntimeWarning, match="could not check the weights"):
        info = model_at_start.run_info(model, "mse")
    assert "weights_at_start" not in info and info["dtype_policy"] == "float32"
