"""Several fits, several watchers, one log dir: every stage is kept, no two
runs' records are ever mixed (the rule is in tb_nanwatch.record.writing.run_dirs)."""

from __future__ import annotations

import io
import json
import os

import keras
import numpy as np
from nanwatch_testlib import watched_step
from test_crash_safety import read_run

import tb_nanwatch
from tb_nanwatch import cli


def _data(n: int, nan_row: int = -1) -> tuple[np.ndarray, np.ndarray]:
    x = np.random.RandomState(0).uniform(0.5, 1.5, (n, 3)).astype("float32")
    if nan_row >= 0:
        x[nan_row, 1] = np.nan
    return x, np.ones((n, 1), "float32")


def _model() -> keras.Model:
    inp = keras.Input((3,), name="features")
    h = keras.layers.Dense(4, activation="relu", name="base")(inp)
    model = keras.Model(inp, keras.layers.Dense(1, name="head")(h))
    model.compile(optimizer="sgd", loss="mse")
    return model


def _report(log_root) -> dict[str, int]:
    out = io.StringIO()
    assert cli.main(["report", str(log_root), "--json"], out=out) == 0
    return {run["run"]: run["steps"] for run in json.loads(out.getvalue())["runs"]}


def test_freeze_then_fine_tune_keeps_both_stages(tmp_path):
    model = _model()
    watch = tb_nanwatch.NanWatch(str(tmp_path / "logs" / "run"), on_nonfinite="continue")
    model.get_layer("base").trainable = False  # stage 1: the head only
    model.compile(optimizer="sgd", loss="mse")
    model.fit(*_data(40), batch_size=8, shuffle=False, verbose=0, callbacks=[watch])
    first = watch.journal
    model.get_layer("base").trainable = True  # stage 2: everything
    model.compile(optimizer="sgd", loss="mse")
    model.fit(*_data(24, nan_row=17), batch_size=8, shuffle=False, verbose=0, callbacks=[watch])
    second = watch.journal

    assert first is not second and first.closed and second.closed
    assert _report(tmp_path / "logs") == {"run": 5, "run/stage_2": 3}
    stage_1, _, incident_1 = read_run(str(tmp_path / "logs" / "run"))
    stage_2, _, incident_2 = read_run(str(tmp_path / "logs" / "run" / "stage_2"))
    assert (stage_1["stage"], stage_1["status"], incident_1) == (1, "finished", None)
    assert (stage_2["stage"], stage_2["status"]) == (2, "finished")
    assert incident_2["step"] == 2 and stage_2["first_nonfinite"]["step"] == 2
    # The second stage's bundle lives in its own dir, next to its record.
    assert os.path.exists(
        os.path.join(tmp_path, "logs", "run", "stage_2", stage_2["repro_bundle"], "bundle.npz")
    )


def test_a_new_watcher_never_mixes_its_record_into_another_run(tmp_path):
    log_dir = str(tmp_path / "logs" / "run")
    model = _model()
    model.fit(
        *_data(24, nan_row=9),
        batch_size=8,
        shuffle=False,
        verbose=0,
        callbacks=[tb_nanwatch.NanWatch(log_dir, on_nonfinite="continue")],
    )
    before, _, incident_before = read_run(log_dir)

    second = tb_nanwatch.NanWatch(log_dir, on_nonfinite="continue")
    model.fit(*_data(40), batch_size=8, shuffle=False, verbose=0, callbacks=[second])
    assert second.journal.writer.log_dir == os.path.join(log_dir, "run_2")

    after, _, incident_after = read_run(log_dir)
    assert after["steps"] == before["steps"] == 3
    assert incident_after == incident_before and incident_before["step"] == 1
    assert _report(tmp_path / "logs") == {"run": 3, "run/run_2": 5}


def test_step_watchers_over_time_each_get_their_own_run(tmp_path):
    log_dir = str(tmp_path / "logs" / "loop")
    model = _model()
    loss_fn = keras.losses.MeanSquaredError()
    dirs = []
    for steps in (2, 4, 3):
        optimizer = keras.optimizers.SGD(0.01)
        watcher = tb_nanwatch.StepWatcher(log_dir, model, optimizer)

        train_step = watched_step(watcher, model, optimizer, loss_fn)

        x, y = _data(8 * steps)
        for i in range(steps):
            train_step(x[i * 8 : (i + 1) * 8], y[i * 8 : (i + 1) * 8])
            watcher.end_step()
        watcher.close()
        dirs.append(watcher.log_dir)

    assert dirs == [log_dir, os.path.join(log_dir, "run_2"), os.path.join(log_dir, "run_3")]
    assert _report(tmp_path / "logs") == {"loop": 2, "loop/run_2": 4, "loop/run_3": 3}
