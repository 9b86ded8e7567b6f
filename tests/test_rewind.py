"""Rewind points: the device ring of batches, the host snapshots, the files,
and what fit, a custom loop and MirroredStrategy save at an incident or an
explosion; the optimizer state in the reproduction bundle.

Run as a script (``python tests/test_rewind.py mirrored OUT``) it is the
MirroredStrategy worker (logical devices must be set before TensorFlow starts).
"""

from __future__ import annotations

import json
import os
import sys
import types

import numpy as np

if __name__ == "__main__":  # the MirroredStrategy worker: two logical CPUs first
    from nanwatch_testlib import logical_cpus

    logical_cpus(2)

import keras  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from nanwatch_testlib import run_worker  # noqa: E402

import tb_nanwatch  # noqa: E402
from tb_nanwatch.record.after_incident import (
    rewind_file,
    rewind_points,  # noqa: E402
)
from tb_nanwatch.record.in_step.batch_ring import BatchRing, RingMiss  # noqa: E402
from tb_nanwatch.record.in_step.device_record import _local_variable  # noqa: E402
from tb_nanwatch.record.stats.graph import GraphStats  # noqa: E402

BATCH = 8

# -- the device ring ---------------------------------------------------------------------


def _ring_and_writer(slots: int, max_bytes: int = 1 << 20, growable: bool = True, rows=None):
    ring = BatchRing(slots, max_bytes)
    spec = tf.TensorSpec([None, 3], tf.float32)
    ring.create([tf.zeros([rows or 1, 3])], growable, _local_variable)
    count = tf.Variable(0, dtype=tf.int64)
    stats = GraphStats()

    @tf.function(input_signature=[spec])
    def write(t):
        ring.write(count.assign_add(1), [t], stats)

    return ring, write


def _batches(rows: list[int]) -> list[np.ndarray]:
    return [np.full((n, 3), float(i), np.float32) + np.arange(3) for i, n in enumerate(rows)]


def test_the_ring_holds_the_last_batches_with_their_own_sizes():
    ring, write = _ring_and_writer(slots=4)
    fed = _batches([3, 3, 2, 3, 1, 3])
    for batch in fed:
        write(batch)
    kept = ring.read(2, 5)
    assert [len(b) for b in kept] == [1, 1, 1, 1]
    for got, want in zip(kept, fed[2:], strict=True):
        np.testing.assert_array_equal(got[0], want)
    with pytest.raises(RingMiss, match="step 1 is no longer kept"):
        ring.read(1, 3)
    with pytest.raises(RingMiss, match="the ring keeps 4"):
        ring.read(0, 5)


def test_a_ring_over_its_memory_bound_writes_nothing():
    # 4 slots x 3 rows x 3 floats = 144 bytes; the bound is 100.
    ring, write = _ring_and_writer(slots=4, max_bytes=100)
    write(_batches([3])[0])
    with pytest.raises(RingMiss, match="step 0 is no longer kept"):
        ring.read(0, 0)
    assert ring.nbytes() == 0


def test_a_fixed_shape_ring_pads_and_refuses_what_does_not_fit():
    ring, write = _ring_and_writer(slots=2, growable=False, rows=4)
    fed = _batches([4, 2])
    for batch in fed:
        write(batch)
    np.testing.assert_array_equal(ring.read(1, 1)[0][0], fed[1])
    too_big = BatchRing(2, max_bytes=10)
    too_big.create([tf.zeros([4, 3])], False, _local_variable)
    assert not too_big.created and "above rewind_memory_mb" in too_big.not_kept_why
    with pytest.raises(RingMiss, match="above rewind_memory_mb"):
        too_big.read(0, 0)


# -- the host snapshots, with stand-ins for the model, optimizer and device ----------------


class FakeVariable:
    def __init__(self, path: str, value) -> None:
        self.path, self.value = path, np.asarray(value, np.float32)
        self.shape, self.dtype = self.value.shape, "float32"

    def numpy(self) -> np.ndarray:
        return self.value


class FakeRing:
    created, not_kept_why = True, None

    def nbytes(self) -> int:
        return 0

    def read(self, first: int, last: int) -> list[list[np.ndarray]]:
        return [[np.full(2, step, np.float32)] for step in range(first, last + 1)]

    def stop(self) -> None:
        pass


