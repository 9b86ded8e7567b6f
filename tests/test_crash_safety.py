"""Crash safety: SIGKILL, SIGTERM and exceptions never lose the flushed record.

The process tests start a real training process (``CHILD`` below: a small
Keras model watched by NanWatch with a short ``flush_secs``), kill it, and read
the run back through TensorBoard's loader and the reader, exactly as the
plugin and ``tb-nanwatch report`` do.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from nanwatch_testlib import CTX, multiplexer_provider

from tb_nanwatch.board import reader
from tb_nanwatch.evidence.options import WatchOptions
from tb_nanwatch.record.writing import crash_safety
from tb_nanwatch.record.writing.journal import RunJournal
from tb_nanwatch.record.writing.synthetic import build_schema

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The data and model of a training child: ``steps`` batches of ``BATCH`` rows,
# a NaN pixel in batch ``nan_step`` (none when negative), a model named MODEL_NAME.
CHILD_MODEL = r"""
rng = np.random.RandomState(0)
x = rng.uniform(0.5, 1.5, (steps * BATCH, 4)).astype("float32")
if nan_step >= 0:
    x[nan_step * BATCH + 1, 2] = np.nan
y = np.ones((len(x), 1), "float32")
inp = keras.Input((4,), name="pixels")
h = keras.layers.Dense(6, activation="relu", name="hidden")(inp)
model = keras.Model(inp, keras.layers.Dense(1, name="head")(h), name=MODEL_NAME)
model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
"""

CHILD = (
    r"""
import os, sys, time
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np
import keras
import tb_nanwatch

log_dir, mode, steps, nan_step, raise_at = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
BATCH, MODEL_NAME = 8, "crash_case"
"""
    + CHILD_MODEL
    + r"""watch = tb_nanwatch.NanWatch(log_dir, on_nonfinite="continue", flush_secs=0.2)


class Pace(keras.callbacks.Callback):
    # Runs after NanWatch: reports how many steps the journal has flushed.
    def on_train_batch_end(self, batch, logs=None):
        journal = watch.journal
        print(f"batch {batch} flushed {journal._flushed_steps if journal else 0}", flush=True)
        if batch == raise_at:
            raise RuntimeError("user code failed")
        time.sleep(0.03)


try:
    model.fit(x, y, batch_size=BATCH, shuffle=False, epochs=1, verbose=0,
              callbacks=[watch, Pace()])
except RuntimeError:
    if mode != "caught":
        raise
    print("caught", flush=True)
    time.sleep(120)  # a notebook that lives on after fit raised
print("done", flush=True)
"""
)


class TrainingChild:
    """A training script in its own process: its stdout lines are collected
    by a thread (``lines``), its stderr kept (``stderr``). The script gets the
    run dir, then ``args``."""

    def __init__(self, tmp_path, source: str, name: str, args: list[str]) -> None:
        script = tmp_path / name
        script.write_text(source)
        self.log_dir = str(tmp_path / "logs" / "run")
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env["CUDA_VISIBLE_DEVICES"] = ""
        self.proc = subprocess.Popen(
            [sys.executable, str(script), self.log_dir, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self.stderr = ""
        self._threads = [
            threading.Thread(target=self._read_out, daemon=True),
            threading.Thread(target=self._read_err, daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _read_out(self):
        for line in self.proc.stdout:
            self.lines.append(line.strip())

    def _read_err(self):
        self.stderr = self.proc.stderr.read()

    def join_readers(self) -> None:
        for thread in self._threads:
            thread.join(5)

    def recorded(self) -> int:
        """The most steps the journal had recorded (flushed), as the child printed."""
        return max(
            (int(line.split()[3]) for line in self.lines if line.startswith("batch ")), default=0
        )


class Child(TrainingChild):
    """This file's training script."""

    def __init__(self, tmp_path, mode, steps=3000, nan_step=8, raise_at=-1):
        args = [mode, str(steps), str(nan_step), str(raise_at)]
        super().__init__(tmp_path, CHILD, "child.py", args)

    def wait(self, timeout=60) -> int:
        code = self.proc.wait(timeout=timeout)
        self.join_readers()
        return code

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.wait()


@pytest.fixture
def child_factory(tmp_path):
    children = []

    def make(*args, **kwargs):
        child = Child(tmp_path, *args, **kwargs)
        children.append(child)
        return child

    yield make
    for child in children:
        child.kill()


