"""Inputs, targets and outputs are recorded under the names a person reads."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import tb_nanwatch
from tb_nanwatch.record.in_step import io_names


def entries(journal, phase: str | None = None, kind: str | None = None) -> list[tuple]:
    return [
        (e.layer, e.tensor)
        for e in journal.schema.entries
        if (phase is None or e.phase == phase) and (kind is None or e.kind == kind)
    ]


def fit(model: keras.Model, loss, x, y, run_dir: str):
    model.compile(optimizer="sgd", loss=loss)
    watch = tb_nanwatch.NanWatch(run_dir)
    model.fit(x, y, batch_size=4, callbacks=[watch], verbose=0)
    return watch.journal


def two_input_two_output_model() -> keras.Model:
    features = keras.Input((3,), name="features")
    unnamed = keras.Input((2,))  # Keras calls it input_layer_N, its tensor keras_tensor_N
    h = keras.layers.Concatenate(name="join")([features, unnamed])
    score = keras.layers.Dense(1, name="score")(h)
    prob = keras.layers.Dense(1, activation="sigmoid", name="prob")(h)
    return keras.Model([features, unnamed], [score, prob])


def test_functional_model_names(tmp_path):
    model = two_input_two_output_model()
    x = [np.ones((8, 3), "float32"), np.ones((8, 2), "float32")]
    y = [np.ones((8, 1), "float32"), np.ones((8, 1), "float32")]
    journal = fit(model, ["mse", "binary_crossentropy"], x, y, str(tmp_path))
    assert entries(journal, "input") == [
        ("features", "model input features"),
        ("input_1", "model input input_1"),
        ("target/score", "target for output score"),
        ("target/prob", "target for output prob"),
    ]
    assert entries(journal, "loss") == [
        ("score", "loss of output score"),
        ("prob", "loss of output prob"),
        (None, "total loss"),
    ]
    assert entries(journal, kind="logits") == [
        ("score", "model output score"),
        ("prob", "logits of model output prob (before the final activation)"),
    ]
    text = " ".join(e.tensor for e in journal.schema.entries)
    assert "keras_tensor" not in text and "input_layer" not in text
    assert "crossentropy" not in text and "mean_squared_error" not in text


def test_single_input_and_target(tmp_path):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, name="head")])
    ones = np.ones((8, 3), "float32")
    journal = fit(model, "binary_crossentropy", ones, np.ones((8, 1), "float32"), str(tmp_path))
    assert entries(journal, "input") == [("input", "model input input"), ("target", "target")]
    assert entries(journal, "loss")[0] == ("head", "loss of output head")
    assert "loss/head" in journal.series_columns


def test_dict_inputs_by_key(tmp_path):
    inputs = {"age": keras.Input((1,), name="age"), "income": keras.Input((1,), name="income")}
    h = keras.layers.Concatenate()([inputs["age"], inputs["income"]])
    model = keras.Model(inputs, keras.layers.Dense(1, name="risk")(h))
    x = {"age": np.ones((8, 1), "float32"), "income": np.ones((8, 1), "float32")}
    journal = fit(model, "mse", x, np.ones((8, 1), "float32"), str(tmp_path))
    assert [name for name, _ in entries(journal, "input")] == ["age", "income", "target"]


def test_step_watcher_names(tmp_path):
    model = two_input_two_output_model()
    optimizer = keras.optimizers.SGD()
    watcher = tb_nanwatch.StepWatcher(str(tmp_path), model, optimizer)
    mse = keras.losses.MeanSquaredError()

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape, watcher.forward(tape, x, y) as rec:
            score, prob = model(x, training=True)
            loss = rec.loss(mse(y, score) + mse(y, prob), y_pred=[score, prob])
        grads = rec.gradients(tape.gradient(loss, rec.sources(model.trainable_variables)))
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=False))
        rec.after_update()

    train_step([tf.ones((4, 3)), tf.ones((4, 2))], tf.ones((4, 1)))
    watcher.end_step()
    watcher.close()
    assert entries(watcher.journal, "input") == [
        ("features", "model input features"),
        ("input_1", "model input input_1"),
        ("target", "target"),
    ]


def test_fallback_names():
    class Subclassed(keras.Model):
        def call(self, x):
            return x

    assert io_names.input_names(Subclassed()) == []
    assert io_names.output_names(Subclassed(), 1) == ["output"]
    assert io_names.output_names(Subclassed(), 2) == ["output_0", "output_1"]