def _host_ring(steps: list[int], every: int = 3, memory_mb: float = 1.0):
    """A RewindRing that took snapshots after each of ``steps`` (the weight
    holds the step number), and its stand-ins."""
    weight = FakeVariable("dense/kernel", np.zeros(4))
    slot = FakeVariable("adam/m", np.zeros(4))
    model = types.SimpleNamespace(weights=[weight])
    optimizer = types.SimpleNamespace(built=True, variables=[slot])
    device = types.SimpleNamespace(ring=FakeRing(), batch_structure=(0,))
    ring = rewind_points.RewindRing(every, memory_mb)
    for step in steps:
        weight.value = np.full(4, step, np.float32)
        slot.value = np.full(4, -step, np.float32)
        if step == 0:
            ring.take_initial(model, optimizer, device)
        elif ring.due(step):
            ring.take(step, model, optimizer, device)
    return ring, device


def test_the_last_two_snapshots_are_kept(tmp_path):
    ring, device = _host_ring([0, 1, 2, 3, 4, 5, 6, 7])
    assert [s.step for s in ring.snapshots] == [3, 6]
    assert ring.save(str(tmp_path), device, through=7) == rewind_file.REWIND_DIR
    point = rewind_file.load_rewind_point(str(tmp_path))
    assert point.step == 6
    np.testing.assert_array_equal(point.weights["dense/kernel"], np.full(4, 6.0))
    np.testing.assert_array_equal(point.optimizer["adam/m"], np.full(4, -6.0))
    assert [b[0][0] for b in point.batches] == [6.0, 7.0]


@pytest.mark.parametrize(
    ("onset", "step", "before_onset"), [(None, 6, None), (7, 3, True), (4, 3, False)]
)
def test_the_snapshot_chosen_is_from_before_the_onset(tmp_path, onset, step, before_onset):
    ring, device = _host_ring([0, 1, 2, 3, 4, 5, 6, 7])
    ring.save(str(tmp_path), device, through=7, onset=onset)
    point = rewind_file.load_rewind_point(str(tmp_path))
    assert (point.step, point.info["before_onset"]) == (step, before_onset)
    assert len(point.batches) == 8 - step


def test_above_the_memory_bound_no_snapshot_is_kept_and_the_reason_is_given(tmp_path):
    with pytest.warns(RuntimeWarning, match="rewind_memory_mb"):
        ring, device = _host_ring([0, 1, 2, 3], memory_mb=1e-5)
    assert not ring.snapshots and "rewind_memory_mb" in ring.not_taken_why
    with pytest.raises(rewind_points.RewindNotTaken, match="rewind_memory_mb"):
        ring.save(str(tmp_path), device, through=3)


def _point(steps: int = 2) -> rewind_file.RewindPoint:
    return rewind_file.RewindPoint(
        step=5,
        weights={"d/kernel": np.ones((2, 3), np.float32)},
        optimizer={"adam/iteration": np.array(5, np.int64)},
        batches=[[np.full((2, 2), s, np.float32), np.arange(2)] for s in range(steps)],
        structure=(0, 0),
        learning_rates=[0.1, None][:steps],
    )


def test_a_rewind_point_round_trips_through_its_files(tmp_path):
    assert rewind_file.save_rewind_point(str(tmp_path), _point()) == "repro/rewind"
    loaded = rewind_file.load_rewind_point(str(tmp_path / "repro" / "rewind" / "rewind.json"))
    assert (loaded.step, loaded.structure, loaded.learning_rates) == (5, [0, 0], [0.1, None])
    assert int(loaded.optimizer["adam/iteration"]) == 5
    np.testing.assert_array_equal(loaded.batches[1][0], np.full((2, 2), 1.0))
    rewind_file.save_rewind_point(str(tmp_path), _point(1))  # its own files: overwritten
    assert len(rewind_file.load_rewind_point(str(tmp_path)).batches) == 1


def test_saving_never_overwrites_a_foreign_file_nor_follows_a_link(tmp_path):
    foreign = tmp_path / "a" / "repro" / "rewind"
    foreign.mkdir(parents=True)
    (foreign / "rewind.npz").write_bytes(b"someone else's")
    with pytest.raises(FileExistsError):
        rewind_file.save_rewind_point(str(tmp_path / "a"), _point())
    assert (foreign / "rewind.npz").read_bytes() == b"someone else's"
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "b" / "repro").mkdir(parents=True)
    os.symlink(target, tmp_path / "b" / "repro" / "rewind")
    with pytest.raises(FileExistsError, match="symbolic link"):
        rewind_file.save_rewind_point(str(tmp_path / "b"), _point())
    assert not os.listdir(target)


def test_loading_checks_the_declared_sizes(tmp_path):
    rewind_file.save_rewind_point(str(tmp_path), _point())
    meta_path = tmp_path / "repro" / "rewind" / "rewind.json"
    meta = json.loads(meta_path.read_text())
    with pytest.raises(ValueError, match="declares"):
        rewind_file.load_rewind_point(str(tmp_path), max_bytes=16)
    meta["arrays"]["w/0"][1] = [1, 1]  # the file holds 2 x 3
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="w/0"):
        rewind_file.load_rewind_point(str(tmp_path))


