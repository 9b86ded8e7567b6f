"""Rewind points on disk: one snapshot in host memory at a time, written by a
background thread, within a disk budget; trials of a large trained state."""

from __future__ import annotations

import json
import threading
import types
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from nanwatch_testlib import TRIAL_BUDGET_S

import tb_nanwatch
from tb_nanwatch.evidence.options import WatchOptions
from tb_nanwatch.evidence.trials import TRIALS_FILE
from tb_nanwatch.record.after_incident import rewind_file, rewind_points, trials
from tb_nanwatch.record.after_incident.rewind_file import RewindPoint
from tb_nanwatch.record.after_incident.rewind_points import SnapshotDisk
from tb_nanwatch.record.after_incident.trial_replica import TrainedState

BATCH = 16
STEPS = 12


class JumpSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """0.01, then 50 from step 6 on: the run explodes after step 6."""

    def __call__(self, step):
        return tf.where(step < 6, 0.01, 50.0)


def _data():
    rng = np.random.RandomState(3)
    x = rng.normal(size=(STEPS * BATCH, 4)).astype("float32")
    y = (x @ rng.normal(size=(4, 1))).astype("float32")
    return x, y


def _wide_model() -> keras.Model:
    """~0.6 MB of weights (SGD: no slots): one snapshot fits in 1 MB, two do not."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(390), keras.layers.Dense(390), keras.layers.Dense(1)]
    )
    model.compile(optimizer=keras.optimizers.SGD(JumpSchedule()), loss="mse")
    return model


def _state_mb(model) -> float:
    return sum(v.numpy().nbytes for v in model.variables) / 2**20


def _folders(run_dir) -> list:
    return list(run_dir.glob(f"{rewind_points.SNAPSHOT_PREFIX}*"))


def test_two_snapshots_above_the_memory_bound_still_get_a_rewind_point_and_trials(tmp_path):
    model = _wide_model()
    assert 0.5 < _state_mb(model) < 1.0 < 2 * _state_mb(model)
    x, y = _data()
    watch = tb_nanwatch.NanWatch(str(tmp_path), rewind_every=4, rewind_memory_mb=1)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="NanWatch keeps no rewind points")
        model.fit(x, y, batch_size=BATCH, shuffle=False, callbacks=[watch], verbose=0)
    summary = watch.journal.summary()
    assert summary["rewind_point"] == rewind_file.REWIND_DIR, summary
    point = rewind_file.load_rewind_point(str(tmp_path))
    assert point.step in (0, 4) and point.weights
    body = json.loads((tmp_path / "repro" / TRIALS_FILE).read_text())
    assert body["trials"] and "rewind point" in body["plan"], body
    assert not any("rewind_memory_mb" in t["why"] for t in body["trials"]), body
    assert any(t["outcome"] != "not_tried" for t in body["trials"]), body
    assert not _folders(tmp_path)  # the snapshot files went at the end of the run
    # The same state kept twice in host memory (a gs:// run dir) is over the bound.
    in_memory = rewind_points.RewindRing(4, 1)
    device = types.SimpleNamespace(ring=types.SimpleNamespace(created=True, not_kept_why=None))
    device.ring.nbytes, device.ring.stop = (lambda: 0), (lambda: None)
    with pytest.warns(RuntimeWarning, match="twice.*rewind_memory_mb"):
        in_memory.take(0, model, model.optimizer, device)


def test_the_snapshot_is_written_by_a_background_thread_and_the_step_does_not_wait(
    tmp_path, monkeypatch
):
    trained_on = threading.Event()
    seen: dict = {}
    original = rewind_points.write_snapshot

    def slow_writer(snapshot, path):
        seen.setdefault("threads", []).append(threading.current_thread())
        if snapshot.step == 0:  # blocks until training went on past step 2
            seen["waited_out"] = not trained_on.wait(timeout=30)
        original(snapshot, path)

    class After(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch >= 2:
                trained_on.set()

    monkeypatch.setattr(rewind_points, "write_snapshot", slow_writer)
    x, y = _data()
    model = _wide_model()
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")  # no explosion
    watch = tb_nanwatch.NanWatch(str(tmp_path), rewind_every=4, remedy_trials=False)
    model.fit(x, y, batch_size=BATCH, shuffle=False, callbacks=[watch, After()], verbose=0)
    assert seen["waited_out"] is False  # fit went on while step 0's file was being written
    assert seen["threads"] and all(t is not threading.main_thread() for t in seen["threads"])
    assert not _folders(tmp_path)


def test_over_the_disk_budget_no_snapshot_is_taken_and_the_reason_is_said_once(tmp_path):
    x, y = _data()
    model = _wide_model()
    watch = tb_nanwatch.NanWatch(str(tmp_path), rewind_every=4, rewind_disk_mb=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=BATCH, shuffle=False, callbacks=[watch], verbose=0)
    said = [w for w in caught if "keeps no rewind points" in str(w.message)]
    assert len(said) == 1 and "rewind_disk_mb" in str(said[0].message)
    summary = watch.journal.summary()
    assert summary["rewind_point"] is None
    assert "rewind_disk_mb" in summary["rewind_point_not_taken"]
    assert not _folders(tmp_path)


def test_the_ring_keeps_the_newest_complete_file_and_removes_the_one_it_replaces(tmp_path):
    weight = types.SimpleNamespace(path="d/kernel", shape=(4,), dtype="float32")
    model = types.SimpleNamespace(weights=[weight])
    ring_device = types.SimpleNamespace(
        created=True, not_kept_why=None, nbytes=lambda: 0, stop=lambda: None
    )
    device = types.SimpleNamespace(ring=ring_device)
    ring = rewind_points.RewindRing(2, 1, disk=SnapshotDisk(str(tmp_path), 1))
    for step in (0, 2, 4, 6):
        weight.numpy = lambda step=step: np.full(4, step, np.float32)
        ring.take(step, model, None, device)
        ring.settle(wait=True)
    assert [s.step for s in ring.snapshots] == [4, 6]
    (folder,) = _folders(tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == [
        s.path.split("/")[-1] for s in ring.snapshots
    ]
    np.testing.assert_array_equal(ring.snapshots[0].weights["d/kernel"], np.full(4, 4.0))
    ring.drop_after(5)
    assert [s.step for s in ring.snapshots] == [4] and len(list(folder.iterdir())) == 1
    ring.close()
    assert not _folders(tmp_path)


def _state(model, optimizer) -> list[np.ndarray]:
    variables = [*model.variables, *model.metrics_variables, *optimizer.variables]
    return [np.array(v.numpy(), copy=True) for v in variables]


def test_a_trained_state_above_the_memory_bound_is_kept_on_disk_and_restored_bitwise():
    rng = np.random.RandomState(1)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")
    model = _wide_model()
    optimizer = keras.optimizers.Adam(0.01)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    kept = TrainedState(model, optimizer, max_bytes=1 << 20)
    assert kept.values is None and kept.file is not None
    kept.close()
    batches = [[x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH]] for i in range(4)]
    point = RewindPoint(
        step=0,
        weights={v.path: v.numpy() * 1.5 for v in model.variables},
        optimizer={v.path: v.numpy() for v in optimizer.variables},
        batches=batches,
        structure=[0, 0],
        learning_rates=[0.01] * 4,
    )
    before = _state(model, optimizer)
    cause = {"id": "growth_overflow", "remedy_ids": ["lower_lr", "clip_gradients"]}
    options = WatchOptions(rewind_memory_mb=1, trial_budget_s=TRIAL_BUDGET_S)
    found = trials.run_trials(
        model, cause, trials.TrialData(rewind=point), None, options, progress=lambda _: None
    )
    assert found.baseline is not None and len(found) == 2
    after = _state(model, optimizer)
    assert len(after) == len(before)
    for was, now in zip(before, after, strict=True):
        assert was.dtype == now.dtype and was.tobytes() == now.tobytes()


def test_a_slow_step_scales_the_trials_budget_within_its_cap():
    runner = trials._Runner.__new__(trials._Runner)
    runner.episode = types.SimpleNamespace(steps=40)
    runner.budget_s, runner.started, runner.runs = 10.0, 100.0, 5
    runner.deadline = 110.0
    runner._scale_budget(0.01)  # 2 s in all: the budget stays
    assert runner.deadline == 110.0
    runner._scale_budget(0.1)  # 20 s needed
    assert runner.deadline == pytest.approx(120.0)
    runner._scale_budget(10.0)  # 2000 s needed: at most MAX_BUDGET_SCALE x
    assert runner.deadline == pytest.approx(100.0 + trials.MAX_BUDGET_SCALE * 10.0)
