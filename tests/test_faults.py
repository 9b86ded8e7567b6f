"""Faults while recording: a log dir deleted or replaced mid-run, Ctrl-C caught
by a notebook, glob characters in a log dir, two writers of one log dir.

The record survives what it can (what is still in memory is written again,
warned once), says how the run ended (``interrupted``), and two runs are
never mixed in one run dir.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from closed_box_lib import REPO
from nanwatch_testlib import PLUGIN, get_json, route_client, watched_mse_step

from tb_nanwatch import cli
from tb_nanwatch.evidence.options import WatchOptions
from tb_nanwatch.record.writing.journal import RunJournal
from tb_nanwatch.record.writing.synthetic import build_schema, write_synthetic_run

LOST = "deleted or replaced"


def _report(logdir: str) -> dict[str, dict]:
    out = io.StringIO()
    assert cli.main(["report", logdir, "--json"], out=out) == 0
    return {run["run"]: run for run in json.loads(out.getvalue())["runs"]}


def _vector(schema, step: int, nan: bool = False) -> np.ndarray:
    vector = np.zeros(schema.size, np.float32)
    fields = ("loss", "grad_norm", "lr", "loss_scale", "skipped", "iterations")
    vector[[schema.header_index(f) for f in fields]] = (1.0 / (step + 1), 1.0, 1e-3, 0, 0, step)
    if nan:
        vector[schema.find(kind="activation")[1].index("nan")] = 2.0
    return vector


def _record_with_losses(run_dir: str, lose, steps: int = 1201, incident: int = 50) -> RunJournal:
    """A run of ``steps`` steps with an incident; ``lose(run_dir)`` is called
    after steps 1100 and 1150 (then a flush, as the journal's timer would)."""
    schema = build_schema(3)
    options = WatchOptions(flush_secs=1e9, snapshot_every=100)
    journal = RunJournal(run_dir, schema, {"model": "faults"}, options)
    for step in range(steps):
        journal.record(step, 0, step, _vector(schema, step, nan=step == incident))
        if step in (1100, 1150):
            lose(run_dir)
            journal.flush()
    journal.close()
    return journal


def _replace(run_dir: str) -> None:
    os.rename(run_dir, run_dir + f"_moved_{time.monotonic_ns()}")
    os.makedirs(run_dir)  # someone else's empty dir in its place


@pytest.mark.parametrize("lose", [shutil.rmtree, _replace], ids=["deleted", "replaced"])
def test_a_lost_log_dir_is_noticed_warned_once_and_written_again(tmp_path, caplog, lose):
    caplog.set_level(logging.WARNING, logger="tb_nanwatch")
    logdir = str(tmp_path / "logs")
    write_synthetic_run(os.path.join(logdir, "other"), 20)
    journal = _record_with_losses(os.path.join(logdir, "run"), lose)
    warned = [r.getMessage() for r in caplog.records if LOST in r.getMessage()]
    assert len(warned) == 1 and "step 1024" in warned[0], warned
    runs = _report(logdir)
    assert runs["run"]["steps"] == 1201 and runs["run"]["first_nonfinite"]["step"] == 50
    assert runs["other"]["steps"] == 20
    assert journal.summary()["record_rewritten_at"] == [1101, 1151]
    # What was in memory is back: the current chunk, the incident's flight window.
    client = route_client(logdir)
    timeline = get_json(client, f"{PLUGIN}/timeline?run=run")
    assert timeline["steps"][0] == 1024 and timeline["steps"][-1] == 1200
    incident = get_json(client, f"{PLUGIN}/incident?run=run")
    assert incident["incident"]["step"] == 50 and incident["heatmap"] is not None


def _xy(n: int = 48):
    x = np.random.RandomState(0).uniform(size=(n, 3)).astype("float32")
    return x, np.ones((n, 1), "float32")


def _model():
    import keras

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    return model


def test_fit_survives_its_log_dir_being_deleted(tmp_path, caplog):
    import keras

    import tb_nanwatch

    caplog.set_level(logging.WARNING, logger="tb_nanwatch")
    log_dir = str(tmp_path / "logs" / "run")
    watch = tb_nanwatch.NanWatch(log_dir, flush_secs=0.01)

    class Delete(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 3:
                # The recorder may write the record again while the tree is
                # removed (that is what is tested): the dir then is not empty.
                shutil.rmtree(log_dir, ignore_errors=True)
            time.sleep(0.02)

    _model().fit(*_xy(), batch_size=4, verbose=0, callbacks=[watch, Delete()])
    assert len([r for r in caplog.records if LOST in r.getMessage()]) == 1
    run = _report(str(tmp_path / "logs"))["run"]
    assert run["steps"] == 12


@pytest.fixture
def python_sigint_handler():
    """SIGINT handled as in an interactive Python or a notebook kernel: a
    process started in the background of a script inherits SIGINT ignored."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_a_caught_keyboard_interrupt_ends_the_run_as_interrupted(tmp_path, python_sigint_handler):
    import keras

    import tb_nanwatch

    log_dir = str(tmp_path / "logs" / "run")
    watch = tb_nanwatch.NanWatch(log_dir, flush_secs=1e9)

    class CtrlC(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 3:
                signal.raise_signal(signal.SIGINT)  # what Ctrl-C in a notebook sends
                time.sleep(1)  # the handler raises KeyboardInterrupt in here

    with pytest.raises(KeyboardInterrupt):  # the notebook kernel catches it and lives on
        _model().fit(*_xy(), batch_size=4, verbose=0, callbacks=[watch, CtrlC()])
    journal = watch.journal
    deadline = time.monotonic() + 10
    while not journal.closed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert journal.closed and journal.status == "interrupted"
    assert _report(str(tmp_path / "logs"))["run"]["steps"] == 4


def test_a_custom_loop_left_by_keyboard_interrupt_is_interrupted(tmp_path):
    import keras

    import tb_nanwatch

    model = _model()
    optimizer = keras.optimizers.SGD(0.01)
    x, y = _xy(8)
    with pytest.raises(KeyboardInterrupt):
        with tb_nanwatch.StepWatcher(str(tmp_path / "run"), model, optimizer) as watcher:
            step = watched_mse_step(watcher, model, optimizer)
            for _ in range(3):
                step(x, y)
                watcher.end_step()
            raise KeyboardInterrupt
    assert watcher.journal.closed and watcher.journal.status == "interrupted"
    assert watcher.journal.steps == 3


# -- log dirs: literal names, one writer each ---------------------------------------------


def test_a_log_dir_with_glob_characters_is_taken_literally(tmp_path, monkeypatch):
    from tb_nanwatch.record.after_incident import bundle
    from tb_nanwatch.record.writing import run_dirs

    log_dir = str(tmp_path / "sweep" / "lr[0.1]")
    first = run_dirs.claim_run_dir(log_dir)
    write_synthetic_run(first, 16)
    assert first == log_dir and run_dirs.holds_record(log_dir)
    # A later script (a fresh process: no claims, and a run left without a lock).
    monkeypatch.setattr(run_dirs, "_claimed", set())
    os.remove(os.path.join(log_dir, run_dirs.LOCK_FILE))
    assert run_dirs.claim_run_dir(log_dir) == os.path.join(log_dir, "run_2")
    # A bundle under a bracketed path is found.
    shared = str(tmp_path / "shared" / "exp[1]")
    bundle.save_bundle(shared, 4, {}, [np.ones((2, 3), np.float32)], [0], {"incident": {}})
    assert bundle.load_bundle(shared).step == 4


CLAIMER = r"""
import os, sys, time
os.environ["CUDA_VISIBLE_DEVICES"] = ""
from tb_nanwatch.record.writing import run_dirs
from tb_nanwatch.record.writing.synthetic import write_synthetic_run
log_dir, go = sys.argv[1], sys.argv[2]
while not os.path.exists(go):
    time.sleep(0.005)
run_dir = run_dirs.claim_run_dir(log_dir)
write_synthetic_run(run_dir, 16)
print("CLAIMED " + run_dir, flush=True)
"""


def test_two_processes_given_one_log_dir_at_once_write_two_runs(tmp_path):
    log_dir, go = str(tmp_path / "logs" / "run"), str(tmp_path / "go")
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="3")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CLAIMER, log_dir, go],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        time.sleep(0.5)
        open(go, "w").close()  # both claim at the same moment
        outputs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    claimed = sorted(
        line.split(" ", 1)[1]
        for out, _ in outputs
        for line in out.splitlines()
        if "CLAIMED" in line
    )
    assert claimed == [log_dir, os.path.join(log_dir, "run_2")], outputs
    assert sum("already holds another run" in err for _, err in outputs) == 1
    runs = _report(str(tmp_path / "logs"))
    assert {name: run["steps"] for name, run in runs.items()} == {"run": 16, "run/run_2": 16}
