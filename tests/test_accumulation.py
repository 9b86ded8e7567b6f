"""Gradient accumulation in a custom loop: several forward/backward passes
(one per micro-batch), one ``apply_gradients`` and one ``end_step`` a step."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from scenarios import Norm

import tb_nanwatch
from tb_nanwatch.record.in_step.recorder import StepPatternError

MICRO = 3
ROWS = 4
STEPS = 6


def _model() -> keras.Model:
    keras.utils.set_random_seed(0)
    inp = keras.Input((4,), name="features")
    hidden = keras.layers.Dense(5, activation="tanh", use_bias=False, name="hidden")(inp)
    norm = Norm(name="norm")(hidden)
    out = keras.layers.Dense(1, name="head")(keras.layers.Concatenate(name="cat")([hidden, norm]))
    return keras.Model(inp, out, name="accumulated")


def _data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(seed)
    x = rng.uniform(0.5, 1.5, (STEPS, MICRO, ROWS, 4)).astype("float32")
    y = rng.uniform(-1, 1, (STEPS, MICRO, ROWS, 1)).astype("float32")
    return x, y


def _train(log_dir, x, y, jit_compile: bool, micro_batches: int = MICRO, passes: int = MICRO):
    model = _model()
    optimizer = keras.optimizers.SGD(0.01)
    watcher = tb_nanwatch.StepWatcher(str(log_dir), model, optimizer, micro_batches=micro_batches)
    variables = model.trainable_variables

    @tf.function(jit_compile=jit_compile)
    def train_step(xs, ys):
        total = [tf.zeros_like(v) for v in variables]
        for i in range(passes):
            with tf.GradientTape() as tape, watcher.forward(tape, xs[i], ys[i]) as rec:
                pred = model(xs[i], training=True)
                loss = rec.loss(tf.reduce_mean(tf.square(pred - ys[i])), y_pred=pred)
            grads = rec.gradients(tape.gradient(loss, rec.sources(variables)))
            total = [t + g / passes for t, g in zip(total, grads, strict=True)]
        optimizer.apply_gradients(zip(total, variables, strict=True))
        rec.after_update()

    for step in range(STEPS):
        train_step(tf.constant(x[step]), tf.constant(y[step]))
        if watcher.end_step():
            break
    watcher.close()
    return watcher


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_a_nan_in_one_micro_batch_input_is_an_input_incident_of_that_micro_batch(
    jit_compile, tmp_path
):
    x, y = _data()
    x[2, 1, 3, 0] = np.nan  # step 2, micro-batch 1, row 3
    watcher = _train(tmp_path, x, y, jit_compile)
    incident = watcher.incident
    assert incident["step"] == 2 and incident["phase"] == "input"
    assert incident["micro_batch"] == 1 and incident["layer"] == "features"
    assert incident["tensor"] == "micro-batch 1: model input features"
    summary = watcher.journal.summary()
    assert summary["jit_compile"] is jit_compile  # the step really was built for XLA (or not)
    assert summary["micro_batches"] == MICRO
    # Every micro-batch has its own entries, in order, then the update.
    entries = watcher.journal.schema.entries
    order = [e.micro_batch for e in entries if e.phase != "header"]
    assert order == sorted(order, key=lambda m: MICRO if m is None else m)
    assert [e.micro_batch for e in entries if e.phase == "input"] == [0, 0, 1, 1, 2, 2]
    assert {e.micro_batch for e in entries if e.phase == "update"} == {None}
    # The bundle holds the micro-batch that went non-finite, and the pre-step weights.
    bundle = tb_nanwatch.load_bundle(str(tmp_path))
    assert bundle.step == 2 and bundle.info["exact"]
    np.testing.assert_array_equal(bundle.x, x[2, 1])
    assert bundle.weights and all(np.isfinite(w).all() for w in bundle.weights.values())


def test_a_backward_nan_in_the_last_micro_batch_is_named_with_its_layer(tmp_path):
    x, y = _data(seed=1)
    x[3, 2, 0] = 0.0  # hidden = tanh(0 @ W) = 0: the gradient of sqrt at 0
    watcher = _train(tmp_path, x, y, jit_compile=False)
    incident = watcher.incident
    assert (incident["step"], incident["phase"], incident["micro_batch"]) == (3, "backward", 2)
    assert incident["layer"] == "norm"
    assert "every gradient was finite" not in str(watcher.journal.cause())


def test_a_healthy_accumulated_run_records_every_step_and_the_mean_loss(tmp_path):
    x, y = _data(seed=2)
    watcher = _train(tmp_path, x, y, jit_compile=False)
    journal = watcher.journal
    assert watcher.incident is None and journal.steps == STEPS
    steps, window = journal.flight_window()
    losses = [
        window[-1][e.index("value")]
        for e in journal.schema.entries
        if e.phase == "loss" and e.layer is None
    ]
    assert len(losses) == MICRO
    header_loss = window[-1][journal.schema.header_index("loss")]
    assert header_loss == pytest.approx(np.mean(losses), rel=1e-5)


def test_a_step_with_more_or_fewer_passes_than_micro_batches_is_refused_at_trace_time(
    tmp_path,
):
    x, y = _data()
    with pytest.raises(StepPatternError, match="micro_batches=2"):
        _train(tmp_path / "more", x, y, jit_compile=False, micro_batches=2, passes=3)
    with pytest.raises(StepPatternError, match="ran 2 forward pass"):
        _train(tmp_path / "fewer", x, y, jit_compile=False, micro_batches=3, passes=2)
    # Two passes without micro_batches: refused, never an update-phase verdict.
    with pytest.raises(StepPatternError, match="micro_batches"):
        _train(tmp_path / "undeclared", x, y, jit_compile=False, micro_batches=1, passes=2)


def test_micro_batches_in_a_tf_range_loop_are_refused_at_trace_time(tmp_path):
    model = _model()
    optimizer = keras.optimizers.SGD(0.01)
    watcher = tb_nanwatch.StepWatcher(str(tmp_path), model, optimizer, micro_batches=2)
    variables = model.trainable_variables

    @tf.function
    def train_step(xs, ys):
        recs = []
        for i in tf.range(2):
            with tf.GradientTape() as tape, watcher.forward(tape, xs[i], ys[i]) as rec:
                loss = rec.loss(tf.reduce_mean(tf.square(model(xs[i]) - ys[i])))
            grads = rec.gradients(tape.gradient(loss, rec.sources(variables)))
            optimizer.apply_gradients(zip(grads, variables, strict=True))
            recs.append(rec)
        recs[-1].after_update()

    x, y = _data()
    with pytest.raises(Exception, match="tf.while_loop"):
        train_step(tf.constant(x[0]), tf.constant(y[0]))
    with pytest.raises(ValueError, match="micro_batches"):
        tb_nanwatch.StepWatcher(str(tmp_path), model, optimizer, micro_batches=0)