# -- in training -------------------------------------------------------------------------


def _data(steps: int, nan_step: int | None, seed: int = 0):
    rng = np.random.RandomState(seed)
    x = rng.normal(size=(steps * BATCH, 4)).astype("float32")
    if nan_step is not None:
        x[nan_step * BATCH + 3, 2] = np.nan
    y = rng.normal(size=(steps * BATCH, 1)).astype("float32")
    return x, y


def _model(optimizer=None, **compile_kwargs) -> keras.Model:
    keras.utils.set_random_seed(0)
    inp = keras.Input((4,), name="x")
    h = keras.layers.Dense(6, activation="relu", name="hidden")(inp)
    model = keras.Model(inp, keras.layers.Dense(1, name="head")(h))
    model.compile(optimizer=optimizer or keras.optimizers.Adam(0.01), loss="mse", **compile_kwargs)
    return model


class StateBeforeEachStep(keras.callbacks.Callback):
    """The model's and the optimizer's variables before each step (execution)."""

    def __init__(self) -> None:
        super().__init__()
        self.weights: dict[int, list] = {}
        self.optimizer: dict[int, list] = {}

    def on_train_batch_begin(self, batch, logs=None) -> None:
        self.weights[batch] = [v.numpy().copy() for v in self.model.weights]
        self.optimizer[batch] = [v.numpy().copy() for v in self.model.optimizer.variables]


def _check_point(point, weights: list, x, y, through: int) -> None:
    """``point`` holds ``weights`` and the batches fed from its step through ``through``."""
    assert len(point.weights) == len(weights)
    for got, want in zip(point.weights.values(), weights, strict=True):
        np.testing.assert_array_equal(got, want)
    assert len(point.batches) == through - point.step + 1
    for i, (bx, by) in enumerate(point.batches):
        rows = slice((point.step + i) * BATCH, (point.step + i + 1) * BATCH)
        np.testing.assert_array_equal(bx, x[rows])
        np.testing.assert_array_equal(by, y[rows])


@pytest.mark.parametrize(
    ("steps_per_execution", "jit_compile", "snapshot"),
    [(1, False, 10), (2, False, 12), (1, True, 10)],
)
def test_fit_saves_a_rewind_point_at_the_incident(
    tmp_path, steps_per_execution, jit_compile, snapshot
):
    x, y = _data(16, nan_step=13)
    model = _model(steps_per_execution=steps_per_execution, jit_compile=jit_compile)
    state = StateBeforeEachStep()
    watch = tb_nanwatch.NanWatch(str(tmp_path), rewind_every=5, remedy_trials=False)
    model.fit(x, y, batch_size=BATCH, shuffle=False, callbacks=[state, watch], verbose=0)
    assert watch.incident["step"] == 13
    # Under XLA the ring has a fixed shape (the batch size unknown when traced: DEFAULT_ROWS).
    assert watch._recorder.built_for_xla is jit_compile  # XLA really compiled the step
    assert watch._recorder.device.ring._growable is not jit_compile
    summary = watch.journal.summary()
    assert summary["rewind_point"] == "repro/rewind"
    point = rewind_file.load_rewind_point(str(tmp_path))
    # Snapshots every 5 steps, on execution boundaries (0, 6, 12 with 2 steps an execution).
    assert point.step == snapshot
    _check_point(point, state.weights[snapshot], x, y, through=13)
    optimizer = dict(
        zip([v.path for v in model.optimizer.variables], state.optimizer[snapshot], strict=True)
    )
    assert set(point.optimizer) == set(optimizer)
    for path, value in point.optimizer.items():
        np.testing.assert_array_equal(value, optimizer[path])
    assert int(point.optimizer[model.optimizer.iterations.path]) == snapshot
    assert point.learning_rates == pytest.approx([0.01] * (14 - snapshot))


def test_a_custom_loop_saves_the_rewind_point_of_its_incident(tmp_path):
    x, y = _data(16, nan_step=12)
    model = _model()
    optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    watcher = tb_nanwatch.StepWatcher(
        str(tmp_path), model, optimizer, rewind_every=5, remedy_trials=False
    )

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape, watcher.forward(tape, xb, yb) as rec:
            loss = rec.loss(tf.reduce_mean((model(xb, training=True) - yb) ** 2))
        grads = rec.gradients(tape.gradient(loss, rec.sources(model.trainable_variables)))
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        rec.after_update()

    before = {}
    for step in range(16):
        before[step] = [v.numpy().copy() for v in model.weights]
        rows = slice(step * BATCH, (step + 1) * BATCH)
        train_step(tf.constant(x[rows]), tf.constant(y[rows]))
        if watcher.end_step():
            break
    watcher.close()
    assert watcher.incident["step"] == 12
    point = rewind_file.load_rewind_point(str(tmp_path))
    assert point.step == 10
    _check_point(point, before[10], x, y, through=12)
    assert any("momentum" in path for path in point.optimizer)


