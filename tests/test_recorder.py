"""The in-graph recorder: statistics that match an eager recomputation, the
device record's copies, the step graph (ops ordered, tensors let go of, our
scope) and the same diagnosis under the graph's variants."""

from __future__ import annotations

import re

import keras
import numpy as np
import pytest
import scenarios
import tensorflow as tf
from nanwatch_testlib import is_chunk_call, op_types_run, plain_mse_step, watched_mse_step
from scenarios import fit, origin

import tb_nanwatch


def test_math_is_bitwise_identical_with_and_without_the_watcher(tmp_path):
    def run(with_watch):
        keras.utils.set_random_seed(3)
        model, kwargs, _ = scenarios.healthy()
        losses = []
        record = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: losses.append(float(logs["loss"]))
        )
        callbacks = [record] + ([tb_nanwatch.NanWatch(str(tmp_path))] if with_watch else [])
        model.fit(**kwargs, epochs=2, callbacks=callbacks, verbose=0)
        # NanWatch builds the optimizer out of the first trace (see
        # train_step.build_out_of_the_trace): the same state all the same.
        return losses, [w.numpy() for w in model.weights + model.optimizer.variables]

    losses_a, weights_a = run(False)
    losses_b, weights_b = run(True)
    assert losses_a == losses_b
    for a, b in zip(weights_a, weights_b, strict=True):
        assert a.tobytes() == b.tobytes()


def test_on_suspect_copies_weights_only_in_steps_that_may_be_nonfinite(tmp_path):
    # Backward origin: input..backward is non-finite, so the pre-step copy is taken.
    _, watch, truth, _ = fit(
        scenarios.backward_sqrt_zero, tmp_path / "backward", pre_step_weights="on_suspect"
    )
    bundle = tb_nanwatch.load_bundle(str(tmp_path / "backward"))
    assert bundle.step == truth["step"] and bundle.info["exact"]
    assert bundle.info["weights_before_step"] == truth["step"]
    assert bundle.weights and all(np.isfinite(w).all() for w in bundle.weights.values())
    # Update origin: nothing looked suspect before the update, so no weights are claimed.
    _, watch, truth, _ = fit(
        scenarios.update_adam_eps0, tmp_path / "update", pre_step_weights="on_suspect"
    )
    bundle = tb_nanwatch.load_bundle(str(tmp_path / "update"))
    assert bundle.step == truth["step"]
    assert bundle.weights == {} and bundle.info["weights_before_step"] is None
    with pytest.raises(ValueError, match="no weights"):
        bundle.restore(scenarios.update_adam_eps0()[0])


@pytest.mark.parametrize("pre_step_weights", ["on_suspect", "every_step"])
@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_the_bundle_holds_the_weights_from_before_the_incident_step(
    jit_compile, pre_step_weights, tmp_path
):
    # The incident step's NaN gradients reach the weights through SGD, so
    # weights read after the step would be NaN.
    keras.utils.set_random_seed(0)
    model, kwargs, truth = scenarios.backward_sqrt_zero()
    model.compile(optimizer=model.optimizer, loss=model.loss, jit_compile=jit_compile)
    before = {}

    def keep(batch, logs):
        before[batch] = {v.path: v.numpy() for v in model.trainable_weights}

    watch = tb_nanwatch.NanWatch(str(tmp_path), pre_step_weights=pre_step_weights)
    callbacks = [keras.callbacks.LambdaCallback(on_train_batch_begin=keep), watch]
    model.fit(**kwargs, callbacks=callbacks, verbose=0)
    step = truth["step"]
    assert origin(watch.incident) == truth
    assert watch.journal.summary()["jit_compile"] == jit_compile
    assert not all(np.isfinite(v.numpy()).all() for v in model.trainable_weights)
    bundle = tb_nanwatch.load_bundle(str(tmp_path))
    assert bundle.info["weights_before_step"] == step and bundle.info["exact"]
    assert sorted(bundle.weights) == sorted(before[step])
    for path, value in bundle.weights.items():
        np.testing.assert_array_equal(value, before[step][path])


def _copied_outside_loop_bodies(optimized_hlo: str) -> int:
    """Elements copied by ``copy`` instructions of a compiled XLA step,
    scalars aside, outside the bodies of its while loops (which a healthy
    step of NanWatch's never enters); both branches of a conditional count."""
    bodies = set(re.findall(r"body=%([\w.\-]+)", optimized_hlo))
    copied = 0
    for computation in re.split(r"\n(?=%|ENTRY)", optimized_hlo):
        if computation.split()[0].lstrip("%") in bodies:
            continue
        for dims in re.findall(r"= \w+\[([0-9,]*)\]\{[^}]*\} copy\(", computation):
            elements = int(np.prod([int(d) for d in dims.split(",") if d]))
            copied += elements if elements > 1 else 0
    return copied


