"""``on_nonfinite="skip"``: a non-finite step is not applied.

A run with a NaN batch ends with the same weights and optimizer iterations
as the same training on the data without that batch: in ``fit`` (also under
``jit_compile=True`` and with ``steps_per_execution=2``), in a custom loop,
and under a 2-replica MirroredStrategy (the NaN in one replica's shard only).

Run as a script (``python tests/test_skip.py mirrored OUT``) it is the
MirroredStrategy worker (logical devices must be set before TensorFlow starts).
"""

from __future__ import annotations

import json
import sys

import numpy as np

if __name__ == "__main__":  # the MirroredStrategy worker: two logical CPUs first
    from nanwatch_testlib import logical_cpus

    logical_cpus(2)

import keras  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from nanwatch_testlib import plain_mse_step, run_worker, watched_mse_step  # noqa: E402

import tb_nanwatch  # noqa: E402
from tb_nanwatch.record.in_step import device_record  # noqa: E402

BATCH = 8
ROWS = 48  # six steps


def _data(nan_steps=(3,)) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 4)).astype("float32")
    y = rng.normal(size=(ROWS, 1)).astype("float32")
    for step in nan_steps:
        x[step * BATCH + 2, 1] = np.nan  # row 2 of the batch: replica 0's shard of two
    return x, y


def _without(x: np.ndarray, y: np.ndarray, steps) -> tuple[np.ndarray, np.ndarray]:
    keep = [i for i in range(len(x)) if i // BATCH not in steps]
    return x[keep], y[keep]


def _model(jit_compile: bool = False, steps_per_execution: int = 1) -> keras.Model:
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss="mse",
        jit_compile=jit_compile,
        steps_per_execution=steps_per_execution,
    )
    return model


def _assert_same_training(model: keras.Model, reference: keras.Model) -> None:
    for got, want in zip(model.get_weights(), reference.get_weights(), strict=True):
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert int(model.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy())
    for got, want in zip(
        model.optimizer.variables, reference.optimizer.variables, strict=True
    ):  # Adam's slots too
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    ("jit_compile", "steps_per_execution"), [(False, 1), (True, 1), (False, 2)]
)
def test_fit_skip_trains_as_if_the_nan_batch_was_not_there(
    tmp_path, capfd, jit_compile, steps_per_execution
):
    x, y = _data()
    model = _model(jit_compile, steps_per_execution)
    watch = tb_nanwatch.NanWatch(str(tmp_path / "run"), on_nonfinite="skip", remedy_trials=False)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[watch])
    reference = _model(jit_compile, steps_per_execution)
    reference.fit(*_without(x, y, {3}), batch_size=BATCH, shuffle=False, verbose=0)
    _assert_same_training(model, reference)
    assert int(model.optimizer.iterations.numpy()) == 5
    summary = watch.journal.summary()
    assert summary["status"] == "finished" and summary["steps"] == 6
    assert summary["first_nonfinite"]["step"] == 3  # the incident, recorded as with "stop"
    assert summary["first_nonfinite"]["phase"] == "input"
    assert summary["skipped_nonfinite_steps"] == [3]
    # The step really was built for XLA (Keras may silently drop jit_compile).
    assert summary["jit_compile"] is jit_compile
    assert watch._recorder.built_for_xla is jit_compile
    assert "step 3 was not applied" in capfd.readouterr().err


@pytest.mark.parametrize("jit_compile", [False, True])
def test_custom_loop_skip_trains_as_if_the_nan_batch_was_not_there(tmp_path, jit_compile):
    x, y = _data()
    model, reference = _model(), _model()
    optimizer, reference_optimizer = keras.optimizers.Adam(0.01), keras.optimizers.Adam(0.01)
    watcher = tb_nanwatch.StepWatcher(
        str(tmp_path / "loop"), model, optimizer, on_nonfinite="skip", remedy_trials=False
    )
    step = watched_mse_step(watcher, model, optimizer, jit_compile=jit_compile)
    for i in range(ROWS // BATCH):
        step(x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH])
        assert not watcher.end_step()
    watcher.close()
    plain = plain_mse_step(reference, reference_optimizer)
    kept_x, kept_y = _without(x, y, {3})
    for i in range(len(kept_x) // BATCH):
        plain(kept_x[i * BATCH : (i + 1) * BATCH], kept_y[i * BATCH : (i + 1) * BATCH])
    for got, want in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert int(optimizer.iterations.numpy()) == int(reference_optimizer.iterations.numpy()) == 5
    summary = watcher.journal.summary()
    assert summary["skipped_nonfinite_steps"] == [3] and summary["jit_compile"] is jit_compile
    assert watcher.recorder.built_for_xla is jit_compile


def test_later_skips_are_listed_and_max_skips_stops_training(tmp_path, capfd):
    x, y = _data(nan_steps=(1, 2, 4))
    model = _model()
    watch = tb_nanwatch.NanWatch(
        str(tmp_path / "run"), on_nonfinite="skip", max_skips=2, remedy_trials=False
    )
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[watch])
    summary = watch.journal.summary()
    assert summary["status"] == "stopped"
    assert summary["steps"] == 5  # stopped after step 4, the third skip
    assert summary["first_nonfinite"]["step"] == 1
    assert summary["skipped_nonfinite_steps"] == [1, 2, 4]
    assert summary["recovery_stopped"]["step"] == 4
    assert "max_skips=2" in summary["recovery_stopped"]["why"]
    assert all(np.isfinite(w).all() for w in model.get_weights())
    assert int(model.optimizer.iterations.numpy()) == 2  # steps 0 and 3 applied
    err = capfd.readouterr().err
    assert "3 non-finite steps skipped, more than max_skips=2: training stopped" in err


