"""NanWatch in the setups users run: XLA, steps_per_execution, mixed precision
and the model kinds (subclassed, nested, RNN, attention, frozen, multi-I/O)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import scenarios
from scenarios import fit, origin

import tb_nanwatch

# -- XLA and steps_per_execution: the same diagnosis --------------------------


@pytest.mark.parametrize(
    "compile_kwargs",
    [
        {},
        {"jit_compile": True},
        {"steps_per_execution": 4},
        {"jit_compile": True, "steps_per_execution": 4},
    ],
    ids=["plain", "xla", "spe4", "xla_spe4"],
)
def test_multi_io_same_diagnosis_with_xla_and_steps_per_execution(compile_kwargs, tmp_path):
    _, watch, truth, _ = fit(scenarios.ratio_multi_io, tmp_path, compile_kwargs=compile_kwargs)
    assert origin(watch.incident) == truth
    assert watch.incident["tensor"] == "output of ratio"
    # Exact, not rounded to the execution (step 9 is in the middle of 8..11).
    assert (
        watch.journal.steps == truth["step"] + 1
        if not compile_kwargs.get("steps_per_execution")
        else watch.journal.steps == 12
    )
    summary = watch.journal.summary()
    assert summary["steps_per_execution"] == compile_kwargs.get("steps_per_execution", 1)
    assert summary["jit_compile"] == bool(compile_kwargs.get("jit_compile"))
    # The bundle holds the exact incident step's batch, even with 4 steps per execution.
    bundle = tb_nanwatch.load_bundle(str(tmp_path))
    assert bundle.info["batch_of_step"] == truth["step"] and bundle.info["exact"]
    assert bundle.info["weights_before_step"] == truth["step"]
    x = bundle.x
    assert (x["den"] == 0).sum() == 1 and x["den"][5, 0] == 0


def test_steps_per_execution_records_every_step_and_partial_executions(tmp_path):
    # 10 batches an epoch with 4 steps per execution: executions of 4, 4, 2.
    _, watch, _, _ = fit(
        scenarios.healthy_small, tmp_path, epochs=2, compile_kwargs={"steps_per_execution": 4}
    )
    journal = watch.journal
    assert watch.incident is None
    assert journal.steps == 20
    epoch_col = journal.series_columns.index("epoch")
    batch_col = journal.series_columns.index("batch")
    rows = np.stack(journal._chunk_rows)
    assert rows[:, epoch_col].tolist() == [0] * 10 + [1] * 10
    assert rows[:, batch_col].tolist() == list(range(10)) * 2
    # Each step has its own iteration count (not one per execution).
    assert rows[:, journal.series_columns.index("iterations")].tolist() == list(range(20))


def test_steps_per_execution_incident_epoch_and_batch(tmp_path):
    def build():
        return scenarios.ratio_multi_io(zero_step=13, steps=16)

    _, watch, _, _ = fit(build, tmp_path, epochs=1, compile_kwargs={"steps_per_execution": 4})
    assert (watch.incident["step"], watch.incident["epoch"], watch.incident["batch"]) == (13, 0, 13)


# -- mixed precision ------------------------------------------------------------


def test_mixed_precision_skips_are_not_incidents_until_the_streak(tmp_path, mixed_precision):
    model, watch, truth, _ = fit(scenarios.mixed_log_negative, tmp_path, max_consecutive_skips=3)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert origin(watch.incident) == truth
    assert "3 consecutive steps skipped" in watch.incident["note"]
    assert watch.journal.skipped_steps == [4, 5, 6]
    # The loss scale is on the timeline, as float32 statistics.
    rows = np.stack(watch.journal._chunk_rows)
    scale = rows[:, watch.journal.series_columns.index("loss_scale")]
    assert scale.tolist() == [32768.0] * 5 + [16384.0, 8192.0]
    # Skipped steps never changed the weights: the saved pre-step weights are finite.
    assert all(np.isfinite(w.numpy()).all() for w in model.trainable_weights)


def test_mixed_precision_skips_alone_are_no_incident(tmp_path, mixed_precision):
    _, watch, _, _ = fit(
        scenarios.mixed_log_negative, tmp_path, max_consecutive_skips=0, min_loss_scale=0
    )
    assert watch.incident is None
    assert watch.journal.skipped_steps == [4, 5, 6, 7, 8, 9]
    assert watch.journal.summary()["skipped_ranges"] == [[4, 9]]


def test_mixed_precision_loss_scale_floor_is_an_incident(tmp_path, mixed_precision):
    _, watch, _, _ = fit(
        scenarios.mixed_log_negative, tmp_path, max_consecutive_skips=0, min_loss_scale=2**13
    )
    assert watch.incident["step"] == 7  # 32768, 16384, 8192, then 4096 < 8192
    assert "below the floor" in watch.incident["note"]
    assert watch.incident["phase"] == "forward" and watch.incident["layer"] == "log"


# -- model kinds --------------------------------------------------------------------


@pytest.mark.parametrize(
    "build",
    [scenarios.subclassed, scenarios.recurrent, scenarios.attention, scenarios.frozen_norm],
    ids=lambda b: b.__name__,
)
def test_each_model_kind_is_diagnosed_at_its_origin(build, tmp_path):
    _, watch, truth, _ = fit(build, tmp_path)
    assert origin(watch.incident) == truth


def test_rnn_cells_are_named_as_not_watched(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="tb_nanwatch"):
        _, watch, _, _ = fit(scenarios.recurrent, tmp_path)
    not_watched = watch.journal.summary()["not_watched"]
    assert any(note.startswith("lstm/lstm_cell: RNN cell") for note in not_watched)
    assert any(note.startswith("gru/gru_cell: RNN cell") for note in not_watched)
    assert "lstm" in watch.journal.summary()["layers"]
    assert "does not watch these layers" in caplog.text


def test_attention_sublayers_are_watched(tmp_path):
    _, watch, _, _ = fit(scenarios.attention, tmp_path)
    layers = watch.journal.summary()["layers"]
    assert "attention" in layers and any(p.startswith("attention/") for p in layers)


def test_custom_train_step_is_refused_with_a_pointer_to_step_watcher(tmp_path):
    class Custom(keras.Model):
        def train_step(self, data):
            return super().train_step(data)

    inp = keras.Input((3,))
    model = Custom(inp, keras.layers.Dense(1)(inp))
    model.compile(optimizer="sgd", loss="mse")
    with pytest.warns(RuntimeWarning, match="StepWatcher"):
        model.fit(
            np.ones((8, 3)),
            np.ones((8, 1)),
            verbose=0,
            callbacks=[tb_nanwatch.NanWatch(str(tmp_path))],
        )