@pytest.mark.filterwarnings("error::RuntimeWarning")  # the watcher's own failure warns
@pytest.mark.parametrize("pre_step_weights", ["on_suspect", "every_step", "off"])
def test_a_healthy_xla_step_copies_nothing_for_the_pre_step_copy_or_the_batch_stash(
    tmp_path, pre_step_weights
):
    # As a conditional, the copy (and the stash) made XLA copy every weight
    # it might copy on every step, and every weight that it reads and the
    # update then writes in place: the watched step copied more than the
    # step alone. As a loop run zero times or once, with the update waiting
    # for it, nothing is copied until an incident.
    from tb_nanwatch.record.stats.backend import in_xla

    x, y = tf.ones((8, 8)), tf.ones((8, 1))
    traced_in_xla = []

    def model_and_optimizer():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
        )
        return model, keras.optimizers.SGD(0.01)

    model, optimizer = model_and_optimizer()

    plain_step = plain_mse_step(model, optimizer, jit_compile=True)
    plain_step(x, y)
    plain = plain_step.experimental_get_compiler_ir(x, y)(stage="optimized_hlo")

    model, optimizer = model_and_optimizer()
    watcher = tb_nanwatch.StepWatcher(
        str(tmp_path), model, optimizer, pre_step_weights=pre_step_weights
    )
    train_step = watched_mse_step(
        watcher,
        model,
        optimizer,
        jit_compile=True,
        on_trace=lambda: traced_in_xla.append(in_xla()),
    )
    train_step(x, y)
    assert watcher.end_step() is False
    watcher.close()
    watched = train_step.experimental_get_compiler_ir(x, y)(stage="optimized_hlo")
    assert traced_in_xla and all(traced_in_xla)
    loops = 1 if pre_step_weights == "off" else 2  # the stash, and the copy
    assert watched.count(" while(") == loops
    assert _copied_outside_loop_bodies(watched) <= _copied_outside_loop_bodies(plain)


def test_recorded_statistics_match_an_eager_recomputation(tmp_path):
    """Step 0's vector against the same numbers computed eagerly, one by one."""
    keras.utils.set_random_seed(0)
    model, kwargs, _ = scenarios.healthy()
    x0 = kwargs["x"][: scenarios.BATCH]
    y0 = kwargs["y"][: scenarios.BATCH]
    names = _layer_names(model)
    probe = keras.Model(model.inputs[0], [model.get_layer(n).output for n in names])
    with tf.GradientTape() as tape:
        outs = probe(x0, training=True)
        loss = model.compute_loss(x=x0, y=y0, y_pred=outs[-1])
    grads = tape.gradient(loss, model.trainable_weights)
    expected_acts = {n: o.numpy() for n, o in zip(names, outs, strict=True)}

    watch = tb_nanwatch.NanWatch(str(tmp_path), window=64)  # the whole run
    model.fit(**kwargs, epochs=1, callbacks=[watch], verbose=0)
    steps, window = watch.journal.flight_window()
    assert steps[0] == 0
    schema, vector = watch.journal.schema, window[0]

    header = schema.values(vector, schema.header())
    assert header["loss"] == pytest.approx(float(loss), rel=1e-5)
    expected_norm = np.sqrt(sum(float(np.sum(g.numpy() ** 2)) for g in grads))
    assert header["grad_norm"] == pytest.approx(expected_norm, rel=1e-4)
    for entry in schema.find(kind="activation"):
        got = schema.values(vector, entry)
        want = expected_acts[entry.layer]
        assert (got["min"], got["max"]) == pytest.approx((want.min(), want.max()), rel=1e-5)
        assert got["nan"] == got["inf"] == 0
    by_path = {v.path: g.numpy() for v, g in zip(model.trainable_weights, grads, strict=True)}
    grad_vars = schema.find(kind="grad_var")
    assert len(grad_vars) == len(by_path)
    for entry in grad_vars:
        path = entry.tensor.removeprefix("gradient of ")
        want = float(np.linalg.norm(by_path[path]))
        assert schema.values(vector, entry)["norm"] == pytest.approx(want, rel=1e-4)


def _layer_names(model):
    return [layer.name for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]


def test_input_gradient_only_where_it_can_reach_a_weight(tmp_path):
    # dense_0 is fed by the batch itself: no weight is upstream of its input, so
    # the gradient w.r.t. that input (an extra backward matmul) is not asked for.
    _, watch, _, _ = fit(scenarios.healthy, tmp_path)
    grad_in = [e.layer for e in watch.journal.schema.find(kind="grad_in")]
    assert grad_in == ["head", "dense_2", "dense_1"]