def test_a_stop_after_max_skips_keeps_backup_and_restore_state(tmp_path):
    """As "stop" does: the backup from before is neither overwritten nor deleted."""
    from scenarios import input_nan

    keras.utils.set_random_seed(0)
    backup_dir = tmp_path / "backup"
    model, kwargs, truth = input_nan(nan_step=20, steps=24)
    data = tf.data.Dataset.from_tensor_slices((kwargs["x"], kwargs["y"])).batch(BATCH)
    backup = keras.callbacks.BackupAndRestore(str(backup_dir))
    watch = tb_nanwatch.NanWatch(
        str(tmp_path / "run"), on_nonfinite="skip", max_skips=0, remedy_trials=False
    )
    # Two 12-step epochs: the backup is saved after epoch 0, the NaN comes at step 20.
    model.fit(data, steps_per_epoch=12, epochs=2, callbacks=[backup, watch], verbose=0)
    assert watch.journal.summary()["recovery_stopped"]["step"] == truth["step"]
    saved = list(backup_dir.rglob("*.weights.h5"))
    assert saved, "BackupAndRestore's backup was deleted"
    restored = input_nan()[0]
    restored.load_weights(str(saved[0]))
    assert all(np.isfinite(w.numpy()).all() for w in restored.weights)


def test_a_custom_loop_is_told_to_stop_after_max_skips(tmp_path):
    x, y = _data(nan_steps=(0, 1))
    model = _model()
    optimizer = keras.optimizers.SGD(0.01)
    watcher = tb_nanwatch.StepWatcher(
        str(tmp_path / "loop"),
        model,
        optimizer,
        on_nonfinite="skip",
        max_skips=1,
        remedy_trials=False,
    )
    step = watched_mse_step(watcher, model, optimizer)
    answers = []
    for i in range(3):
        step(x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH])
        answers.append(watcher.end_step())
    watcher.close()
    assert answers == [False, True, False]
    assert watcher.journal.summary()["status"] == "stopped"


def test_the_loss_scalers_own_skips_stay_its_own(tmp_path, mixed_precision):
    """Float16 gradients that overflow at the first loss scale: the scaler
    skips those steps and halves its scale; "skip" undoes nothing of it."""
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(32, 4)) * 300).astype("float32")
    y = (rng.normal(size=(32, 1)) * 300).astype("float32")
    model = _model()
    watch = tb_nanwatch.NanWatch(str(tmp_path / "run"), on_nonfinite="skip", remedy_trials=False)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[watch])
    summary = watch.journal.summary()
    assert summary["skipped_ranges"], "the scaler skipped no step: the scenario is wrong"
    assert summary["skipped_nonfinite_steps"] == [] and summary["recoveries"] == []
    assert summary["first_nonfinite"] is None
    scale = float(model.optimizer.dynamic_scale.numpy())
    assert scale < 2.0**15  # halved at each of its skips, not put back
    assert int(model.optimizer.iterations.numpy()) < 4


def test_skip_reads_the_device_no_more_than_stop(tmp_path, monkeypatch):
    """The undo decision is made on the device: a run with "skip" makes the
    same device reads as one with "stop" (one per execution)."""
    reads = []
    original = device_record._read
    monkeypatch.setattr(device_record, "_read", lambda var: reads.append(1) or original(var))
    x, y = _data(nan_steps=())
    counts = {}
    for mode in ("stop", "skip"):
        reads.clear()
        model = _model(steps_per_execution=2)  # rows read from the buffer, not handed over
        watch = tb_nanwatch.NanWatch(str(tmp_path / mode), on_nonfinite=mode, remedy_trials=False)
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[watch])
        counts[mode] = len(reads)
    assert counts["skip"] == counts["stop"] == ROWS // BATCH // 2


