"""tb_nanwatch.summary: TensorBoard-style ops for hand-written tf.summary code."""

from __future__ import annotations

import glob
import math

import numpy as np
import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator

import tb_nanwatch


def _scalars(log_dir):
    acc = event_accumulator.EventAccumulator(log_dir, size_guidance={"tensors": 0})
    acc.Reload()
    return {
        tag: [(e.step, float(tf.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]
        for tag in acc.Tags()["tensors"]
    }


def test_summary_ops_write_and_return_in_a_tf_function(tmp_path):
    writer = tf.summary.create_file_writer(str(tmp_path))
    w = tf.Variable([[1.0, -2.0], [3.0, 0.5]], name="kernel")
    b = tf.Variable([0.0, 1.0], name="bias")

    @tf.function
    def step(x, s):
        with writer.as_default(step=s):
            with tf.GradientTape() as tape:
                logits = x @ w + b
                loss = tf.reduce_sum(tf.math.log(logits))
            grads = tape.gradient(loss, [w, b])
            ok = tb_nanwatch.summary.finite_check("loss", loss)
            low, high = tb_nanwatch.summary.logit_extremes("logit_range", logits)
            norm = tb_nanwatch.summary.grad_norms("grads", grads, [w, b])
        return ok, low, high, norm

    # logits = [1 + 3, -2 + 0.5 + 1] = [4, -0.5]: the loss has log(-0.5) = NaN,
    # the gradients (1/logit) are finite.
    ok, low, high, norm = step(tf.constant([[1.0, 1.0]]), tf.constant(0, tf.int64))
    assert not bool(ok) and float(low) == -0.5 and float(high) == 4.0
    assert math.isfinite(float(norm))
    # logits = [1 + 6, -2 + 1 + 1] = [7, 0]: log(0) = -inf, its gradient 1/0 = inf.
    ok, low, high, norm = step(tf.constant([[1.0, 2.0]]), tf.constant(1, tf.int64))
    assert not bool(ok)
    assert float(low) == 0.0 and float(high) == 7.0
    assert not math.isfinite(float(norm))
    writer.flush()

    scalars = _scalars(str(tmp_path))
    assert scalars["loss/nan_count"] == [(0, 1.0), (1, 0.0)]
    assert scalars["loss/inf_count"] == [(0, 0.0), (1, 1.0)]
    assert scalars["logit_range/max"] == [(0, 4.0), (1, 7.0)]
    assert scalars["logit_range/abs_max"][0] == (0, 4.0)
    assert scalars["grads/nonfinite_count"][0] == (0, 0.0)
    assert scalars["grads/nonfinite_count"][1][1] > 0
    assert set(scalars) >= {"grads/global_norm", "grads/kernel", "grads/bias"}
    global_norm = scalars["grads/global_norm"][0][1]
    parts = [scalars["grads/kernel"][0][1], scalars["grads/bias"][0][1]]
    assert np.isclose(global_norm, math.sqrt(sum(p * p for p in parts)), rtol=1e-5)
    assert glob.glob(str(tmp_path / "events.out.tfevents.*"))


def test_nan_in_logits_is_visible_in_extremes(tmp_path):
    writer = tf.summary.create_file_writer(str(tmp_path))
    with writer.as_default(step=3):
        low, high = tb_nanwatch.summary.logit_extremes("l", tf.constant([1.0, float("nan")]))
        ok = tb_nanwatch.summary.finite_check("t", {"a": tf.constant([1.0, float("inf")])})
    assert math.isnan(float(low)) and math.isnan(float(high))
    assert not bool(ok)
    writer.flush()
    assert _scalars(str(tmp_path))["t/inf_count"] == [(3, 1.0)]


def test_grad_norms_checks_names_and_none_gradients():
    import pytest

    with pytest.raises(ValueError, match="2 gradients but 1 variables"):
        tb_nanwatch.summary.grad_norms("g", [tf.ones(2), None], [tf.Variable(1.0)])
    writer = tf.summary.create_noop_writer()
    with writer.as_default(step=0):
        norm = tb_nanwatch.summary.grad_norms("g", [tf.constant([3.0, 4.0]), None])
    assert float(norm) == 5.0
