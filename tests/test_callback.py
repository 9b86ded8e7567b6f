"""The NanWatch callback under ``fit``: the diagnosis of each origin case, the
on_nonfinite modes, the reproduction bundle, its own failures and bad arguments."""

from __future__ import annotations

import os
import warnings

import keras
import numpy as np
import pytest
import scenarios
import tensorflow as tf
from scenarios import fit, origin

import tb_nanwatch
from tb_nanwatch.record.callback import NonFiniteError


@pytest.mark.parametrize("build", scenarios.ORIGIN_CASES, ids=lambda b: b.__name__)
def test_fit_finds_the_step_phase_layer_and_kind_of_each_origin(build, tmp_path):
    model, watch, truth, _ = fit(build, tmp_path)
    assert origin(watch.incident) == truth
    # "stop" ends training right after the incident step.
    assert watch.journal.steps == truth["step"] + 1
    assert watch.journal.status == "stopped"


@pytest.mark.parametrize(
    "build", [scenarios.backward_sqrt_zero, scenarios.update_adam_eps0], ids=lambda b: b.__name__
)
def test_xla_gives_the_same_diagnosis(build, tmp_path):
    _, watch, truth, _ = fit(build, tmp_path, compile_kwargs={"jit_compile": True})
    assert origin(watch.incident) == truth


def test_healthy_run_has_no_incident_no_explosion(tmp_path):
    _, watch, _, history = fit(scenarios.healthy, tmp_path, epochs=2)
    assert watch.incident is None
    assert watch.journal.explosion_onset is None
    assert watch.journal.skipped_steps == []
    assert watch.journal.steps == 120
    assert len(history.history["loss"]) == 2
    assert watch.journal.summary()["warnings"] == []  # no early warning either


def test_explosion_without_nan_is_flagged_at_the_learning_rate_jump(tmp_path):
    _, watch, truth, _ = fit(scenarios.exploding, tmp_path)
    assert watch.incident is None
    onset = watch.journal.explosion_onset
    assert onset is not None
    assert truth["jump_step"] <= onset["step"] <= truth["jump_step"] + 10
    assert onset["signal"] in ("loss", "grad_norm", "logits")


def test_mixed_precision_skips_are_listed_not_incidents(tmp_path, mixed_precision):
    _, watch, _, _ = fit(scenarios.mixed_precision_skips, tmp_path)
    assert watch.incident is None
    skipped = watch.journal.skipped_steps
    assert skipped[:3] == [0, 1, 2]  # the initial loss scale overflows first
    # A few halvings at the start are no collapse.
    assert watch.journal.summary()["warnings"] == []
    assert watch.journal.steps == 40
    loss_scale = watch.journal.schema.header_index("loss_scale")
    _, window = watch.journal.flight_window()
    assert window[-1, loss_scale] < 2**15  # the loss scale came down


def test_a_streak_of_loss_scaler_skips_is_an_incident(tmp_path, mixed_precision):
    _, watch, _, _ = fit(scenarios.mixed_precision_skips, tmp_path, max_consecutive_skips=3)
    assert watch.incident is not None
    assert watch.incident["step"] == 0
    assert "consecutive" in watch.incident["note"]


def test_raise_mode_raises_after_writing(tmp_path, seeded):
    model, kwargs, truth = scenarios.input_nan()
    with pytest.raises(NonFiniteError) as info:
        model.fit(
            **kwargs,
            callbacks=[tb_nanwatch.NanWatch(str(tmp_path), on_nonfinite="raise")],
            verbose=0,
        )
    assert info.value.incident["step"] == truth["step"]
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path))


def test_continue_mode_keeps_training_and_first_incident(tmp_path):
    _, watch, truth, _ = fit(scenarios.input_nan, tmp_path, on_nonfinite="continue")
    assert watch.incident["step"] == truth["step"]
    assert watch.journal.steps == 12


def test_repro_bundle_holds_batch_and_pre_step_weights(tmp_path):
    model, watch, truth, _ = fit(scenarios.backward_sqrt_zero, tmp_path)
    bundle = tb_nanwatch.load_bundle(str(tmp_path))
    assert bundle.step == truth["step"]
    x, y = bundle.batch
    assert x.shape == (scenarios.BATCH, 3) and (x[1] == 0).all()
    # Before the step every weight was finite; the model now holds NaNs.
    assert all(np.isfinite(w).all() for w in bundle.weights.values())
    assert not all(np.isfinite(w.numpy()).all() for w in model.trainable_weights)
    # Replaying the saved step from the saved weights reproduces the NaN.
    bundle.restore(model)
    model.train_on_batch(x, y)
    assert not np.isfinite(model.get_layer("encode").kernel.numpy()).all()