def test_an_explosion_saves_a_rewind_point_from_before_its_onset(tmp_path):
    import scenarios

    model, kwargs, truth = scenarios.exploding(jump_step=40, steps=70)
    state = StateBeforeEachStep()
    watch = tb_nanwatch.NanWatch(str(tmp_path), rewind_every=10, remedy_trials=False)
    model.fit(**kwargs, callbacks=[state, watch], verbose=0)
    onset = watch.journal.explosion_onset["step"]
    assert onset >= truth["jump_step"]
    point = rewind_file.load_rewind_point(str(tmp_path))
    assert point.info["onset"] == onset and point.info["before_onset"] is True
    assert point.step <= onset - rewind_points.ONSET_MARGIN < point.step + 20
    x, y = kwargs["x"], kwargs["y"]
    _check_point(point, state.weights[point.step], x, y, through=point.info["through_step"])


def test_above_the_memory_bound_the_run_says_why_there_is_no_rewind_point(tmp_path):
    x, y = _data(8, nan_step=6)
    watch = tb_nanwatch.NanWatch(
        str(tmp_path), rewind_every=2, rewind_memory_mb=0.001, remedy_trials=False
    )
    with pytest.warns(RuntimeWarning, match="keeps no rewind points.*rewind_memory_mb"):
        _model().fit(x, y, batch_size=BATCH, shuffle=False, callbacks=[watch], verbose=0)
    summary = watch.journal.summary()
    assert summary["rewind_point"] is None
    assert "rewind_memory_mb" in summary["rewind_point_not_taken"]
    assert not os.path.exists(tmp_path / "repro" / "rewind")


def test_rewind_every_zero_keeps_no_ring(tmp_path):
    x, y = _data(8, nan_step=6)
    watch = tb_nanwatch.NanWatch(str(tmp_path), rewind_every=0, remedy_trials=False)
    _model().fit(x, y, batch_size=BATCH, shuffle=False, callbacks=[watch], verbose=0)
    assert watch._recorder.device.ring is None
    assert "rewind_point" not in watch.journal.summary()


# -- the optimizer's state in the reproduction bundle ----------------------------------------


def test_the_bundle_holds_the_optimizer_state_from_before_the_step(tmp_path):
    x, y = _data(8, nan_step=5)
    model = _model()
    state = StateBeforeEachStep()
    watch = tb_nanwatch.NanWatch(str(tmp_path), rewind_every=0, remedy_trials=False)
    model.fit(x, y, batch_size=BATCH, shuffle=False, callbacks=[state, watch], verbose=0)
    saved = tb_nanwatch.load_bundle(str(tmp_path))
    paths = [v.path for v in model.optimizer.variables]
    assert list(saved.optimizer) == paths
    for value, want in zip(saved.optimizer.values(), state.optimizer[5], strict=True):
        np.testing.assert_array_equal(value, want)


@keras.saving.register_keras_serializable("tests")
class InfFromStep3(keras.optimizers.schedules.LearningRateSchedule):
    """0.01, then an infinite rate from step 3: the update of step 3 is not finite."""

    def __call__(self, step):
        return tf.where(step >= 3, tf.constant(np.inf), tf.constant(0.01))

    def get_config(self) -> dict:
        return {}


def test_an_update_phase_bundle_holds_the_optimizer_slots_before_the_step(tmp_path):
    x, y = _data(6, nan_step=None)
    model = _model(optimizer=keras.optimizers.Adam(InfFromStep3()))
    state = StateBeforeEachStep()
    watch = tb_nanwatch.NanWatch(
        str(tmp_path), pre_step_weights="every_step", rewind_every=0, remedy_trials=False
    )
    model.fit(x, y, batch_size=BATCH, shuffle=False, callbacks=[state, watch], verbose=0)
    assert (watch.incident["step"], watch.incident["phase"]) == (3, "update")
    saved = tb_nanwatch.load_bundle(str(tmp_path))
    paths = [v.path for v in model.optimizer.variables]
    slots = dict(zip(paths, state.optimizer[3], strict=True))
    assert set(saved.optimizer) == set(slots)
    for path, value in saved.optimizer.items():
        np.testing.assert_array_equal(value, slots[path])
    assert int(saved.optimizer[model.optimizer.iterations.path]) == 3
    assert any(np.abs(v).sum() > 0 for p, v in saved.optimizer.items() if "momentum" in p)


