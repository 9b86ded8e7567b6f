"""What the first step and the record promise: the first trace is the one
that runs, its statistics built once with the backend of its kind (graph or
XLA), exact counts, weight copies and batch stash empty until needed, and
XLA's step free of what would make it compile or copy more. What the step
costs is measured by the benchmark (bench/), not here."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import scenarios
import tensorflow as tf
from nanwatch_testlib import is_chunk_call, op_types_run, traced_graphs, watched_mse_step
from scenarios import fit, origin

import tb_nanwatch
from tb_nanwatch.record.in_step import step_vector
from tb_nanwatch.record.stats import choose, lazy_counts
from tb_nanwatch.record.stats.backend import in_xla
from tb_nanwatch.record.stats.choose import for_current_graph
from tb_nanwatch.record.stats.graph import GraphStats
from tb_nanwatch.record.stats.xla import TakenExtreme, XlaStats

# Ops tf2xla lowers through an MLIR pipeline of their own, one op at a time.
MLIR_LOWERED = {"IsNan", "IsInf", "IsFinite"}


def _count_builders(monkeypatch) -> dict:
    built = {"values": 0, "schema_only": 0}
    for cls, key in (
        (step_vector.StatsBuilder, "values"),
        (step_vector.SchemaOnlyBuilder, "schema_only"),
    ):
        init = cls.__init__

        def counted(self, stats, _init=init, _key=key):
            built[_key] += 1
            _init(self, stats)

        monkeypatch.setattr(cls, "__init__", counted)
    return built


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize(
    "built_by",
    ["its first update", "its first update, with metrics", "optimizer.build", "an earlier fit"],
)
def test_the_first_trace_is_the_one_that_runs(built_by, jit_compile, monkeypatch, tmp_path):
    # Nothing of Keras' is created in the first trace: the optimizer was
    # built before fit (a second fit, a loaded model) or, where Keras would
    # build it (and the compiled metrics) in the first trace, NanWatch built
    # it out of the trace's sight. tf.function runs that trace, so it is
    # built in full, once.
    keras.utils.set_random_seed(0)
    model, kwargs, truth = scenarios.backward_sqrt_zero()
    metrics = ["mae"] if "metrics" in built_by else None
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3), loss="mse", metrics=metrics, jit_compile=jit_compile
    )
    if built_by == "optimizer.build":
        model.optimizer.build(model.trainable_variables)
    elif built_by == "an earlier fit":  # the steps before the all-zero row: healthy
        rows = slice(0, 2 * scenarios.BATCH)
        model.fit(**{**kwargs, "x": kwargs["x"][rows], "y": kwargs["y"][rows]}, verbose=0)
    built = _count_builders(monkeypatch)
    watch = tb_nanwatch.NanWatch(str(tmp_path))
    with traced_graphs() as graphs:
        history = model.fit(**kwargs, epochs=1, callbacks=[watch], verbose=0)
    assert len(graphs) == 1 and built == {"values": 1, "schema_only": 0}
    assert origin(watch.incident) == truth
    assert watch.journal.steps == truth["step"] + 1  # every step recorded, the first too
    assert ("mae" in history.history) == bool(metrics)
    assert len(model.optimizer.variables) == 2 + 2 * len(model.trainable_variables)  # Adam's
    assert watch.journal.run_info["jit_compile"] is jit_compile
    assert model.jit_compile is jit_compile  # XLA really stayed on


@pytest.mark.parametrize("jit_compile", [False, True])
def test_each_step_build_chooses_its_statistics_backend_once(jit_compile, monkeypatch, tmp_path):
    # The step's kind (XLA or not) is decided once, when the step is built,
    # and the backend holds that build's caches: nothing hangs on TensorFlow's
    # tensors.
    chosen = []
    original = choose.for_current_graph

    def recorded(facts=None):
        chosen.append(original(facts))
        return chosen[-1]

    monkeypatch.setattr(choose, "for_current_graph", recorded)
    keras.utils.set_random_seed(0)
    model, kwargs, truth = scenarios.backward_sqrt_zero()
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse", jit_compile=jit_compile)
    watch = tb_nanwatch.NanWatch(str(tmp_path))
    with traced_graphs() as graphs:
        model.fit(**kwargs, epochs=1, callbacks=[watch], verbose=0)
    assert [type(s) for s in chosen] == [XlaStats if jit_compile else GraphStats] * len(graphs)
    assert watch.journal.run_info["jit_compile"] is jit_compile  # Keras kept (or left) XLA
    assert origin(watch.incident) == truth
    tagged = [
        t.name
        for graph in graphs
        for op in graph.get_operations()
        for t in op.outputs
        if any(k.startswith("_nanwatch") for k in getattr(t, "__dict__", {}))
    ]
    assert tagged == []


def _sqrt_zero_layers_unbuilt(jit_compile: bool):
    """``backward_sqrt_zero``'s layers in a Sequential with no Input: Keras
    builds them in the first trace."""
    _, kwargs, truth = scenarios.backward_sqrt_zero()
    model = keras.Sequential(
        [
            keras.layers.Dense(4, use_bias=False, name="encode"),
            scenarios.Norm(name="norm"),
            keras.layers.Dense(1, name="head"),
        ]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=jit_compile)
    return model, kwargs, truth


class _StateAtFirstCall(keras.layers.Layer):
    """A built layer that creates a variable at its first call (in the trace)."""

    state = None

    def call(self, x):
        if self.state is None:
            self.state = tf.Variable(0.0, trainable=False)
        self.state.assign_add(1.0)
        return x

    def compute_output_shape(self, input_shape):
        return input_shape


def _sqrt_zero_state_at_first_call(jit_compile: bool):
    """``backward_sqrt_zero`` with a layer that creates a variable in the first trace."""
    model, kwargs, truth = scenarios.backward_sqrt_zero()
    inputs = keras.Input((3,), name="x")
    model = keras.Model(inputs, model(_StateAtFirstCall(name="state")(inputs)))
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=jit_compile)
    return model, kwargs, {**truth, "layer": "backward_case/" + truth["layer"]}


@pytest.mark.parametrize("jit_compile", [False, True])
@pytest.mark.parametrize("unbuilt", ["layers", "a layer's state"])
def test_a_first_trace_that_creates_variables_builds_no_statistics(
    unbuilt, jit_compile, monkeypatch, tmp_path
):
    # Layers built in the first trace, or a layer's own state created there,
    # create variables in it, so tf.function traces the step again and runs
    # only the second trace: the first builds only the entries.
    keras.utils.set_random_seed(0)
    if unbuilt == "layers":
        model, kwargs, truth = _sqrt_zero_layers_unbuilt(jit_compile)
    else:
        model, kwargs, truth = _sqrt_zero_state_at_first_call(jit_compile)
    built = _count_builders(monkeypatch)
    watch = tb_nanwatch.NanWatch(str(tmp_path))
    with traced_graphs() as graphs:
        model.fit(**kwargs, epochs=1, callbacks=[watch], verbose=0)
    assert len(graphs) == 2 and built == {"values": 1, "schema_only": 1}
    assert origin(watch.incident) == truth
    assert watch.journal.steps == truth["step"] + 1
    assert watch.journal.run_info["jit_compile"] is jit_compile
    assert model.jit_compile is jit_compile  # XLA really stayed on


@pytest.mark.parametrize("optimizer_built", [False, True])
def test_a_custom_loop_step_is_traced_once_when_its_optimizer_is_built(optimizer_built, tmp_path):
    keras.utils.set_random_seed(0)
    model, kwargs, truth = scenarios.backward_sqrt_zero()
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
    if optimizer_built:
        optimizer.build(model.trainable_variables)
    watcher = tb_nanwatch.StepWatcher(str(tmp_path), model, optimizer)
    traces = []

    @tf.function
    def step(x, y):
        traces.append(tf.compat.v1.get_default_graph())
        with tf.GradientTape() as tape, watcher.forward(tape, x, y) as rec:
            loss = rec.loss(tf.reduce_mean((model(x, training=True) - y) ** 2))
        grads = rec.gradients(tape.gradient(loss, rec.sources(model.trainable_variables)))
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        rec.after_update()

    x, y = kwargs["x"], kwargs["y"]
    for start in range(0, len(x), scenarios.BATCH):
        step(x[start : start + scenarios.BATCH], y[start : start + scenarios.BATCH])
        if watcher.end_step():
            break
    watcher.close()
    assert len(traces) == (1 if optimizer_built else 2)
    assert origin(watcher.incident) == truth
    assert watcher.journal.steps == truth["step"] + 1


def test_an_eager_step_records_from_its_first_step(monkeypatch, tmp_path):
    built = _count_builders(monkeypatch)
    _, watch, truth, _ = fit(
        scenarios.backward_sqrt_zero, tmp_path, compile_kwargs={"run_eagerly": True}
    )
    assert built["schema_only"] == 0 and built["values"] == truth["step"] + 1
    assert origin(watch.incident) == truth


def test_weight_copies_and_batch_stash_hold_nothing_on_a_healthy_run(tmp_path):
    _, watch, _, _ = fit(scenarios.healthy_small, tmp_path / "healthy")
    device = watch._recorder.device
    assert watch.incident is None
    assert all(v.numpy().size == 0 for v in device._pre_step_copies)
    assert all(var.numpy().size == 0 for var, _ in device._batch_stash)
    assert device.pre_step_state()[0] == []


def test_weight_copies_and_batch_stash_are_full_at_an_incident(tmp_path):
    model, watch, truth, _ = fit(scenarios.backward_sqrt_zero, tmp_path)
    weights, batch, _ = watch._recorder.device.pre_step_state()
    assert [w.shape for w in weights] == [tuple(v.shape) for v in model.trainable_weights]
    assert batch[0].shape[0] == scenarios.BATCH
    assert watch._recorder.device.stashed_steps() == (truth["step"], truth["step"])


def _counts_in_graph(tensors: list[np.ndarray], jit_compile: bool, held: tuple = ()) -> np.ndarray:
    """The exact counts of ``tensors`` built in a graph (under XLA, in the
    conditionals XLA uses, taken on a non-finite trigger); the sources at the
    indices ``held`` are first held on that trigger (their size is then known
    only when the counts run)."""
    traced_in_xla = []

    @tf.function(jit_compile=jit_compile)
    def counts(nonfinite, *values):
        traced_in_xla.append(in_xla())
        stats = for_current_graph()
        values = [
            stats.held_if_non_finite(v, nonfinite) if i in held else v for i, v in enumerate(values)
        ]
        lazies = []
        for v in values:
            lazies += [lazy_counts.LazyCount(kind, (v,), nonfinite) for kind in ("nan", "inf")]
        # An entry of two sources, as a layer with two outputs gives.
        lazies.append(lazy_counts.LazyCount("nan", tuple(values[:2]), nonfinite))
        if in_xla():  # XLA counts in conditionals on the triggers
            return stats.counts_in_chunks(lazies)
        return stats.exact_counts(lazies)

    out = counts(tf.constant(float("nan")), *[tf.constant(t) for t in tensors]).numpy()
    assert traced_in_xla == [jit_compile]  # the XLA path really was the one built
    return out


@pytest.mark.parametrize("jit_compile", [False, True])
def test_exact_counts_match_numpy_for_every_tensor(jit_compile):
    rng = np.random.default_rng(3)
    tensors = [
        rng.standard_normal((4, 5)).astype("float32"),
        np.array([], "float32"),
        rng.standard_normal((3, 2, 2)).astype("float16"),
        rng.standard_normal(7).astype("float32"),
        np.array(2.0, "float32"),
    ]
    tensors[0][1, 2] = tensors[0][3, 0] = np.nan
    tensors[0][0, 0] = np.inf
    tensors[2][0, 1, 1] = -np.inf
    tensors[3][6] = np.nan
    want = []
    for t in tensors:
        want += [np.isnan(t).sum(), np.isinf(t).sum()]
    want.append(np.isnan(tensors[0]).sum() + np.isnan(tensors[1]).sum())
    np.testing.assert_array_equal(_counts_in_graph(tensors, jit_compile), want)


def test_exact_counts_of_held_sources_match_numpy(monkeypatch):
    # Held sources have no static size: the branch measures theirs and
    # takes the others' from the graph.
    monkeypatch.setattr(lazy_counts, "HOLD_MIN_ELEMENTS", 0)
    tensors = [
        # NaN/Inf next to the sources' boundaries: a size off by one shows.
        np.array([[1.0, 2.0], [np.inf, np.nan]], "float32"),
        np.array([np.inf, np.nan, 3.0], "float32"),
        np.array([-np.inf, 1.0, np.nan, 4.0, 5.0], "float32"),
    ]
    want = []
    for t in tensors:
        want += [np.isnan(t).sum(), np.isinf(t).sum()]
    want.append(np.isnan(tensors[0]).sum() + np.isnan(tensors[1]).sum())
    np.testing.assert_array_equal(_counts_in_graph(tensors, False, held=(0, 2)), want)


def _one_watched_step(tmp_path, model, optimizer, jit_compile: bool = False):
    """One step of a custom loop watched by a StepWatcher: the graph it traced
    and whether XLA compiled it."""
    watcher = tb_nanwatch.StepWatcher(str(tmp_path), model, optimizer)
    traced = []

    def look():
        traced.append((tf.compat.v1.get_default_graph(), in_xla()))

    train_step = watched_mse_step(watcher, model, optimizer, jit_compile, on_trace=look)
    train_step(tf.ones((4, 8)), tf.ones((4, 1)))
    watcher.end_step()
    watcher.close()
    return traced[-1]


def test_no_addn_of_more_than_two_inputs_in_the_step_graph(tmp_path):
    # Grappler's memory optimizer simulates the whole step's memory for each
    # AddN of more than two inputs, and rewrites some into a temporary
    # variable with one AssignAdd per input (seconds on a ResNet50).

    from tb_nanwatch.record.in_step import phase_stats

    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    left = keras.layers.Dense(8, activation="relu")(inputs)
    right = keras.layers.Dense(8, activation="tanh")(inputs)
    merged = keras.layers.Add()([left, right, inputs])
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Dense(8)(merged)))
    graph, _ = _one_watched_step(tmp_path, model, keras.optimizers.Adam(1e-3))
    ours = [op for op in graph.get_operations() if phase_stats.is_ours(op)]
    assert len(model.trainable_variables) > 2  # so the gradient norm sums more than two
    assert any(op.type == "L2Loss" for op in ours)  # the statistics were built
    wide = [op.name for op in ours if op.type in ("AddN", "AccumulateNV2") and len(op.inputs) > 2]
    assert not wide, wide


def test_the_xla_step_has_no_op_lowered_through_mlir_one_at_a_time(tmp_path):

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(8, "relu"), keras.layers.Dense(1)]
    )
    graph, xla = _one_watched_step(tmp_path, model, keras.optimizers.SGD(0.1), jit_compile=True)
    graph_def = graph.as_graph_def()
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    types = {n.op for n in nodes}
    assert xla and "XlaVariadicReduceV2" in types  # the statistics and counts were built
    assert not types & MLIR_LOWERED


@pytest.mark.parametrize("poison", [None, np.nan, np.inf])
@pytest.mark.parametrize(
    ("shape", "by_rows"),
    [((64, 256), True), ((16, 64, 20), True), ((129, 129), False), ((12,), False)],
)
def test_gradient_norms_under_xla_on_a_cpu_sum_rows_first(shape, by_rows, poison):
    # XLA's CPU backend writes out x*x before a large reduction; summed by
    # rows of 4 first, only a quarter of it is written. Same value, same NaN/Inf.
    # A size that is not a multiple of 4, or a small tensor, keeps L2Loss.
    x = np.random.default_rng(0).standard_normal(shape).astype("float32")
    if poison is not None:
        x.flat[x.size // 2] = poison
    built = []

    @tf.function(jit_compile=True)
    def norms(t):
        stats = for_current_graph()
        built.append(type(stats))
        return stats.half_sum_squares(t)

    got = float(norms(tf.constant(x)))
    want = 0.5 * float(np.sum(x.astype("float64") ** 2))
    np.testing.assert_allclose(got, want, rtol=1e-5)  # NaN equals NaN, Inf equals Inf
    assert built == [XlaStats]  # the step was built for XLA


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("jit_compile", [False, True])
def test_non_finite_tests_agree_with_numpy_in_and_out_of_xla(jit_compile, dtype):
    # Under XLA they are comparisons (tf2xla lowers IsNan, IsInf and IsFinite
    # through MLIR one op at a time, seconds of a first step).
    big = float(tf.as_dtype(dtype).max)
    tiny = 1e-40  # subnormal in float32 and bfloat16, 0 in float16
    values = [np.nan, -np.nan, np.inf, -np.inf, big, -big, 0.0, -0.0, 1.0, -2.5, tiny]
    x = tf.cast(tf.constant(values, tf.float64), dtype)
    seen = []

    @tf.function(jit_compile=jit_compile)
    def tests(t):
        seen.append(in_xla())
        stats = for_current_graph()
        graph = tf.compat.v1.get_default_graph()
        out = [stats.is_nan(t), stats.is_inf(t), stats.is_finite(t)]
        seen.append(sorted({op.type for op in graph.get_operations()} & MLIR_LOWERED))
        return out

    got = [g.numpy().tolist() for g in tests(x)]
    as_float = np.array(values, np.float64)
    want = [np.isnan(as_float), np.isinf(as_float), np.isfinite(as_float)]
    assert got == [w.tolist() for w in want]
    assert seen == [jit_compile, [] if jit_compile else ["IsFinite", "IsInf", "IsNan"]]


def _min_max_cases(dtype: str) -> list[np.ndarray]:
    big = float(tf.as_dtype(dtype).max)
    cases = [
        [1.0, -2.5, 3.0],
        [-3.0, -7.0],
        [5.0],
        [-0.0, 0.0],
        [big, -big],
        [-np.inf, np.inf],
        [np.nan, np.inf, -np.inf],
    ]
    values = np.random.default_rng(0).normal(size=4099) * 100
    for where in (0, 2049, 4098):
        for bad in (np.nan, -np.nan, np.inf, -np.inf):
            poisoned = values.copy()
            poisoned[where] = bad
            cases.append(poisoned)
    return [np.asarray(c, np.float64) for c in cases]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("jit_compile", [False, True])
def test_min_and_max_agree_with_numpy_in_and_out_of_xla(jit_compile, dtype):
    # Under XLA both come from one pass over the floats' bits as ordered
    # integers (a NaN of either sign must reach one of them); both are NaN
    # whenever the tensor holds a NaN, as TensorFlow's own min and max.
    # XlaVariadicReduceV2 has no kernel outside XLA: that it ran proves XLA did.
    reductions = []

    def low_high(t):
        out = tf.stack(for_current_graph().low_high(t))
        graph = tf.compat.v1.get_default_graph()
        kinds = ("Min", "Max", "XlaVariadicReduceV2")
        reductions.append(tuple(sorted(t for t in op_types_run(graph) if t in kinds)))
        return out

    traced = {}  # one function a shape
    for values in _min_max_cases(dtype):
        x = tf.cast(tf.constant(values), dtype)
        reshaped = tf.reshape(x, [-1, 1]) if len(values) % 2 else x  # ranks 1 and 2
        if reshaped.shape not in traced:
            traced[reshaped.shape] = tf.function(low_high, jit_compile=jit_compile, autograph=False)
        got = traced[reshaped.shape](reshaped).numpy()
        exact = x.numpy().astype(np.float64)
        want = [np.nan] * 2 if np.isnan(exact).any() else [exact.min(), exact.max()]
        np.testing.assert_array_equal(got, np.array(want, np.float32), err_msg=str(values[:4]))
    assert set(reductions) == {("XlaVariadicReduceV2",) if jit_compile else ("Max", "Min")}


@pytest.mark.parametrize("poison", [np.nan, -np.nan, np.inf])
@pytest.mark.parametrize("jit_compile", [False, True])
def test_an_entry_of_several_tensors_sees_a_non_finite_value_in_any_of_them(jit_compile, poison):
    # Its min and max are the min and max of the tensors' own, which XLA's float
    # min and max may take without a NaN: neither its trigger (outside XLA) nor
    # its counts (under XLA, taken with each tensor's own min and max) may
    # depend on them.
    finite = tf.constant(np.arange(6, dtype="float32").reshape(2, 3))
    poisoned = tf.constant(np.array([1.0, poison, 2.0, 3.0], "float32"))

    @tf.function(jit_compile=jit_compile, autograph=False)
    def seen(a, b):
        stats = for_current_graph()
        fields = stats.tensor_fields([a, b])
        if isinstance(fields["nan"], lazy_counts.LazyCount):
            assert not jit_compile
            return fields["nan"].trigger
        assert jit_compile
        counts = [stats.exact(fields[kind]) for kind in lazy_counts.KINDS]
        return tf.stack([fields["min"], fields["max"], *counts])

    got, clean = seen(finite, poisoned).numpy(), seen(finite, finite[0]).numpy()
    assert not np.isfinite(got).all() and np.isfinite(clean).all()
    if jit_compile:
        np.testing.assert_array_equal(got[2:], [np.isnan(poison), np.isinf(poison)])
        np.testing.assert_array_equal(clean, [0.0, 5.0, 0.0, 0.0])


@pytest.mark.parametrize(("jit_compile", "packed_max"), [(False, 2**32), (True, 2**32), (True, 5)])
def test_counts_of_tensors_the_step_frees_are_exact(jit_compile, packed_max, monkeypatch):
    # Outside XLA they are held and counted at the end of the step; under XLA
    # a few entries at a time (here 2), each chunk in a conditional of its own,
    # entries of packed_max elements or more one kind at a time.
    monkeypatch.setattr(lazy_counts, "HOLD_MIN_ELEMENTS", 4)
    monkeypatch.setattr(lazy_counts, "PACKED_MAX_ELEMENTS", packed_max)
    monkeypatch.setattr(lazy_counts, "XLA_MAX_CONDITIONALS", 2)  # 4 entries: 2 a chunk
    entries = [
        [np.array([[np.nan, 1.0], [np.inf, -np.inf]], "float32")],
        [np.arange(6, dtype="float32"), np.array([np.nan, 2.0, 3.0, 4.0], "float32")],
        [np.arange(4, dtype="float32")],  # finite, packed after an entry that is not
        [np.array([np.inf, np.nan, np.inf, np.inf], "float16")],
        [np.array([np.nan, 1.0], "float32")],  # too small to let go of: counted at the end
    ]
    built, conditionals = [], []

    @tf.function(jit_compile=jit_compile)
    def counts(*flat):
        stats = for_current_graph()
        values, lazies = list(flat), []
        for entry in entries:
            sources = [values.pop(0) for _ in entry]
            trigger = tf.add_n([tf.reduce_sum(tf.cast(s, tf.float32)) for s in sources])
            fields = stats.transient_counts_of(sources, trigger)
            lazies += [fields[kind] for kind in lazy_counts.KINDS]
        built.append((in_xla(), [c.transient for c in lazies[::2]]))
        if not in_xla():
            return stats.exact_counts(lazies)
        # Chunks never span two phases: [0], [1, 2], [3], then the small one.
        phases = [p for p in "abbbc" for _ in lazy_counts.KINDS]
        out = stats.counts_in_chunks(lazies, phases)
        conditionals.extend(_chunk_calls(tf.compat.v1.get_default_graph()))
        return out

    got = counts(*[tf.constant(t) for entry in entries for t in entry]).numpy()
    want = [int(sum(f(t).sum() for t in entry)) for entry in entries for f in (np.isnan, np.isinf)]
    np.testing.assert_array_equal(got, want)
    assert built == [(jit_compile, [jit_compile] * 4 + [False])]
    # Under XLA each chunk is a conditional that runs as soon as its entries are read.
    assert len(conditionals) == (4 if jit_compile else 0)


def _chunk_calls(graph) -> list:
    """The calls, in ``graph``, of XLA chunk count functions (one conditional each)."""
    return [op for op in graph.get_operations() if is_chunk_call(op)]


@pytest.mark.parametrize("per_chunk", [1, 3])
def test_xla_keeps_each_count_chunk_a_conditional(per_chunk, monkeypatch):
    # XLA replaces a conditional whose branches it deems cheap by a select
    # of both, which would count every tensor on every step. Its tree
    # reduction rewrite makes a large tensor's count look expensive, but not
    # that of a tensor whose every dimension is 32 or less.
    monkeypatch.setattr(lazy_counts, "HOLD_MIN_ELEMENTS", 4)
    monkeypatch.setattr(lazy_counts, "XLA_MAX_CONDITIONALS", 3 // per_chunk)
    shapes = [[8, 16], [8, 16], [16]]

    @tf.function(jit_compile=True)
    def counts(*xs):
        stats, lazies = for_current_graph(), []
        for x in xs:
            y = x * 2.0
            fields = stats.transient_counts_of([y], tf.reduce_sum(y))
            lazies += [fields[kind] for kind in lazy_counts.KINDS]
        return stats.counts_in_chunks(lazies, ["forward"] * len(lazies))

    xs = [np.ones(shape, np.float32) for shape in shapes]
    xs[1][2, 3], xs[2][0] = np.nan, -np.inf
    np.testing.assert_array_equal(counts(*xs).numpy(), [0, 0, 1, 0, 0, 1])
    optimized = counts.experimental_get_compiler_ir(*xs)(stage="optimized_hlo")
    assert optimized.count(" conditional(") == 3 // per_chunk


def test_chunks_of_one_signature_count_their_own_tensors(monkeypatch):
    # A model's repeated layers give chunks of the same dtypes and shapes,
    # which share one traced conditional: each chunk still counts its own tensors.
    monkeypatch.setattr(lazy_counts, "HOLD_MIN_ELEMENTS", 4)
    monkeypatch.setattr(lazy_counts, "XLA_MAX_CONDITIONALS", 100)  # one entry a chunk
    rng = np.random.default_rng(0)
    layers = []
    for nans in (0, 1, 3, 0, 2, 5):
        x = rng.standard_normal(8).astype("float32")
        x[:nans] = np.nan
        x[nans : nans + 1] = np.inf
        layers.append(x)
    seen = []

    @tf.function(jit_compile=True)
    def counts(*tensors):
        stats, lazies = for_current_graph(), []
        for t in tensors:
            fields = stats.transient_counts_of([t], tf.reduce_sum(t))
            lazies += [fields[kind] for kind in lazy_counts.KINDS]
        out = stats.counts_in_chunks(lazies)
        seen.append((in_xla(), len(_chunk_calls(tf.compat.v1.get_default_graph()))))
        return out

    got = counts(*[tf.constant(x) for x in layers]).numpy()
    want = [int(f(x).sum()) for x in layers for f in (np.isnan, np.isinf)]
    np.testing.assert_array_equal(got, want)
    assert seen == [(True, len(layers))]


def test_a_softmax_output_the_loss_never_reads_is_not_computed(tmp_path):
    # Keras's losses read a softmax output's logits, so the plain step never
    # computes the softmax (a 2000-way one over a transformer's batch). The
    # watched step must not either: the output layer's entry reads the logits.
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu", name="hidden"),
            keras.layers.Dense(5, activation="softmax", name="out"),
        ]
    )
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    watch = tb_nanwatch.NanWatch(str(tmp_path))
    x = np.random.default_rng(0).standard_normal((16, 8)).astype("float32")
    with traced_graphs() as graphs:
        model.fit(x, np.arange(16) % 5, batch_size=8, epochs=1, verbose=0, callbacks=[watch])

    softmax = [op for op in graphs[-1].get_operations() if op.type == "Softmax"]
    assert softmax  # Keras built it; nothing of the step runs it
    assert [c.name for op in softmax for c in op.outputs[0].consumers()] == []
    schema = watch.journal.schema
    (out,) = [e for e in schema.find(kind="activation") if e.layer == "out"]
    (logits,) = schema.find(kind="logits")
    assert out.tensor.startswith("logits of out") and logits.tensor.startswith("logits of")
    _, rows = watch.journal.flight_window()
    recorded = {e.tensor: schema.values(rows[-1], e) for e in (out, logits)}
    assert recorded[out.tensor] == recorded[logits.tensor]
    assert recorded[out.tensor]["min"] < 0 < recorded[out.tensor]["max"]  # not probabilities


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_xla_takes_each_count_in_the_pass_of_its_statistic(dtype):
    # Under XLA the NaN and Inf counts of an activation, a gradient and a
    # weight are results of the reduction that takes its min and max (its sum
    # of squares; for a weight its counts alone): exact on every step, and no
    # conditional for XLA to compile.
    rng = np.random.default_rng(0)
    act = rng.standard_normal((6, 40))
    act[1, 3], act[4, 0], act[5, 39] = np.nan, -np.inf, np.inf
    act_inf = rng.standard_normal((3, 8))
    act_inf[0, 0] = -np.inf
    grad = rng.standard_normal((3, 5, 7))
    grad[0, 0, 0], grad[2, 4, 6] = -np.nan, np.nan
    w1, w2, w3 = rng.standard_normal((4, 9)), rng.standard_normal((4, 9)), rng.standard_normal(11)
    w2[3, 8] = np.inf
    big = rng.standard_normal((130, 130))
    big[7, 7], big[8, 8] = np.nan, -np.inf
    arrays = [act, act_inf, grad, w1, w2, big, w3]
    tensors = [tf.cast(tf.constant(a), dtype) for a in arrays]
    exact = [t.numpy().astype(np.float64) for t in tensors]
    ops = []

    @tf.function(jit_compile=True, autograph=False)
    def fields(act, act_inf, grad, w1, w2, big, w3):
        stats = for_current_graph()
        entries = [stats.tensor_fields([act]), stats.tensor_fields([act_inf])]
        entries += [stats.gradient_fields([g]) for g in (grad, w1, w2, big)]
        entries += [stats.value_fields(w) for w in (w1, w2, big, w3)]
        ops.extend(op_types_run(tf.compat.v1.get_default_graph()))
        out = []
        for f in entries:
            out += [f[name] for name in ("min", "max", "norm") if name in f]
            out += [stats.exact(f[kind]) for kind in lazy_counts.KINDS]
        return tf.stack(out)

    got = fields(*tensors).numpy()
    want = []
    for a in exact[:2]:
        extremes = [np.nan] * 2 if np.isnan(a).any() else [a.min(), a.max()]
        want += [*extremes, np.isnan(a).sum(), np.isinf(a).sum()]
    for a in exact[2:6]:
        want += [0.5 * np.sum(a**2), np.isnan(a).sum(), np.isinf(a).sum()]
    for a in exact[3:]:
        want += [np.isnan(a).sum(), np.isinf(a).sum()]
    np.testing.assert_allclose(got, np.array(want, np.float32), rtol=1e-5)
    assert "XlaVariadicReduceV2" in ops  # only XLA has a kernel for it
    assert not {"If", "StatelessIf"} & set(ops)  # no conditional: the counts are taken
    assert " conditional(" not in fields.experimental_get_compiler_ir(*tensors)("optimized_hlo")


def test_xla_reductions_shared_by_one_signature_leave_no_conditional():
    # Every tensor of one kind and signature runs the same function, as both
    # branches of a conditional on a constant (tf2xla then lowers it once);
    # XLA takes those conditionals away, and each tensor keeps its own values.
    rng = np.random.default_rng(3)
    shapes = [(40, 30), (7, 5), (40, 30), (40, 30), (7, 5), (9, 3, 2)]
    arrays = [rng.standard_normal(shape) for shape in shapes]
    arrays[2][5, 5], arrays[4][0, 0], arrays[5][8, 2, 1] = np.nan, -np.inf, np.inf
    tensors = [tf.constant(a, tf.float32) for a in arrays]
    exact = [t.numpy().astype(np.float64) for t in tensors]

    @tf.function(jit_compile=True, autograph=False)
    def fields(*tensors):
        stats = for_current_graph()
        entries = [stats.gradient_fields([t]) for t in tensors]
        entries += [stats.tensor_fields([t]) for t in tensors]
        return tf.stack(
            [f[name] for f in entries for name in ("norm", "min", "max") if name in f]
            + [stats.exact(f[kind]) for f in entries for kind in lazy_counts.KINDS]
        )

    got = fields(*tensors).numpy()
    norms = [0.5 * np.sum(a**2) for a in exact]
    extremes = [
        v for a in exact for v in ([np.nan] * 2 if np.isnan(a).any() else [a.min(), a.max()])
    ]
    counts = [f(a).sum() for a in exact + exact for f in (np.isnan, np.isinf)]
    np.testing.assert_allclose(got, np.array(norms + extremes + counts, np.float32), rtol=1e-5)
    assert " conditional(" not in fields.experimental_get_compiler_ir(*tensors)("optimized_hlo")


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_xla_reduces_small_tensors_of_one_size_together(dtype):
    # Under XLA, small gradients (and weights) of one size and dtype share one
    # reduction, each read as operands of its own, at most 16 a reduction:
    # tf2xla lowers each reduction in about 5 ms. Each still gets its own
    # half sum of squares and counts, whatever its shape and wherever its NaN.
    rng = np.random.default_rng(1)
    shapes = [(4, 9), (36,), (6, 6), (2, 18), (11,), (130, 130)] + [(5,)] * 18
    arrays = [rng.standard_normal(shape) for shape in shapes]
    arrays[1][7], arrays[2][5, 5], arrays[2][0, 1] = np.nan, np.inf, -np.nan
    arrays[3][1, 17], arrays[5][3, 3], arrays[20][4] = -np.inf, np.nan, np.inf
    tensors = [tf.cast(tf.constant(a), dtype) for a in arrays]
    exact = [t.numpy().astype(np.float64) for t in tensors]

    @tf.function(jit_compile=True, autograph=False)
    def fields(*tensors):
        stats = for_current_graph()
        grads = [*tensors[:3], None, tensors[0], tf.IndexedSlices(tensors[3], [0, 1]), *tensors[4:]]
        entries = stats.gradient_fields_each(grads)
        entries += stats.value_fields_each(list(tensors))
        out = []
        for f in entries:
            out += [f[name] for name in ("norm",) if name in f]
            out += [stats.exact(f[kind]) for kind in lazy_counts.KINDS]
        return tf.stack(out)

    got = fields(*tensors).numpy()
    grads = [*exact[:3], None, exact[0], *exact[3:]]
    want = []
    for a in grads:
        if a is None:
            want += [0.0, 0.0, 0.0]
            continue
        want += [0.5 * np.sum(a**2), np.isnan(a).sum(), np.isinf(a).sum()]
    for a in exact:
        want += [np.isnan(a).sum(), np.isinf(a).sum()]
    np.testing.assert_allclose(
        got, np.array(want, np.float32), rtol=2e-3 if dtype == "float16" else 1e-5
    )


def test_the_builder_turns_taken_extremes_into_floats_all_at_once():
    # Under XLA an activation's min and max reach the statistics builder as
    # the keys of its one reduction; the builder converts all of a step's
    # together, per dtype: a scalar op after each reduction would be a kernel
    # of its own for XLA to compile.
    rng = np.random.default_rng(2)
    arrays = [rng.standard_normal((3, 4 + i)) for i in range(6)]
    arrays[1][0, 0], arrays[2][2, 1], arrays[4][1, 1] = np.nan, -np.inf, np.inf
    dtypes = ["float16", "float32", "float32", "float16", "float32", "float64"]
    tensors = [tf.cast(tf.constant(a), d) for a, d in zip(arrays, dtypes, strict=True)]
    exact = [t.numpy().astype(np.float64) for t in tensors]
    schemas = []

    @tf.function(jit_compile=True, autograph=False)
    def vector(*tensors):
        builder = step_vector.StatsBuilder(for_current_graph())
        for i, t in enumerate(tensors):
            fields = builder.stats.tensor_fields([t], taken_extremes=True)
            assert isinstance(fields["min"], TakenExtreme)
            builder.add("forward", "activation", f"layer{i}", f"output of layer{i}", fields)
        out = builder.vector()
        schemas.append(builder.schema)
        return out

    got = vector(*tensors).numpy()
    schema = schemas[0]
    for entry, a in zip(schema.find(kind="activation"), exact, strict=True):
        values = schema.values(got, entry)
        extremes = [np.nan] * 2 if np.isnan(a).any() else [a.min(), a.max()]
        want = [*extremes, np.isnan(a).sum(), np.isinf(a).sum()]
        got_entry = [values[name] for name in ("min", "max", "nan", "inf")]
        np.testing.assert_array_equal(np.array(got_entry, np.float32), np.array(want, np.float32))


def test_the_may_be_non_finite_test_is_not_copied_into_each_of_its_users():
    # XLA copies a cheap producer into each of its users: a test over a
    # transformer's ~250 counts ("is any count not 0?"), copied into each of
    # ~70 users, took XLA's fusion pass 20 s (docs/xla.md).
    def instructions(users: int, counts: int = 60) -> int:
        @tf.function(jit_compile=True, autograph=False)
        def step(xs, weights):
            stats = for_current_graph()
            counts = [tf.reduce_sum(stats.nonfinite_flags(x)[0]) for x in tf.unstack(xs)]
            flag = stats.any_counted(counts)
            return [tf.where(flag, w, -w) for w in tf.unstack(weights)]

        args = (tf.zeros([counts, 50]), tf.ones([users, 8]))
        return step.experimental_get_compiler_ir(*args)(stage="optimized_hlo").count(" = ")

    per_user = (instructions(40) - instructions(10)) / 30
    assert per_user < 30  # copied into each user, it is 2 a count (129 here)
