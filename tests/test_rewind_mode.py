"""``on_nonfinite="rewind"``: back to a rewind point, on with the remedy that
its trial showed to work.

The scenario (tests/test_trials.py's): a 5-layer ReLU MLP, SGD 0.05, targets
near 100: Inf by step 3. Its trials find ``scale_targets`` (not settable on a
running model), ``clipnorm=1.0`` (learning) and ``lr x0.01`` (stops
learning); a fit with ``"rewind"`` goes back to the state before step 0, sets
``clipnorm=1.0`` (the step traced again to read it) and trains on, finite.
"""

from __future__ import annotations

import glob
import os

import keras
import numpy as np
import pytest
from nanwatch_testlib import PLUGIN, TRIAL_BUDGET_S, get_json, report_json, route_client

import tb_nanwatch
from tb_nanwatch import cli
from tb_nanwatch.record import callback

BATCH = 8
EPOCHS = 5
STEPS = 4 * EPOCHS


def _targets_near_100():
    rng = np.random.RandomState(1)
    x = rng.normal(size=(4 * BATCH, 8)).astype("float32")
    y = (100 + rng.normal(size=(4 * BATCH, 1))).astype("float32")
    return x, y


def _mlp(optimizer=None) -> keras.Model:
    keras.utils.set_random_seed(0)
    layers = [keras.layers.Dense(32, activation="relu") for _ in range(4)]
    model = keras.Sequential([keras.Input((8,)), *layers, keras.layers.Dense(1)])
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.05), loss="mse")
    return model


def _fit(log_dir, epochs=EPOCHS, callbacks=(), **options):
    x, y = _targets_near_100()
    model = _mlp()
    watch = tb_nanwatch.NanWatch(str(log_dir), trial_budget_s=TRIAL_BUDGET_S, **options)
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[watch, *callbacks],
    )
    return model, watch, history


@pytest.fixture(scope="module")
def rewound(tmp_path_factory):
    """The rewind run, with a checkpoint after every batch (after NanWatch's)."""
    root = tmp_path_factory.mktemp("rewind")
    checkpoints = root / "ckpt"
    initial = [w.copy() for w in _mlp().get_weights()]
    saver = keras.callbacks.ModelCheckpoint(
        str(checkpoints / "e{epoch}_b{batch}.weights.h5"), save_weights_only=True, save_freq=1
    )
    model, watch, history = _fit(root / "logs" / "run", callbacks=[saver], on_nonfinite="rewind")
    return {
        "root": root,
        "logdir": root / "logs",
        "model": model,
        "watch": watch,
        "history": history.history,
        "initial": initial,
        "checkpoints": checkpoints,
    }


def test_without_help_the_run_goes_non_finite_by_step_3(tmp_path):
    _, watch, _ = _fit(tmp_path / "stop", remedy_trials=False)
    assert watch.incident is not None and watch.incident["step"] <= 3


def test_the_run_finishes_with_rewind_finite_and_trains_past_the_incident(rewound):
    model, summary = rewound["model"], rewound["watch"].journal.summary()
    assert all(np.isfinite(w).all() for w in model.get_weights())
    assert summary["status"] == "finished"
    assert summary["first_nonfinite"]["step"] == 3
    assert summary["steps"] == STEPS  # every step after the incident recorded
    (recovery,) = summary["recoveries"]
    assert {k: recovery[k] for k in ("step", "rewound_to", "skipped_batches")} == {
        "step": 3,
        "rewound_to": 0,
        "skipped_batches": 4,
    }
    assert recovery["remedy"] == {"id": "clip_gradients", "setting": "clipnorm=1.0"}
    assert model.optimizer.clipnorm == 1.0
    assert summary["skipped_nonfinite_steps"] == []  # nothing went non-finite again
    # The trials ran at the incident, not again at the end.
    assert os.path.exists(os.path.join(rewound["watch"].log_dir, "repro", "trials.json"))
    losses = rewound["history"]["loss"][1:]  # the epochs after the rewind
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_the_retraced_step_uses_the_remedys_setting(tmp_path, monkeypatch):
    """Without the new trace the compiled step keeps clipping off: the run goes
    non-finite again, and with max_rewinds=1 that stops it."""
    monkeypatch.setattr(callback.NanWatch, "_retrace", lambda self: None)
    model, watch, _ = _fit(tmp_path / "run", on_nonfinite="rewind", max_rewinds=1)
    summary = watch.journal.summary()
    assert len(summary["recoveries"]) == 1
    assert summary["status"] == "stopped"
    assert "max_rewinds=1" in summary["recovery_stopped"]["why"]
    assert summary["steps"] < STEPS
    assert all(np.isfinite(w).all() for w in model.get_weights())  # the step was undone


def test_the_checkpoint_after_the_rewind_holds_the_rewound_finite_weights(rewound):
    saved = sorted(glob.glob(str(rewound["checkpoints"] / "*.weights.h5")))
    assert len(saved) == STEPS
    model = _mlp()
    for path in saved:
        model.load_weights(path)
        assert all(np.isfinite(w).all() for w in model.get_weights()), path
    model.load_weights(str(rewound["checkpoints"] / "e1_b4.weights.h5"))  # step 3: the rewind
    for got, want in zip(model.get_weights(), rewound["initial"], strict=True):
        np.testing.assert_array_equal(got, want)