def test_a_healthy_run_copies_no_batch_and_no_weights(tmp_path):
    _, watch, _, _ = fit(scenarios.healthy, tmp_path / "default")
    assert watch._recorder.device.stashed_steps() == (None, None)
    _, watch, _, _ = fit(scenarios.healthy, tmp_path / "every", pre_step_weights="every_step")
    last = watch.journal.steps - 1
    assert watch._recorder.device.stashed_steps() == (None, last)


def test_every_step_copy_gives_an_exact_update_phase_bundle(tmp_path):
    _, watch, truth, _ = fit(scenarios.update_adam_eps0, tmp_path, pre_step_weights="every_step")
    bundle = tb_nanwatch.load_bundle(str(tmp_path))
    assert bundle.step == truth["step"] and bundle.info["exact"]
    assert bundle.info["weights_before_step"] == truth["step"]
    assert bundle.weights and all(np.isfinite(w).all() for w in bundle.weights.values())


@pytest.mark.parametrize(
    "build", [scenarios.forward_log_negative, scenarios.input_nan], ids=lambda b: b.__name__
)
def test_same_diagnosis_where_min_and_max_may_drop_nan(build, tmp_path, monkeypatch):
    # On a device whose min/max ignore NaN the activations' trigger is their sum.
    from tb_nanwatch.record.stats.graph import GraphStats

    monkeypatch.setattr(GraphStats, "minmax_propagates_nan", False)
    _, watch, truth, _ = fit(build, tmp_path)
    assert origin(watch.incident) == truth


def test_our_readers_run_before_the_steps_own_consumers():
    from tb_nanwatch.record.in_step import phase_stats

    ops = {}

    @tf.function
    def step(x):
        g = x * 2.0
        theirs = tf.nn.relu(g)
        with tf.name_scope(phase_stats.STATS_SCOPE):
            ours = tf.reduce_sum(g)
        phase_stats.readers_first([g])
        ops.update(theirs=theirs.op, ours=ours.op)
        return theirs, ours

    theirs, ours = step(tf.constant([1.0, -2.0, 3.0]))
    assert ops["ours"] in ops["theirs"].control_inputs
    assert ops["theirs"] not in ops["ours"].control_inputs
    np.testing.assert_array_equal(theirs.numpy(), [2.0, 0.0, 6.0])
    assert float(ours) == 4.0


def test_held_if_non_finite_lets_go_of_a_healthy_tensor():
    from tb_nanwatch.record.stats import lazy_counts
    from tb_nanwatch.record.stats.graph import GraphStats

    @tf.function
    def held(x):
        return GraphStats().held_if_non_finite(x, tf.reduce_sum(x))

    size = lazy_counts.HOLD_MIN_ELEMENTS
    assert held(tf.ones([size])).shape == (0,)
    bad = np.ones(size, np.float32)
    bad[[3, 7]] = [np.nan, np.inf]
    np.testing.assert_array_equal(held(tf.constant(bad)).numpy(), bad)
    small = tf.ones([size - 1])  # kept as it is: cheaper than letting it go
    np.testing.assert_array_equal(held(small).numpy(), small.numpy())


@pytest.mark.parametrize("build", scenarios.ORIGIN_CASES, ids=lambda b: b.__name__)
def test_same_diagnosis_when_every_tensor_is_let_go_of(build, tmp_path, monkeypatch):
    # These scenarios' tensors are small, so by default the counts read them
    # directly; here every one goes through held_if_non_finite.
    from tb_nanwatch.record.stats import lazy_counts

    monkeypatch.setattr(lazy_counts, "HOLD_MIN_ELEMENTS", 0)
    _, watch, truth, _ = fit(build, tmp_path)
    assert origin(watch.incident) == truth