def read_run(run_dir: str):
    """(summary, series, incident) of the run in ``run_dir``, or None."""
    logdir, name = os.path.split(run_dir)
    provider = multiplexer_provider(logdir)
    run = reader.load_run(provider, CTX, "", name)
    if run is None:
        return None
    series = reader.load_series(provider, CTX, "", run)
    incident = reader.load_incident(provider, CTX, "", run)
    return run.summary, series, incident


def wait_for(predicate, child: Child, timeout=90.0, interval=0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if child.proc.poll() is not None:
            child.wait()
            pytest.fail(f"child exited early ({child.proc.returncode}):\n{child.stderr[-3000:]}")
        time.sleep(interval)
    pytest.fail(f"timed out; child stdout tail {child.lines[-5:]}, stderr:\n{child.stderr[-3000:]}")


def steps_on_disk(run_dir: str) -> int:
    if not os.path.isdir(run_dir):
        return 0
    found = read_run(run_dir)
    return found[0]["steps"] if found else 0


def assert_series_complete(summary, series):
    """Every step 0..steps-1 has its row in the per-step series."""
    assert series is not None
    assert list(series.steps) == list(range(summary["steps"]))


def test_sigkill_keeps_flushed_steps_and_incident(child_factory):
    child = child_factory("run", nan_step=8)
    wait_for(lambda: child.recorded() >= 25, child, interval=0.05)
    seen = steps_on_disk(child.log_dir)  # read while it trains
    child.proc.send_signal(signal.SIGKILL)
    flushed_before_kill = child.recorded()
    assert child.wait() == -signal.SIGKILL

    summary, series, incident = read_run(child.log_dir)
    # Nothing the reader saw before the kill, nor any step the journal had
    # flushed, is lost; the run never closed, so it still says "running".
    assert summary["steps"] >= max(seen, flushed_before_kill) >= 25
    assert summary["status"] == "running"
    assert_series_complete(summary, series)
    # The incident (step 8, written the moment it was detected) is on disk,
    # with its diagnosis, flight window and reproduction bundle.
    for found in (summary["first_nonfinite"], incident):
        assert {k: found[k] for k in ("step", "phase", "layer", "kind")} == {
            "step": 8,
            "phase": "input",
            "layer": "pixels",
            "kind": "nan",
        }
    assert series.value("nonfinite", 8) == 1.0
    assert summary["repro_bundle"] == "repro/step_000000008"
    assert os.path.exists(os.path.join(child.log_dir, summary["repro_bundle"], "bundle.npz"))


def test_sigterm_closes_the_record(child_factory):
    child = child_factory("run", nan_step=-1)
    wait_for(lambda: child.recorded() >= 10, child, interval=0.05)
    # The child prints a batch line after NanWatch has recorded that step, so
    # every line read before the signal is a step recorded before it. The main
    # thread goes on while the record closes: a step it runs then may be
    # printed but not recorded (the closed record takes no more steps).
    recorded = len([line for line in child.lines if line.startswith("batch ")])
    child.proc.send_signal(signal.SIGTERM)
    # The handler chains to the default one: the process still dies by SIGTERM.
    assert child.wait() == -signal.SIGTERM

    summary, series, _ = read_run(child.log_dir)
    assert summary["status"] == "terminated"
    # Closed on SIGTERM: every step the callback recorded is on disk.
    assert summary["steps"] >= recorded
    assert_series_complete(summary, series)
    assert summary["first_nonfinite"] is None


def test_uncaught_exception_in_user_code_flushes(child_factory):
    child = child_factory("run", nan_step=3, raise_at=30)
    assert child.wait(timeout=120) == 1
    assert "user code failed" in child.stderr

    summary, series, incident = read_run(child.log_dir)
    assert summary["status"] == "raised"
    assert summary["steps"] == 31  # batches 0..30 were recorded before the raise
    assert_series_complete(summary, series)
    assert incident["step"] == 3


def test_caught_exception_steps_reach_disk_without_another_step(child_factory):
    """fit raised, the process lives on (a notebook): the background flusher
    writes the waiting steps within flush_secs; a later SIGKILL loses none."""
    child = child_factory("caught", nan_step=-1, raise_at=30)
    wait_for(lambda: "caught" in child.lines, child, interval=0.1)
    wait_for(lambda: steps_on_disk(child.log_dir) == 31, child, timeout=10)
    child.proc.send_signal(signal.SIGKILL)
    child.wait()
    summary, series, _ = read_run(child.log_dir)
    assert summary["steps"] == 31
    assert summary["status"] == "running"
    assert_series_complete(summary, series)


# -- in-process units (no TensorFlow needed) -----------------------------------


def _vector(schema, loss=1.0):
    vector = np.zeros(schema.size, np.float32)
    vector[schema.header_index("loss")] = loss
    return vector


def test_background_flusher_writes_idle_steps(tmp_path):
    schema = build_schema(2)
    journal = RunJournal(
        str(tmp_path / "run"), schema, {"model": "m"}, WatchOptions(flush_secs=0.1)
    )
    try:
        assert journal in crash_safety.open_journals()
        for step in range(5):
            journal.record(step, 0, step, _vector(schema))
        deadline = time.monotonic() + 10
        while journal.dirty and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not journal.dirty
        assert steps_on_disk(str(tmp_path / "run")) == 5
    finally:
        journal.close()
    assert journal not in crash_safety.open_journals()
    journal.close("raised")  # a second close does nothing
    assert journal.status == "finished"


def test_flush_due_skips_clean_and_busy_journals(tmp_path):
    schema = build_schema(2)
    journal = RunJournal(
        str(tmp_path / "run"), schema, {"model": "m"}, WatchOptions(flush_secs=1e9)
    )
    try:
        journal.record(0, 0, 0, _vector(schema))
        assert not journal.dirty  # the first step is flushed at once (the run exists)
        journal.record(1, 0, 1, _vector(schema))
        assert journal.dirty
        assert crash_safety.flush_due(now=time.monotonic()) == 0  # not due yet
        with journal._lock:  # busy in another thread: never blocks the flusher
            done = []
            worker = threading.Thread(
                target=lambda: done.append(crash_safety.flush_due(now=time.monotonic() + 2e9))
            )
            worker.start()
            worker.join(5)
            assert done == [0]
        assert crash_safety.flush_due(now=time.monotonic() + 2e9) == 1
        assert not journal.dirty
        assert crash_safety.flush_due(now=time.monotonic() + 2e9) == 0
    finally:
        journal.close()


def test_sigterm_with_a_user_handler_keeps_the_run_open(tmp_path, monkeypatch):
    """A user's SIGTERM handler (graceful preemption) is called; the run is
    not closed under it (training and recording go on), the background
    flusher writes the waiting steps at once, and the run ends "terminated"."""
    schema = build_schema(2)
    journal = RunJournal(
        str(tmp_path / "run"), schema, {"model": "m"}, WatchOptions(flush_secs=1e9)
    )
    journal.record(0, 0, 0, _vector(schema))
    journal.record(1, 0, 1, _vector(schema))
    assert journal.dirty  # step 0 was flushed at once, step 1 waits
    calls = []
    monkeypatch.setattr(crash_safety, "_sigterm_received", threading.Event())
    monkeypatch.setattr(crash_safety, "_previous_sigterm", lambda *a: calls.append(a))
    try:
        crash_safety._on_sigterm(signal.SIGTERM, None)
        assert calls == [(signal.SIGTERM, None)]
        assert not journal.closed and crash_safety.sigterm_received()
        deadline = time.monotonic() + 10
        while journal.dirty and time.monotonic() < deadline:
            time.sleep(0.02)
        assert steps_on_disk(str(tmp_path / "run")) == 2
        journal.record(2, 0, 2, _vector(schema))  # recording goes on

        monkeypatch.setattr(crash_safety, "_previous_sigterm", signal.SIG_IGN)
        crash_safety._on_sigterm(signal.SIGTERM, None)  # ignored before us: still ignored
        assert not journal.closed
    finally:
        crash_safety.close_all("terminated")
    summary, _, _ = read_run(str(tmp_path / "run"))
    assert summary["status"] == "terminated" and summary["steps"] == 3


def test_next_fit_closes_a_record_left_open_by_an_exception(tmp_path):
    keras = pytest.importorskip("keras")
    import tb_nanwatch

    x = np.random.RandomState(0).uniform(size=(48, 3)).astype("float32")
    y = np.ones((48, 1), "float32")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, name="d")])
    model.compile(optimizer="sgd", loss="mse")
    watch = tb_nanwatch.NanWatch(str(tmp_path / "run"), flush_secs=1e9)

    class Boom(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[watch, Boom()])
    first = watch.journal
    assert not first.closed and first in crash_safety.open_journals()
    model.fit(x, y, batch_size=8, verbose=0, callbacks=[watch])
    assert first.closed and first.status == "raised" and first.steps == 3
    assert watch.journal.closed and watch.journal.status == "finished"
