"""StepWatcher: NanWatch in custom training loops (and custom train_step)."""

from __future__ import annotations

import os
import sys

import keras
import numpy as np
import pytest
import scenarios
import tensorflow as tf
from scenarios import origin, train_custom_loop

import tb_nanwatch
from tb_nanwatch.record.callback import NonFiniteError

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from demo import seed003_custom_loop_autoencoder as seed003  # noqa: E402


def test_seed003_custom_loop_finds_the_origin_and_its_bundle_replays_it(tmp_path):
    incident = seed003.run(str(tmp_path))
    assert {k: incident[k] for k in seed003.TRUTH} == seed003.TRUTH
    bundle = tb_nanwatch.load_bundle(str(tmp_path))
    assert bundle.step == seed003.ZERO_STEP and bundle.info["exact"]
    x, y = bundle.batch
    assert (x[seed003.ZERO_ROW] == 0).all() and np.isfinite(x).all()
    assert all(np.isfinite(w).all() for w in bundle.weights.values())
    # Replaying the saved step from the saved weights reproduces the NaN gradient.
    model = seed003.build_autoencoder()
    bundle.restore(model)
    with tf.GradientTape() as tape:
        loss = seed003.weighted_cross_entropy(x, model(x))
    grads = tape.gradient(loss, model.trainable_variables)
    assert np.isfinite(loss.numpy())
    assert not all(np.isfinite(g.numpy()).all() for g in grads)


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_custom_loop_diagnosis_and_entries_match_fit_in_graph_and_xla(jit_compile, tmp_path):
    loop, truth = train_custom_loop(
        scenarios.ratio_multi_io, tmp_path / "loop", jit_compile=jit_compile
    )
    assert origin(loop.incident) == truth
    assert loop.journal.status == "stopped" and loop.journal.steps == truth["step"] + 1
    # Same entries (same on-disk schema) as the callback on the same model.
    model, kwargs, _ = scenarios.ratio_multi_io()
    watch = tb_nanwatch.NanWatch(str(tmp_path / "fit"))
    model.fit(**kwargs, callbacks=[watch], verbose=0)
    assert origin(watch.incident) == origin(loop.incident)
    assert watch.incident["tensor"] == loop.incident["tensor"]
    fit_entries = [(e.phase, e.kind, e.layer) for e in watch.journal.schema.entries]
    loop_entries = [(e.phase, e.kind, e.layer) for e in loop.journal.schema.entries]
    assert loop_entries == fit_entries
    assert loop.journal.summary()["loop"] == "custom"
    bundle = tb_nanwatch.load_bundle(str(tmp_path / "loop"))
    assert bundle.info["exact"] and bundle.x["den"][5, 0] == 0


def test_custom_loop_raise_and_continue(tmp_path):
    with pytest.raises(NonFiniteError) as info:
        train_custom_loop(scenarios.ratio_multi_io, tmp_path / "raise", on_nonfinite="raise")
    assert info.value.incident["step"] == 9
    watcher, _ = train_custom_loop(
        scenarios.ratio_multi_io, tmp_path / "continue", on_nonfinite="continue"
    )
    assert watcher.incident["step"] == 9 and watcher.journal.steps == 12
    assert watcher.journal.status == "finished"