def test_the_recovery_is_in_the_report_text_and_json(rewound, capsys):
    runs = report_json(rewound["logdir"])
    (run,) = runs
    (recovery,) = run["recoveries"]
    assert recovery["step"] == 3 and recovery["rewound_to"] == 0
    assert recovery["remedy"] == {"id": "clip_gradients", "setting": "clipnorm=1.0"}
    assert recovery["skipped_batches"] == 4
    assert cli.main(["report", str(rewound["logdir"])]) == 0
    text = capsys.readouterr().out
    onset = rewound["watch"].journal.summary()["recoveries"][0]["onset"]
    assert (
        f"  recovery: rewound at step 3 (explosion onset at step {onset}) to the state before "
        "step 0, clip_gradients set (clipnorm=1.0), 4 batches not trained on again\n" in text
    )


def test_the_timeline_route_carries_the_recovery(rewound):
    body = get_json(route_client(rewound["logdir"]), f"{PLUGIN}/timeline?run=run")
    (marker,) = body["recoveries"]
    assert marker["step"] == 3 and marker["rewound_to"] == 0
    assert marker["label"] == "rewind to 0: clipnorm=1.0"


def test_rewind_without_a_live_remedy_falls_back_to_skip_and_says_so(tmp_path, capfd):
    """A NaN row: its remedy (drop the bad rows) works in the trial but is no
    optimizer setting; the run skips the step instead."""
    from test_skip import BATCH as SKIP_BATCH
    from test_skip import _assert_same_training, _data, _model, _without

    x, y = _data()
    model = _model()
    watch = tb_nanwatch.NanWatch(str(tmp_path / "run"), on_nonfinite="rewind")
    model.fit(x, y, batch_size=SKIP_BATCH, shuffle=False, verbose=0, callbacks=[watch])
    reference = _model()
    reference.fit(*_without(x, y, {3}), batch_size=SKIP_BATCH, shuffle=False, verbose=0)
    _assert_same_training(model, reference)
    summary = watch.journal.summary()
    assert summary["recoveries"] == [] and summary["skipped_nonfinite_steps"] == [3]
    assert summary["skip_fallback"]["step"] == 3
    assert "drop_bad_rows" in summary["skip_fallback"]["why"]
    assert "Falling back to skip" in capfd.readouterr().err


def test_a_custom_loop_never_rewinds_into_a_fix_that_stopped_learning(tmp_path):
    """Its own tf.function cannot be traced again: clipping, which kept
    learning, is out; the lower rate (a variable the step reads) kept the run
    finite but stopped learning, so it is not set over clipping: no rewind,
    and why names both."""
    from nanwatch_testlib import watched_mse_step

    x, y = _targets_near_100()
    model = _mlp()
    optimizer = keras.optimizers.SGD(0.05)
    watcher = tb_nanwatch.StepWatcher(
        str(tmp_path / "loop"), model, optimizer, on_nonfinite="rewind"
    )
    step = watched_mse_step(watcher, model, optimizer)
    for _ in range(EPOCHS):
        for i in range(4):
            step(x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH])
            watcher.end_step()
    watcher.close()
    summary = watcher.journal.summary()
    assert summary["recoveries"] == []
    assert float(optimizer.learning_rate.numpy()) == pytest.approx(0.05)  # nothing set
    why = summary["skip_fallback"]["why"]
    assert "lower_lr kept the trial finite but stopped learning" in why, why
    assert "clip_gradients needs the train step traced again" in why, why


# -- the diagnosis after a rewind ------------------------------------------------------


def _judged(rewind_at: int | None) -> list[int]:
    """Loss 1 for 10 steps, then 1e5 from step 10 on (above the line, which
    needs 3 steps in a row to explode); a rewind after step 11 or none.
    Returns the steps at which an explosion was confirmed."""
    from nanwatch_testlib import base_vector

    from tb_nanwatch.evidence import diagnosis
    from tb_nanwatch.evidence.options import WatchOptions
    from tb_nanwatch.record.writing.synthetic import build_schema

    schema = build_schema(2)
    judge = diagnosis.RunDiagnosis(schema, WatchOptions())
    confirmed = []
    for step in range(14):
        vector = base_vector(schema, step)
        vector[schema.header_index("loss")] = 1.0 if step < 10 else 1e5
        verdict = judge.judge(diagnosis.StepPlace(step, 0, step), vector)
        if verdict.explosion is not None:
            confirmed.append(step)
        if step == rewind_at:
            judge.rewound()
    return confirmed


def test_steps_after_a_rewind_do_not_continue_the_explosion_before_it():
    assert _judged(None) == [12]  # steps 10, 11, 12 above the line
    assert _judged(11) == []  # after the rewind the run is judged afresh


def test_the_host_knows_which_steps_the_compiled_step_undid():
    from nanwatch_testlib import base_vector

    from tb_nanwatch.evidence import diagnosis
    from tb_nanwatch.record.writing.synthetic import build_schema

    schema = build_schema(2)
    update = next(e for e in schema.entries if e.phase == "update")
    forward = next(e for e in schema.entries if e.phase == "forward")
    on_suspect = diagnosis.UndoneSteps(schema, whole_step=False)
    every_step = diagnosis.UndoneSteps(schema, whole_step=True)
    healthy = base_vector(schema, 0)
    assert not on_suspect.undone(healthy)
    nan_forward = healthy.copy()
    nan_forward[forward.index("nan")] = float("nan")  # a NaN count is non-zero too
    assert on_suspect.undone(nan_forward) and every_step.undone(nan_forward)
    nan_update = healthy.copy()
    nan_update[update.index("inf")] = 3.0
    # Without a copy of every step an update-phase NaN cannot be undone.
    assert not on_suspect.undone(nan_update) and every_step.undone(nan_update)
    nan_forward[schema.header_index("skipped")] = 1.0  # the loss scaler's own skip
    assert not on_suspect.undone(nan_forward)