@pytest.mark.parametrize("jit_compile", [False, True])
def test_no_activation_or_gradient_waits_for_the_end_of_step_cond(
    jit_compile, monkeypatch, tmp_path
):
    # The exact NaN/Inf counts run in a cond at the end of the step. A watched
    # activation or gradient fed to it directly would stay in memory until
    # then, and ReluGrad and the optimizer could no longer write into it.
    # Under XLA no conditional takes them at all: their counts are results of
    # the reduction that takes their statistic (XlaStats.counted_in_pass).
    from tb_nanwatch.record.in_step import phase_stats

    keras.utils.set_random_seed(0)
    from tb_nanwatch.record.stats import lazy_counts
    from tb_nanwatch.record.stats.backend import in_xla

    monkeypatch.setattr(lazy_counts, "XLA_MAX_CONDITIONALS", 1000)  # one entry a conditional
    # Tensors large enough to be let go of (see HOLD_MIN_ELEMENTS), and a few small ones.
    width = lazy_counts.HOLD_MIN_ELEMENTS // 8
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    optimizer = keras.optimizers.Adam(1e-3)
    watcher = tb_nanwatch.StepWatcher(str(tmp_path), model, optimizer)
    conds, traced_in_xla, types = [], [], set()

    def look():
        traced_in_xla.append(in_xla())
        graph = tf.compat.v1.get_default_graph()
        conds.extend(op for op in graph.get_operations() if _is_our_conditional(op))
        types.update(op_types_run(graph))

    train_step = watched_mse_step(watcher, model, optimizer, jit_compile, on_trace=look)
    train_step(tf.ones((8, 8)), tf.ones((8, 1)))
    watcher.end_step()
    watcher.close()
    assert set(traced_in_xla) == {jit_compile}

    def large_outside(op) -> list:
        # From outside our statistics: not variables, not the step's own
        # arguments (the batch), not tensors too small to be worth letting go of.
        return [
            t
            for t in op.inputs[1:]
            if not phase_stats.is_ours(t.op)
            and t.op.type != "Placeholder"
            and not (t.shape.num_elements() or 0) < lazy_counts.HOLD_MIN_ELEMENTS
        ]

    assert [t.name for op in conds for t in large_outside(op)] == []
    if jit_compile:
        assert "XlaVariadicReduceV2" in types  # statistics and counts in one pass
        return
    inputs = [t for op in conds for t in op.inputs]
    assert sum(t.op.type == "Slice" for t in inputs) >= 4  # the large ones, let go of


def _is_our_conditional(op) -> bool:
    """A conditional of the statistics, or a call of an XLA chunk's conditional
    (whose first input is the chunk's first trigger); not a conditional on a
    constant, which only shares a function's lowering and which XLA takes away."""
    from tb_nanwatch.record.in_step import phase_stats

    if op.type in ("If", "StatelessIf") and op.inputs[0].op.type == "Const":
        return False  # a function lowered once for XLA (XlaStats._lowered_once), not a branch
    return phase_stats.is_ours(op) and (op.type in ("If", "StatelessIf") or is_chunk_call(op))


def _ancestors(op, limit: int = 500) -> set:
    seen, frontier = set(), [op]
    while frontier and len(seen) < limit:
        op = frontier.pop()
        for t in op.inputs:
            if t.op not in seen:
                seen.add(t.op)
                frontier.append(t.op)
    return seen


def test_rare_cond_stays_a_functional_if_and_takes_either_branch():
    from tb_nanwatch.record.stats.graph import GraphStats

    ifs = []

    @tf.function
    def pick(flag, x):
        out = GraphStats().rare_cond(flag, lambda: tf.reduce_sum(x), lambda: tf.constant(-1.0))
        graph = tf.compat.v1.get_default_graph()
        ifs.extend(op for op in graph.get_operations() if op.type in ("If", "StatelessIf"))
        return out

    x = tf.constant([1.0, 2.0])
    assert float(pick(tf.constant(True), x)) == 3.0
    assert float(pick(tf.constant(False), x)) == -1.0
    assert ifs and all(op.get_attr("_lower_using_switch_merge") is False for op in ifs)


def test_fit_hands_the_row_over_with_the_step_outputs(tmp_path, monkeypatch):
    from tb_nanwatch.record.in_step import device_record

    reads = []
    read = device_record._read
    monkeypatch.setattr(device_record, "_read", lambda var: reads.append(1) or read(var))
    _, watch, _, history = fit(scenarios.healthy, tmp_path)
    assert watch.journal.steps == 60
    assert reads == []  # no separate read of the device buffer
    assert set(history.history) == {"loss"}  # the row never reaches the logs


@pytest.mark.parametrize(
    "name, ours",
    [
        ("nanwatch_stats/Sum", True),
        ("nanwatch_stats_1/cond", True),  # the scope opened a second time
        ("replica_1/nanwatch_stats_2/L2Loss", True),
        ("dense/MatMul", False),
        ("my_nanwatch_stats/Sum", False),
        ("nanwatch_statsx/Sum", False),
    ],
)
def test_our_ops_are_told_apart_by_their_scope(name, ours):
    from types import SimpleNamespace

    from tb_nanwatch.record.in_step import phase_stats

    assert phase_stats.is_ours(SimpleNamespace(name=name)) is ours