# -- MirroredStrategy, in a fresh process ---------------------------------------------------------


def test_mirrored_strategy_saves_the_whole_batch_of_both_replicas(tmp_path):
    found = run_worker([__file__, "mirrored", str(tmp_path)], tmp_path / "result.json")
    assert found["replicas"] == 2 and found["incident_step"] == 13
    assert found["point_step"] == 10 and found["matches"] is True


def _mirrored_worker(out: str) -> None:
    x, y = _data(16, nan_step=13)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = _model()
    state = StateBeforeEachStep()
    watch = tb_nanwatch.NanWatch(os.path.join(out, "run"), rewind_every=5, remedy_trials=False)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    model.fit(data, callbacks=[state, watch], verbose=0)
    point = rewind_file.load_rewind_point(os.path.join(out, "run"))
    try:
        _check_point(point, state.weights[point.step], x, y, through=13)
        matches = True
    except AssertionError:
        matches = False
    found = {
        "replicas": strategy.num_replicas_in_sync,
        "incident_step": watch.incident["step"],
        "point_step": point.step,
        "matches": matches,
    }
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(found, f)


def test_mirrored_strategy_trials_reproduce_the_run_and_rewind_applies_the_fix(tmp_path):
    found = run_worker([__file__, "mirrored_rewind", str(tmp_path)], tmp_path / "result.json")
    assert found["replicas"] == 2
    # The record holds the loss Keras reports, not each replica's share of it:
    # the re-run's loss is Keras' and it reproduced the recorded one.
    assert found["rerun_loss"] == pytest.approx(found["keras_loss"], rel=1e-6)
    assert found["fidelity"].startswith("the re-run reproduced the recorded losses")
    assert found["outcomes"]["raise_epsilon"] == "fixed", found["outcomes"]
    assert found["recoveries"] == [
        {
            "step": 0,
            "rewound_to": 0,
            "skipped_batches": 1,
            "remedy": {"id": "raise_epsilon", "setting": "epsilon=0.0001"},
        }
    ]
    # The fix was set on the run's own optimizer, and training went on, finite.
    assert found["epsilon"] == pytest.approx(1e-4) and found["weights_finite"] is True
    assert found["steps"] == 8 and found["keras_losses_finite"] is True


def _mirrored_rewind_worker(out: str) -> None:
    from nanwatch_testlib import TRIAL_BUDGET_S, report_json
    from scenarios import dead_relu_head

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inp = keras.Input((3,))
        live = keras.layers.Dense(1, name="live")(inp)
        model = keras.Model(inp, keras.layers.Add()([live, dead_relu_head(inp)]))
        # epsilon 0 and a head whose gradient is exactly 0: 0/0 in the first update.
        model.compile(optimizer=keras.optimizers.RMSprop(0.01, epsilon=0.0), loss="mse")
    x = np.random.RandomState(4).uniform(0.5, 1.5, (4 * BATCH, 3)).astype("float32")
    y = np.ones((len(x), 1), "float32")
    keras_loss = float(keras.losses.MeanSquaredError()(y[:BATCH], model(x[:BATCH])))
    run = os.path.join(out, "run")
    watch = tb_nanwatch.NanWatch(run, on_nonfinite="rewind", trial_budget_s=TRIAL_BUDGET_S)
    history = model.fit(
        x, y, batch_size=BATCH, epochs=2, shuffle=False, callbacks=[watch], verbose=0
    )
    with open(os.path.join(run, "repro", "trials.json")) as f:
        written = json.load(f)
    (report,) = report_json(run)
    found = {
        "replicas": strategy.num_replicas_in_sync,
        "keras_loss": keras_loss,
        "rerun_loss": written["baseline"]["loss_first"],
        "fidelity": written["fidelity"],
        "outcomes": {t["remedy"]: t["outcome"] for t in written["trials"]},
        "recoveries": report["recoveries"],
        "steps": report["steps"],
        "epsilon": float(model.optimizer.epsilon),
        "weights_finite": all(np.isfinite(w).all() for w in model.get_weights()),
        "keras_losses_finite": bool(np.isfinite(history.history["loss"]).all()),
    }
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(found, f)


if __name__ == "__main__":
    if sys.argv[1] == "mirrored":
        _mirrored_worker(sys.argv[2])
    if sys.argv[1] == "mirrored_rewind":
        _mirrored_rewind_worker(sys.argv[2])
