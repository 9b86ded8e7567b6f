"""RunJournal.submit: healthy steps are recorded off the training thread, in
order; a step that may be the incident is judged at once (no TensorFlow)."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from nanwatch_testlib import CTX, base_vector, multiplexer_provider

from tb_nanwatch.board import reader
from tb_nanwatch.evidence.options import WatchOptions
from tb_nanwatch.record.writing.journal import RunJournal
from tb_nanwatch.record.writing.synthetic import build_schema

SCHEMA = build_schema(3)


def _journal(tmp_path, **settings) -> RunJournal:
    return RunJournal(
        str(tmp_path / "run"), SCHEMA, {"model": "m"}, WatchOptions(flush_secs=1e9, **settings)
    )


def _summary_on_disk(run_dir: str) -> dict:
    logdir, name = os.path.split(run_dir)
    return reader.load_run(multiplexer_provider(logdir), CTX, "", name).summary


def _nan_in_layer(vector: np.ndarray, layer: str) -> np.ndarray:
    entry = next(e for e in SCHEMA.entries if e.kind == "activation" and e.layer == layer)
    vector[entry.index("nan")] = 3.0
    return vector


class _Recorded:
    """Wraps ``journal._record_step``: which thread recorded each step."""

    def __init__(self, journal: RunJournal, failing_at: int | None = None) -> None:
        self.threads: dict[int, str] = {}
        self.seen = threading.Condition()
        self._inner = journal._record_step
        self._failing_at = failing_at
        journal._record_step = self

    def __call__(self, step, *args):
        if step == self._failing_at:
            raise OSError("disk full")
        result = self._inner(step, *args)
        with self.seen:
            self.threads[step] = threading.current_thread().name
            self.seen.notify_all()
        return result

    def wait_for(self, steps: int) -> None:
        with self.seen:
            assert self.seen.wait_for(lambda: len(self.threads) >= steps, timeout=10)


class _HeldWorker:
    """Stands in for the worker's wake-up queue: the worker is never woken
    (the steps stay queued) until ``release``."""

    def __init__(self, journal: RunJournal) -> None:
        self._released = threading.Event()
        journal._wake = self

    def put(self, token) -> None:
        pass

    def get(self) -> None:
        self._released.wait(10)

    def release(self) -> None:
        self._released.set()


def test_healthy_steps_are_recorded_by_the_worker_thread(tmp_path):
    journal = _journal(tmp_path)
    recorded = _Recorded(journal)
    try:
        for step in range(20):
            assert journal.submit(step, 0, step, base_vector(SCHEMA, step)) is None
        recorded.wait_for(20)
        assert set(recorded.threads.values()) == {"nanwatch-journal"}
        assert journal.steps == 20
    finally:
        journal.close()
    series = np.stack(journal._chunk_rows)[:, journal.series_columns.index("loss")]
    assert series.tolist() == pytest.approx([1.0 + s / 1000 for s in range(20)])


def test_a_nonfinite_step_is_judged_at_once_after_the_queued_ones(tmp_path):
    journal = _journal(tmp_path)
    held = _HeldWorker(journal)  # the healthy steps stay queued
    recorded = _Recorded(journal)
    try:
        for step in range(5):
            journal.submit(step, 0, step, base_vector(SCHEMA, step))
        layer = SCHEMA.find(kind="activation")[1].layer
        incident = journal.submit(5, 0, 5, _nan_in_layer(base_vector(SCHEMA, 5), layer))
        # Returned by the call itself, with every earlier step recorded first.
        assert incident is not None and incident["step"] == 5 and incident["layer"] == layer
        assert journal.steps == 6 and journal.first_nonfinite == incident
        assert recorded.threads[5] == threading.current_thread().name
        assert set(recorded.threads.values()) == {threading.current_thread().name}
        assert sorted(recorded.threads) == list(range(6))
    finally:
        held.release()
        journal.close()


def test_a_skipped_step_is_judged_at_once(tmp_path):
    journal = _journal(tmp_path, max_consecutive_skips=1)
    try:
        journal.submit(0, 0, 0, base_vector(SCHEMA, 0))
        vector = base_vector(SCHEMA, 1)
        vector[SCHEMA.header_index("skipped")] = 1.0
        vector[SCHEMA.header_index("loss_scale")] = 1024.0
        incident = journal.submit(1, 0, 1, vector)
        assert incident is not None and incident["step"] == 1 and "skipped" in incident["note"]
    finally:
        journal.close()


def test_close_records_every_queued_step(tmp_path):
    journal = _journal(tmp_path)
    held = _HeldWorker(journal)
    for step in range(7):
        journal.submit(step, 0, step, base_vector(SCHEMA, step))
    assert journal.steps == 0 and journal.dirty
    journal.close()  # the worker is held: close records the queue itself
    held.release()
    summary = _summary_on_disk(str(tmp_path / "run"))
    assert summary["steps"] == 7 and summary["status"] == "finished"
    with pytest.raises(RuntimeError, match="closed"):
        journal.submit(7, 0, 7, base_vector(SCHEMA, 7))


def test_settle_makes_the_fields_current(tmp_path):
    journal = _journal(tmp_path)
    held = _HeldWorker(journal)
    try:
        for step in range(4):
            journal.submit(step, 0, step, base_vector(SCHEMA, step))
        assert journal.steps == 0
        journal.settle()
        assert journal.steps == 4
    finally:
        held.release()
        journal.close()


def test_an_error_of_the_worker_is_raised_by_the_next_submit(tmp_path):
    journal = _journal(tmp_path)
    recorded = _Recorded(journal, failing_at=2)
    try:
        for step in range(3):
            journal.submit(step, 0, step, base_vector(SCHEMA, step))
        recorded.wait_for(2)
        deadline = time.monotonic() + 10
        while journal._worker_error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(OSError, match="disk full"):
            journal.submit(3, 0, 3, base_vector(SCHEMA, 3))
        assert journal.steps == 2  # what was recorded stays
    finally:
        journal.close()
    assert _summary_on_disk(str(tmp_path / "run"))["steps"] == 2


def test_a_wrong_shape_is_named_at_submit(tmp_path):
    journal = _journal(tmp_path)
    try:
        with pytest.raises(ValueError, match="shape"):
            journal.submit(0, 0, 0, np.zeros(3, np.float32))
    finally:
        journal.close()


def test_settle_raises_an_error_of_the_queued_steps(tmp_path):
    journal = _journal(tmp_path)
    held = _HeldWorker(journal)
    _Recorded(journal, failing_at=1)
    try:
        for step in range(3):
            journal.submit(step, 0, step, base_vector(SCHEMA, step))
        with pytest.raises(OSError, match="disk full"):
            journal.settle()  # what the session calls at close: the error is not lost
        assert journal.steps == 1
    finally:
        held.release()
        journal.close()