def test_an_update_phase_nan_is_undone_only_with_a_copy_of_every_step(tmp_path, capfd):
    """Adam with epsilon 0 makes 0/0 in the update of a weight with zero
    gradients: the gradients are finite, so "on_suspect" copied nothing and
    the step cannot be undone (training stops, saying so); with
    "every_step" it is undone like any other."""
    from scenarios import fit, update_adam_eps0

    model, watch, _, _ = fit(
        update_adam_eps0, tmp_path / "suspect", on_nonfinite="skip", remedy_trials=False
    )
    summary = watch.journal.summary()
    assert summary["status"] == "stopped" and summary["steps"] == 1
    assert summary["skipped_nonfinite_steps"] == []
    assert "pre_step_weights='every_step'" in summary["recovery_stopped"]["why"]
    assert "went non-finite in the optimizer's update" in capfd.readouterr().err

    model, watch, _, _ = fit(
        update_adam_eps0,
        tmp_path / "every",
        on_nonfinite="skip",
        pre_step_weights="every_step",
        max_skips=2,
        remedy_trials=False,
    )
    summary = watch.journal.summary()
    assert summary["skipped_nonfinite_steps"] == [0, 1, 2]  # zero gradients every step
    assert summary["status"] == "stopped"
    assert all(np.isfinite(w).all() for w in model.get_weights())
    assert int(model.optimizer.iterations.numpy()) == 0


@pytest.mark.parametrize(
    ("name", "value"), [("max_skips", -1), ("max_skips", 1.5), ("max_rewinds", True)]
)
def test_bad_recovery_limits_are_refused_naming_them(tmp_path, name, value):
    with pytest.raises(ValueError, match=name):
        tb_nanwatch.NanWatch(str(tmp_path / "run"), **{name: value})


@pytest.mark.parametrize("mode", ["skip", "rewind"])
def test_recovering_needs_the_pre_step_weights(tmp_path, mode):
    with pytest.raises(ValueError, match="pre_step_weights"):
        tb_nanwatch.NanWatch(str(tmp_path / "run"), on_nonfinite=mode, pre_step_weights="off")


@pytest.mark.parametrize("mode", ["skip", "rewind"])
def test_a_tf1_graph_refuses_to_recover_naming_the_option(tmp_path, mode):
    """A TF1 graph's train op has no undo: refused when it is built, not a silent "skip"."""
    from tb_nanwatch.compat.v1 import GraphWatcher

    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        features = v1.placeholder(tf.float32, [None, 3], name="features")
        weight = v1.get_variable("w", [3, 1])
        loss = tf.reduce_mean(tf.square(tf.matmul(features, weight)))
        watch = GraphWatcher(str(tmp_path / "graph"), loss, on_nonfinite=mode)
        with pytest.raises(ValueError, match=f"on_nonfinite='{mode}' undoes a step inside"):
            watch.minimize(v1.train.GradientDescentOptimizer(0.01))


def test_a_tf_keras_fit_refuses_to_recover_naming_the_option(tmp_path):
    import tf_keras

    model = tf_keras.Sequential([tf_keras.layers.Dense(1, input_shape=(4,))])
    model.compile(optimizer=tf_keras.optimizers.SGD(0.01), loss="mse")
    x, y = _data(nan_steps=())
    watch = tb_nanwatch.NanWatch(str(tmp_path / "run"), on_nonfinite="skip")
    with pytest.raises(ValueError, match="on_nonfinite='skip' needs a Keras 3 model"):
        model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[watch])


# -- MirroredStrategy ------------------------------------------------------------------------


def mirrored_worker(out: str, log_dir: str) -> None:
    """Skip under a 2-replica MirroredStrategy, against the same strategy's
    training without the NaN batch (whose row is in replica 0's shard)."""
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    x, y = _data()
    with strategy.scope():
        model = _model()
    watch = tb_nanwatch.NanWatch(log_dir, on_nonfinite="skip", remedy_trials=False)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[watch])
    with strategy.scope():
        reference = _model()
    reference.fit(*_without(x, y, {3}), batch_size=BATCH, shuffle=False, verbose=0)
    summary = watch.journal.summary()
    per_replica = [
        [np.asarray(local.numpy()).tolist() for local in v.value.values] for v in model.weights
    ]
    result = {
        "differences": [
            float(np.abs(a - b).max())
            for a, b in zip(model.get_weights(), reference.get_weights(), strict=True)
        ],
        "replicas_agree": all(p[0] == p[1] for p in per_replica),
        "finite": all(np.isfinite(w).all() for w in model.get_weights()),
        "iterations": [int(model.optimizer.iterations.numpy())]
        + [int(reference.optimizer.iterations.numpy())],
        "replicas": summary["replicas"],
        "skipped": summary["skipped_nonfinite_steps"],
        "incident_replica": summary["first_nonfinite"].get("replica"),
    }
    with open(out, "w") as f:
        json.dump(result, f)


def test_mirrored_skip_trains_as_if_the_nan_batch_was_not_there(tmp_path):
    out = tmp_path / "result.json"
    found = run_worker([__file__, "mirrored", str(out), str(tmp_path / "run")], out)
    assert found["replicas"] == 2
    assert found["incident_replica"] == 0  # the NaN row was in replica 0's shard only
    assert found["finite"] and found["replicas_agree"]
    assert max(found["differences"]) < 1e-6
    assert found["iterations"] == [5, 5]
    assert found["skipped"] == [3]


if __name__ == "__main__":
    if sys.argv[1] == "mirrored":
        mirrored_worker(sys.argv[2], sys.argv[3])
