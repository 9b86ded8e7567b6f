"""GraphWatcher: NanWatch for TF1 graph-mode code (placeholders, Session,
feed_dict, a tf.compat.v1.train optimizer, MonitoredTrainingSession)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from nanwatch_testlib import report_json

import tb_nanwatch
from tb_nanwatch.compat.v1 import GraphWatcher

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
v1 = tf.compat.v1


def dense(x, units: int, name: str, activation=None, kernel=None):
    """A TF1-style dense layer: its variables and ops in variable scope ``name``."""
    with v1.variable_scope(name):
        init = (
            v1.glorot_uniform_initializer(seed=1)
            if kernel is None
            else v1.constant_initializer(kernel)
        )
        w = v1.get_variable("kernel", [x.shape[-1], units], initializer=init)
        b = v1.get_variable("bias", [units], initializer=v1.zeros_initializer())
        y = tf.matmul(x, w) + b
        return activation(y) if activation is not None else y


def _train(graph, watch, train_op, feeds, init, fetch):
    """A plain Session loop: one sess.run a batch, then watch.end_step()."""
    runs = 0
    with v1.Session(graph=graph) as sess:
        sess.run(init)
        for feed in feeds:
            sess.run([train_op, fetch], feed_dict=feed)
            runs += 1
            if watch.end_step(sess):
                break
    watch.close()
    return runs


def test_a_nan_pixel_fed_in_one_batch_is_an_input_incident_of_its_placeholder(tmp_path):
    rng = np.random.RandomState(0)
    data = rng.uniform(0, 1, (8, 6, 16)).astype("float32")
    data[5, 2, 7] = np.nan
    graph = tf.Graph()
    with graph.as_default():
        pixels = v1.placeholder(tf.float32, [None, 16], name="pixels")
        with v1.variable_scope("encoder"):
            h = dense(pixels, 8, "dense1", tf.nn.relu)
        with v1.variable_scope("decoder"):
            p_pred = dense(h, 16, "dense2", tf.sigmoid)
        with tf.name_scope("loss"):
            loss = tf.reduce_mean(tf.square(p_pred - pixels))
        watch = GraphWatcher(str(tmp_path), loss, outputs={"p_pred": p_pred})
        train_op = watch.minimize(v1.train.AdamOptimizer(0.01))
        init = v1.global_variables_initializer()
    runs = _train(graph, watch, train_op, [{pixels: b} for b in data], init, loss)
    incident = watch.incident
    assert runs == 6 and watch.journal.steps == 6  # one sess.run a step, nothing else
    assert (incident["step"], incident["phase"], incident["kind"]) == (5, "input", "nan")
    assert incident["layer"] == "pixels" and incident["tensor"] == "placeholder pixels"
    schema = watch.journal.schema
    layers = [e.layer for e in schema.entries if e.phase == "forward"]
    assert layers == ["encoder/dense1", "decoder/dense2", "p_pred"]
    logits = [e for e in schema.entries if e.kind == "logits"]
    assert logits[0].before_final_activation  # the sigmoid's input is read
    phases = [e.phase for e in schema.entries[1:]]
    order = ["input", "forward", "loss", "backward", "update"]
    assert phases == sorted(phases, key=order.index)
    grad_vars = [e.tensor for e in schema.entries if e.kind == "grad_var"]
    assert grad_vars[0] == "gradient of decoder/dense2/kernel"
    updates = {e.layer for e in schema.entries if e.phase == "update"}
    assert updates == {"encoder/dense1", "decoder/dense2"}
    summary = watch.journal.summary()
    assert summary["status"] == "stopped" and summary["loop"] == "graph"
    bundle = tb_nanwatch.load_bundle(str(tmp_path))
    assert bundle.step == 5 and bundle.info["exact"]
    np.testing.assert_array_equal(bundle.x["pixels"], data[5])
    assert set(bundle.weights) == {
        "encoder/dense1/kernel",
        "encoder/dense1/bias",
        "decoder/dense2/kernel",
        "decoder/dense2/bias",
    }
    assert all(np.isfinite(w).all() for w in bundle.weights.values())


def _log_graph():
    graph = tf.Graph()
    with graph.as_default():
        features = v1.placeholder(tf.float32, [None, 3], name="features")
        target = v1.placeholder(tf.float32, [None, 1], name="target")
        with tf.name_scope("prep"):
            logged = tf.math.log(features[:, :1], name="log")
        out = dense(tf.concat([logged, features], 1), 1, "head")
        with tf.name_scope("mse"):
            loss = tf.reduce_mean(tf.square(out - target))
    return graph, features, target, loss


def _log_batches() -> tuple[np.ndarray, np.ndarray]:
    """Ten batches for ``_log_graph``: a log of a negative in step 6."""
    rng = np.random.RandomState(1)
    x = rng.uniform(0.5, 1.5, (10, 4, 3)).astype("float32")
    x[6, 1, 0] = -0.5
    return x, np.zeros((4, 1), "float32")


def test_a_log_of_a_negative_under_monitored_training_session_is_a_forward_incident_of_its_scope(
    tmp_path,
):
    graph, features, target, loss = _log_graph()
    x, y = _log_batches()
    with graph.as_default():
        watch = GraphWatcher(str(tmp_path), loss)
        step = v1.train.get_or_create_global_step()
        train_op = watch.minimize(v1.train.GradientDescentOptimizer(0.01), global_step=step)
        ran = 0
        with v1.train.MonitoredTrainingSession(
            hooks=[watch.hook()], log_step_count_steps=None
        ) as sess:
            while not sess.should_stop() and ran < len(x):
                sess.run(train_op, feed_dict={features: x[ran], target: y})
                ran += 1
    incident = watch.incident
    assert ran == 7  # the hook asked the session to stop after step 6
    assert (incident["step"], incident["phase"], incident["layer"]) == (6, "forward", "prep")
    assert incident["kind"] == "nan" and incident["iterations"] == 6  # the global step before it
    assert watch.journal.closed and watch.journal.status == "stopped"  # the hook's end() closed it


def test_a_regulariser_whose_gradient_is_nan_is_a_backward_incident_of_the_variables_layer(
    tmp_path,
):
    rng = np.random.RandomState(2)
    kernel = rng.uniform(-1, 1, (3, 4)).astype("float32")
    kernel[1, 2] = 0.0  # d sqrt(|w|) / dw at 0: sign(0) * inf = NaN
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 3], name="x")
        with v1.variable_scope("encoder"):
            h = dense(x, 4, "dense1", tf.tanh, kernel=kernel)
        out = dense(h, 1, "head")
        with tf.name_scope("mse"):
            mse = tf.reduce_mean(tf.square(out))
        with tf.name_scope("regulariser"):
            w = [v for v in v1.trainable_variables() if v.name == "encoder/dense1/kernel:0"][0]
            reg = 1e-3 * tf.reduce_sum(tf.sqrt(tf.abs(w)))
        loss = mse + reg
        watch = GraphWatcher(str(tmp_path), loss)
        train_op = watch.minimize(v1.train.AdamOptimizer(0.01))
        init = v1.global_variables_initializer()
    feeds = [{x: rng.uniform(0, 1, (4, 3)).astype("float32")} for _ in range(3)]
    _train(graph, watch, train_op, feeds, init, loss)
    incident = watch.incident
    assert (incident["step"], incident["phase"], incident["kind"]) == (0, "backward", "nan")
    assert incident["layer"] == "encoder/dense1"
    assert incident["tensor"] == "gradient of encoder/dense1/kernel"
    # The forward pass and the loss were finite; the regulariser's own output gradient too.
    entries = watch.journal.schema.entries
    assert [e.layer for e in entries if e.kind == "grad_out"][0] == "regulariser"


def test_a_healthy_graph_run_records_every_step_and_the_report_reads_it(tmp_path):
    graph, features, target, loss = _log_graph()
    rng = np.random.RandomState(3)
    with graph.as_default():
        watch = GraphWatcher(str(tmp_path), loss, on_nonfinite="raise")
        train_op = watch.minimize(v1.train.AdamOptimizer(0.01))
        init = v1.global_variables_initializer()
    feeds = [
        {features: rng.uniform(0.5, 1.5, (4, 3)).astype("float32"), target: np.ones((4, 1))}
        for _ in range(5)
    ]
    _train(graph, watch, train_op, feeds, init, loss)
    assert watch.incident is None and watch.journal.steps == 5
    assert watch.journal.summary()["status"] == "finished"
    runs = report_json(tmp_path)
    assert runs[0]["steps"] == 5 and runs[0]["first_nonfinite"] is None


def test_graph_watcher_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="loss"):
        GraphWatcher(str(tmp_path), tf.constant(1.0))
    graph, _, _, loss = _log_graph()
    with pytest.raises(ValueError, match="on_nonfinite"):
        GraphWatcher(str(tmp_path), loss, on_nonfinite="explode")
    watch = GraphWatcher(str(tmp_path), loss)
    with graph.as_default(), pytest.raises(ValueError, match="optimizer"):
        watch.minimize(tf.keras.optimizers.Adam())


def test_the_seed003_tf1_demo_finds_the_backward_nan_with_tf1_behaviour(tmp_path):
    """The demo runs TF1 end to end (reference variables, TF1 control flow):
    its own process."""
    from demo import seed003_tf1_graph_autoencoder as demo  # noqa: PLC0415

    log_dir = tmp_path / "tf1"
    result = subprocess.run(
        [sys.executable, "-m", "demo.seed003_tf1_graph_autoencoder", str(log_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2"),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = report_json(log_dir)
    first = run["first_nonfinite"]
    keys = ("step", "phase", "layer", "kind")
    assert {k: first[k] for k in keys} == {k: demo.TRUTH[k] for k in keys}
    assert first.get("iterations") is None  # no global step: not "0" at step 13
    codes = [r.get("code") or "" for r in run["cause"]["remedies"]]
    assert not any("keras" in code for code in codes)  # no Keras model: no Keras snippet
    bundle = tb_nanwatch.load_bundle(str(log_dir))
    assert bundle.step == demo.ZERO_STEP and bundle.info["exact"]
    assert (bundle.x["p"][demo.ZERO_ROW] == 0).all() and np.isfinite(bundle.x["p"]).all()
    assert sorted(bundle.weights) == ["decoder/bias", "decoder/kernel", "encoder/kernel"]


def test_a_graph_without_a_global_step_says_no_iterations_and_no_keras_snippet(tmp_path, capfd):
    """No global step: the optimizer's iterations are not known (never "0" at step 6);
    no Keras model: no trial planned, no ``model.train_on_batch`` offered."""
    from types import SimpleNamespace  # noqa: PLC0415

    from tb_nanwatch.board import views  # noqa: PLC0415

    graph, features, target, loss = _log_graph()
    x, y = _log_batches()
    with graph.as_default():
        watch = GraphWatcher(str(tmp_path), loss)
        train_op = watch.minimize(v1.train.GradientDescentOptimizer(0.01))
        init = v1.global_variables_initializer()
    _train(graph, watch, train_op, [{features: b, target: y} for b in x], init, loss)
    incident = watch.incident
    assert incident["step"] == 6 and incident["iterations"] is None
    (run,) = report_json(tmp_path)
    assert run["first_nonfinite"].get("iterations") is None
    err = capfd.readouterr().err
    assert "train_on_batch" not in err
    assert "remedy_trials=False" not in err  # not the user's choice: a graph has no trials
    summary = watch.journal.summary()
    snippet = views.bundle_entry(SimpleNamespace(name=".", summary=summary))["snippet"]
    assert "train_on_batch" not in snippet and "model" not in snippet
    assert "feed_dict=feed" in snippet and "bundle.x.items()" in snippet