def test_custom_loop_several_steps_per_call(tmp_path):
    """Four steps inside one tf.function call: every step recorded, exact step."""
    model, kwargs, truth = scenarios.ratio_multi_io()
    optimizer = keras.optimizers.SGD(0.01)
    watcher = tb_nanwatch.StepWatcher(str(tmp_path), model, optimizer, steps_per_execution=4)
    x, y = kwargs["x"], kwargs["y"]

    @tf.function
    def four_steps(xs, ys):
        for i in tf.range(4):
            xb = {k: v[i] for k, v in xs.items()}
            yb = {k: v[i] for k, v in ys.items()}
            with tf.GradientTape() as tape, watcher.forward(tape, xb, yb) as rec:
                y_pred = model(xb, training=True)
                loss = rec.loss(
                    tf.reduce_mean((yb["main"] - y_pred["main"]) ** 2)
                    + tf.reduce_mean((yb["aux"] - y_pred["aux"]) ** 2),
                    y_pred=y_pred,
                )
            grads = rec.gradients(tape.gradient(loss, rec.sources(model.trainable_variables)))
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=False))
            rec.after_update()

    def chunks(arrays, start):
        return {
            k: tf.constant(v[start : start + 4 * scenarios.BATCH].reshape(4, scenarios.BATCH, -1))
            for k, v in arrays.items()
        }

    for start in range(0, 12 * scenarios.BATCH, 4 * scenarios.BATCH):
        four_steps(chunks(x, start), chunks(y, start))
        if watcher.end_step():
            break
    watcher.close()
    assert origin(watcher.incident) == truth
    assert watcher.journal.steps == 12  # the whole execution 8..11 was recorded
    bundle = tb_nanwatch.load_bundle(str(tmp_path))
    assert bundle.info["batch_of_step"] == 9 and bundle.info["exact"]


def test_custom_train_step_under_fit_with_the_watcher_callback(tmp_path):
    class OwnStep(keras.Model):
        watcher = None

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape, self.watcher.forward(tape, x, y) as rec:
                y_pred = self(x, training=True)
                loss = rec.loss(tf.reduce_mean(tf.square(y - y_pred)), y_pred=y_pred)
            grads = rec.gradients(tape.gradient(loss, rec.sources(self.trainable_variables)))
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=False))
            rec.after_update()
            return {"loss": loss}

    model, kwargs, truth = scenarios.frozen_norm()
    inner = model
    model = OwnStep(inner.inputs[0], inner.outputs[0], name="own_step")
    model.compile(optimizer=keras.optimizers.SGD(0.01))
    model.optimizer.build(model.trainable_variables)
    watcher = tb_nanwatch.StepWatcher(str(tmp_path), model, model.optimizer)
    OwnStep.watcher = watcher
    model.fit(**kwargs, epochs=1, callbacks=[watcher.callback()], verbose=0)
    assert origin(watcher.incident) == truth
    assert watcher.journal.status == "stopped"
    assert watcher.journal.steps == truth["step"] + 1


def test_mixed_precision_custom_loop_records_skips(tmp_path):
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model, kwargs, truth = scenarios.mixed_log_negative()
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01))
        watcher = tb_nanwatch.StepWatcher(str(tmp_path), model, optimizer, max_consecutive_skips=3)

        @tf.function
        def train_step(x, y):
            with tf.GradientTape() as tape, watcher.forward(tape, x, y) as rec:
                y_pred = model(x, training=True)
                loss = rec.loss(tf.reduce_mean(tf.square(y - y_pred)), y_pred=y_pred)
                scaled = optimizer.scale_loss(loss)
            grads = rec.gradients(tape.gradient(scaled, rec.sources(model.trainable_variables)))
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=False))
            rec.after_update()

        x, y = kwargs["x"], kwargs["y"]
        for start in range(0, len(x), scenarios.BATCH):
            train_step(
                tf.constant(x[start : start + scenarios.BATCH]),
                tf.constant(y[start : start + scenarios.BATCH]),
            )
            if watcher.end_step():
                break
        watcher.close()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert origin(watcher.incident) == truth
    assert watcher.journal.skipped_steps == [4, 5, 6]


def test_step_watcher_arguments_are_named(tmp_path):
    model = scenarios.healthy_small()[0]
    with pytest.raises(ValueError, match="on_nonfinite"):
        tb_nanwatch.StepWatcher(str(tmp_path), model, model.optimizer, on_nonfinite="nope")
    with pytest.raises(ValueError, match="steps_per_execution"):
        tb_nanwatch.StepWatcher(str(tmp_path), model, model.optimizer, steps_per_execution=0)
    with pytest.raises(ValueError, match="keras.Model"):
        tb_nanwatch.StepWatcher(str(tmp_path), object(), None)