def _counting_traces(monkeypatch) -> list:
    """A list that grows by one each time the recorded train step is traced."""
    from tb_nanwatch.record.in_step import train_step

    traces, real = [], train_step.recorded_train_step

    def counted(recorder, data):
        traces.append(1)
        return real(recorder, data)

    monkeypatch.setattr(train_step, "recorded_train_step", counted)
    return traces


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_later_fit_reuses_the_compiled_step_and_records_its_own_steps(
    tmp_path, monkeypatch, jit_compile
):
    # Each later fit of the same model (a new stage of the run) runs the step
    # the first fit traced and compiled: re-tracing it cost every fit a whole
    # first step again (an XLA MLP's 3 s). It still counts its steps from 0 and
    # captures its own incident, batch and pre-step weights.
    traces = _counting_traces(monkeypatch)
    keras.utils.set_random_seed(0)
    model, kwargs, truth = scenarios.backward_sqrt_zero()
    model.compile(optimizer=model.optimizer, loss=model.loss, jit_compile=jit_compile)
    rows = 3 * scenarios.BATCH
    healthy = dict(kwargs, x=kwargs["x"][:rows], y=kwargs["y"][:rows])
    watch = tb_nanwatch.NanWatch(str(tmp_path))
    model.fit(**healthy, callbacks=[watch], verbose=0)
    traced = len(traces)
    assert traced >= 1 and watch.incident is None and watch.journal.steps == 3
    model.fit(**healthy, callbacks=[watch], verbose=0)
    assert watch.incident is None and watch.journal.steps == 3
    model.fit(**kwargs, callbacks=[watch], verbose=0)
    assert len(traces) == traced  # neither later fit traced the step
    assert origin(watch.incident) == truth
    assert watch.journal.steps == truth["step"] + 1
    bundle = tb_nanwatch.load_bundle(str(tmp_path / "stage_3"))
    assert bundle.step == truth["step"] and bundle.info["exact"]
    assert (bundle.x[1] == 0).all()
    assert all(np.isfinite(w).all() for w in bundle.weights.values())
    if jit_compile:
        assert watch.journal.run_info["jit_compile"] is True


def test_a_fit_after_compile_traces_the_step_again(tmp_path, monkeypatch):
    # compile() makes a new loss (and here a new optimizer): the step compiled
    # before no longer computes what fit asks for, so it is traced again.
    traces = _counting_traces(monkeypatch)
    keras.utils.set_random_seed(0)
    model, kwargs, truth = scenarios.backward_sqrt_zero()
    rows = 3 * scenarios.BATCH
    watch = tb_nanwatch.NanWatch(str(tmp_path))
    model.fit(
        **dict(kwargs, x=kwargs["x"][:rows], y=kwargs["y"][:rows]), callbacks=[watch], verbose=0
    )
    traced = len(traces)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    model.fit(**kwargs, callbacks=[watch], verbose=0)
    assert len(traces) > traced
    assert origin(watch.incident) == truth


def test_a_fit_after_the_watcher_failed_starts_afresh(tmp_path, monkeypatch):
    # A fit whose recording failed (the watcher disabled itself) leaves nothing
    # to reuse: the next fit traces the step again and records.
    from tb_nanwatch.record.writing import journal

    traces = _counting_traces(monkeypatch)
    record_step, failing = journal.RunJournal._record_step, [True]

    def maybe_broken(self, step, *args):
        if failing[0]:
            raise RuntimeError("boom")
        return record_step(self, step, *args)

    monkeypatch.setattr(journal.RunJournal, "_record_step", maybe_broken)
    keras.utils.set_random_seed(0)
    model, kwargs, _ = scenarios.healthy_small()
    watch = tb_nanwatch.NanWatch(str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        model.fit(**kwargs, callbacks=[watch], verbose=0)
    traced = len(traces)
    failing[0] = False
    model.fit(**kwargs, callbacks=[watch], verbose=0)
    assert len(traces) > traced
    assert watch.journal.steps == len(kwargs["x"]) // scenarios.BATCH


def test_stop_keeps_backup_and_restore_state(tmp_path, seeded):
    backup_dir = tmp_path / "backup"
    model, kwargs, truth = scenarios.input_nan(nan_step=20, steps=24)
    data = tf.data.Dataset.from_tensor_slices((kwargs["x"], kwargs["y"])).batch(scenarios.BATCH)
    backup = keras.callbacks.BackupAndRestore(str(backup_dir))
    watch = tb_nanwatch.NanWatch(str(tmp_path / "run"))
    # Two 12-step epochs: the backup is saved after epoch 0, the NaN comes at step 20.
    model.fit(data, steps_per_epoch=12, epochs=2, callbacks=[backup, watch], verbose=0)
    assert watch.incident["step"] == truth["step"]
    assert (watch.incident["epoch"], watch.incident["batch"]) == (1, 8)
    saved = list(backup_dir.rglob("*.weights.h5"))
    assert saved, "BackupAndRestore's backup was deleted"
    restored = scenarios.input_nan()[0]
    restored.load_weights(str(saved[0]))
    assert all(np.isfinite(w.numpy()).all() for w in restored.weights)


def _fit_with_recording_failing(tmp_path, monkeypatch, from_step: int, message: str):
    """fit on the healthy scenario with every step from ``from_step`` on
    failing to be recorded; returns (our warnings, watcher, history)."""
    from tb_nanwatch.record.writing import journal

    record_step = journal.RunJournal._record_step

    def broken(self, step, *args):
        if step >= from_step:
            raise RuntimeError(message)
        return record_step(self, step, *args)

    monkeypatch.setattr(journal.RunJournal, "_record_step", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, watch, _, history = fit(scenarios.healthy, tmp_path)
    ours = [w for w in caught if "NanWatch stopped watching" in str(w.message)]
    return ours, watch, history


def test_watcher_failure_warns_once_and_training_goes_on(tmp_path, monkeypatch):
    ours, _, history = _fit_with_recording_failing(tmp_path, monkeypatch, 0, "boom")
    assert len(ours) == 1 and "boom" in str(ours[0].message)
    assert len(history.history["loss"]) == 1


def test_a_failure_recording_the_last_step_is_warned_about_at_the_end(tmp_path, monkeypatch):
    # The last step is recorded by the journal's worker thread after fit's
    # last on_train_batch_end: its failure still reaches the user (at close).
    ours, watch, _ = _fit_with_recording_failing(tmp_path, monkeypatch, 59, "boom at the end")
    assert len(ours) == 1 and "boom at the end" in str(ours[0].message)
    assert watch.journal.steps == 59 and watch.journal.closed


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="on_nonfinite"):
        tb_nanwatch.NanWatch("/tmp/nanwatch-args", on_nonfinite="explode")
    with pytest.raises(ValueError, match="window"):
        tb_nanwatch.NanWatch("/tmp/nanwatch-args", window=-1)


def test_unwritable_log_dir_is_named(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="log_dir"):
        tb_nanwatch.NanWatch(str(blocker / "run"))


def test_uncompiled_model_is_named(tmp_path):
    model = scenarios.mlp()
    watch = tb_nanwatch.NanWatch(str(tmp_path))
    watch.set_model(model)
    with pytest.raises(ValueError, match="model must be compiled"):
        watch.on_train_begin()


def test_every_step_is_recorded_across_epochs(tmp_path):
    _, watch, _, _ = fit(scenarios.healthy, tmp_path, epochs=3)
    summary = watch.journal.summary()
    assert summary["steps"] == 180
    assert summary["status"] == "finished"
    layers = summary["layers"]
    assert layers == ["dense_0", "dense_1", "dense_2", "head"]
    tf.debugging.assert_equal(len(watch.journal.series_columns) > 10, True)


def test_xla_bundle_of_an_embedding_model_holds_its_weights_before_the_incident_step(tmp_path):
    # An Embedding's gradient is an IndexedSlices; under XLA it goes through
    # the loop that copies the weights before the update, with its dense
    # shape kept a constant. Training up to the incident is unchanged: the
    # copied weights are those of the same model trained without NanWatch.
    rows, nan_step = 4 * scenarios.BATCH, 3
    rng = np.random.default_rng(0)
    x = rng.integers(0, 50, (rows, 6)).astype("int32")
    y = rng.normal(size=(rows, 1)).astype("float32")
    y[nan_step * scenarios.BATCH] = np.nan

    def trained(batches: int, callbacks: list) -> keras.Model:
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((6,), dtype="int32"),
                keras.layers.Embedding(50, 8),
                keras.layers.GlobalAveragePooling1D(),
                keras.layers.Dense(1),
            ]
        )
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", jit_compile=True)
        end = batches * scenarios.BATCH
        model.fit(
            x[:end],
            y[:end],
            batch_size=scenarios.BATCH,
            shuffle=False,
            callbacks=callbacks,
            verbose=0,
        )
        return model

    before_incident = trained(nan_step, [])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the watcher's own failures warn
        watch = tb_nanwatch.NanWatch(str(tmp_path))
        trained(nan_step + 1, [watch])
    assert watch.journal.run_info["jit_compile"] is True
    assert watch.incident is not None and watch.incident["step"] == nan_step
    bundle = tb_nanwatch.load_bundle(str(tmp_path))
    expected = [v.numpy() for v in before_incident.trainable_variables]
    assert len(bundle.weights) == len(expected)
    for got, want in zip(bundle.weights.values(), expected, strict=True):
        np.testing.assert_array_equal(got, want)
