"""The host side of a watched run: diagnosis, flight recorder and event files.

The compiled step hands over one float32 vector per training step (laid out by
a :class:`~tb_nanwatch.evidence.schema.Schema`). The journal turns that stream into the
on-disk record described in :mod:`tb_nanwatch.evidence.metadata`. It needs no
TensorFlow, so the same code serves the Keras callback, the custom-loop API and
the synthetic-run generator of the benchmark.
"""

from __future__ import annotations

import collections
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable

import numpy as np

from tb_nanwatch.evidence import causes, diagnosis, metadata, recorded
from tb_nanwatch.evidence.options import WatchOptions
from tb_nanwatch.evidence.printable import printable
from tb_nanwatch.evidence.schema import Schema
from tb_nanwatch.evidence.warning_watch import EarlyWarnings
from tb_nanwatch.record.writing import crash_safety
from tb_nanwatch.record.writing.event_writer import RunWriter

logger = logging.getLogger("tb_nanwatch")

SERIES_BASE_COLUMNS = (
    "loss",
    "grad_norm",
    "logit_min",
    "logit_max",
    "lr",
    "loss_scale",
    "skipped",
    "nonfinite",
    "iterations",
    "epoch",
    "batch",
)

# Steps on each side of an explosion onset kept as per-layer snapshots (from
# the flight ring), so the onset's "show layers" lands on data.
ONSET_SNAPSHOT_RADIUS = 8


def _locked(method):
    """Runs a journal method under the journal's lock (crash_safety flushes
    from another thread), after recording the steps still queued for the
    background worker (see :meth:`RunJournal.submit`): what it reads or
    writes is then up to date."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            self._record_queued()
            return method(self, *args, **kwargs)

    return wrapper


def _ranges(steps: list[int]) -> list[list[int]]:
    """[3, 4, 5, 9] -> [[3, 5], [9, 9]]."""
    out: list[list[int]] = []
    for step in steps:
        if out and out[-1][1] == step - 1:
            out[-1][1] = step
        else:
            out.append([step, step])
    return out


class RunJournal:
    """Receives per-step stats vectors and keeps the run's record on disk.

    Each step is judged by a :class:`~tb_nanwatch.evidence.diagnosis.RunDiagnosis`;
    the journal keeps what it decides (first incident, explosion onset,
    skipped steps) and writes it with the series. ``options`` (the watcher's,
    :class:`~tb_nanwatch.evidence.options.WatchOptions`; its defaults when
    None) set the window, snapshots, flushing and the incident rules.
    """

    def __init__(
        self,
        log_dir: str,
        schema: Schema,
        run_info: dict,
        options: WatchOptions | None = None,
        writer: RunWriter | None = None,
        before_incident: Callable[[dict], tuple[str, bool] | None] | None = None,
    ) -> None:
        self.options = options or WatchOptions()
        self.schema = schema
        self.run_info = dict(run_info)
        self.window = self.options.window
        self.snapshot_every = self.options.snapshot_every
        self.flush_secs = self.options.flush_secs
        self.diagnosis = diagnosis.RunDiagnosis(schema, self.options)
        self.early_warnings = EarlyWarnings(schema, self.run_info, self.options)
        self.writer = writer or RunWriter(log_dir)
        # Saves the reproduction bundle; called before the incident is written,
        # so a kill after the incident reached the disk always finds the bundle.
        self._before_incident = before_incident

        outputs = [e for e in schema.entries if e.phase == "loss" and e.layer is not None]
        self.series_columns = list(SERIES_BASE_COLUMNS) + [f"loss/{e.layer}" for e in outputs]
        # Vector positions read every step (precomputed: record() runs per step).
        self._output_loss_index = np.array(schema.indices(outputs, "value"), np.intp)
        self._header_index = np.array(
            [schema.header_index(f) for f in ("lr", "loss_scale", "skipped", "iterations")],
            np.intp,
        )
        self._chunk_rows: list[np.ndarray] = []
        self._chunk_start = 0
        self._ring = np.zeros((self.window, schema.size), np.float32)
        self._ring_steps = np.full(self.window, -1, np.int64)
        self.steps = 0
        self.first_nonfinite: dict | None = None
        self.explosion_onset: dict | None = None
        # The newest explosion onset (after a rewind the detector starts over).
        self.latest_explosion: dict | None = None
        self.skipped_steps: list[int] = []
        self.status = "running"
        self.repro_bundle: str | None = None
        self.repro_bundle_exact: bool | None = None
        self._last_flush = time.monotonic()
        # -- crash safety (see tb_nanwatch.record.writing.crash_safety) --
        self._lock = threading.RLock()
        # Steps submitted to the background worker, not recorded yet (see submit).
        self._queued: collections.deque = collections.deque()
        # One token a submitted step (or the close) wakes the worker; the
        # steps themselves are taken from _queued under the journal's lock.
        self._wake: queue.SimpleQueue = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._worker_error: Exception | None = None
        self._flushed_steps = 0
        # The incident's flight window as written, and the steps at which a
        # deleted or replaced log dir was noticed (see _write_again).
        self._incident_flight: tuple[int, np.ndarray] | None = None
        self._rewritten_at: list[int] = []
        self.closed = False
        crash_safety.watch(self)

    # -- per step ---------------------------------------------------------

    def submit(
        self, step: int, epoch: int, batch: int, vector: np.ndarray, extra: dict | None = None
    ) -> dict | None:
        """Records one step as :meth:`record` does, off the training thread
        when it cannot be the run's incident.

        A step that may be the run's incident (see
        :meth:`~tb_nanwatch.evidence.diagnosis.RunDiagnosis.may_be_incident`) is
        recorded now, after every queued step, and its incident returned.
        Any other step is queued and recorded by a worker thread, which runs
        while the next train step computes (TensorFlow releases the GIL):
        the diagnosis, series and files cost the training thread nothing.
        Every locked method, :meth:`close` and :meth:`settle` first record
        what is queued, in step order. An error of the worker is raised by
        the next ``submit`` or ``settle``.
        """
        if self.closed:
            raise RuntimeError("the record is closed")
        self._raise_worker_error()
        vector = self._shaped(vector)
        if self.diagnosis.may_be_incident(vector):
            return self.record(step, epoch, batch, vector, extra)
        self._queued.append((step, epoch, batch, vector, extra))
        self._wake.put(None)
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="nanwatch-journal", daemon=True)
            self._worker.start()
        return None

    @_locked
    def settle(self) -> None:
        """Records every submitted step now (the journal's fields are then current)."""
        self._raise_worker_error()

    def _work(self) -> None:
        while not self.closed:
            self._wake.get()
            with self._lock:
                self._record_queued()

    def _record_queued(self) -> None:
        """Records the queued steps, in order (the caller holds the lock).
        Never raises: an error is kept for the next submit or settle, the
        rest of the queue dropped."""
        while self._queued:
            try:
                self._record_step(*self._queued.popleft())
            except Exception as error:  # noqa: BLE001 - raised by the next submit
                self._worker_error = self._worker_error or error
                self._queued.clear()

    def _raise_worker_error(self) -> None:
        error, self._worker_error = self._worker_error, None
        if error is not None:
            raise error

    @_locked
    def record(
        self, step: int, epoch: int, batch: int, vector: np.ndarray, extra: dict | None = None
    ) -> dict | None:
        """Records one step; returns the incident dict when this step is one.

        ``extra`` (e.g. which replica went non-finite first) is added to the
        incident if this step becomes one. The run summary is written with
        the first step (the run exists on disk from then on).
        """
        self._raise_worker_error()
        return self._record_step(step, epoch, batch, vector, extra)

    def _record_step(
        self, step: int, epoch: int, batch: int, vector: np.ndarray, extra: dict | None
    ) -> dict | None:
        if self.closed:
            raise RuntimeError("the record is closed")
        vector = self._checked(step, vector)
        slot = step % self._ring.shape[0]
        self._ring[slot] = vector
        self._ring_steps[slot] = step
        place = diagnosis.StepPlace(step, epoch, batch, extra)
        verdict = self.diagnosis.judge(place, vector)
        self._append_row(place, vector, verdict)
        self.steps = step + 1
        if self.snapshot_every and step % self.snapshot_every == 0:
            self.writer.write_array(metadata.layers_tag(step), metadata.KIND_LAYERS, step, vector)
        if verdict.skipped:
            self.skipped_steps.append(step)
        if verdict.incident is not None:
            self.first_nonfinite = verdict.incident
        if verdict.explosion is not None:
            # The run's first onset stays; a later one (after a rewind) is the latest.
            self.explosion_onset = self.explosion_onset or verdict.explosion
            self.latest_explosion = verdict.explosion
            self._write_onset_snapshots(int(verdict.explosion["step"]))
            self.flush()
        if self.early_warnings.observe(step, vector):
            self.update_run_info(warnings=list(self.early_warnings.warnings))
            self.flush()  # on disk before the trouble it foresees
        if len(self._chunk_rows) >= metadata.CHUNK_STEPS:
            self._write_chunk()
            self._chunk_rows = []
        if verdict.incident is not None:
            self._write_incident(verdict.incident)
        elif step == 0 or time.monotonic() - self._last_flush > self.flush_secs:
            self.flush()
        return verdict.incident

    @_locked
    def mark_rewind(self) -> None:
        """The run went back to a rewind point after the last recorded step:
        the steps from the next on are judged afresh (see
        :meth:`~tb_nanwatch.evidence.diagnosis.RunDiagnosis.rewound`)."""
        self.diagnosis.rewound()
        self.early_warnings.rewound()

    def _checked(self, step: int, vector: np.ndarray) -> np.ndarray:
        """``vector`` as float32, or a ValueError for a wrong shape or step."""
        vector = self._shaped(vector)
        if step != self.steps:
            raise ValueError(f"steps must be recorded in order: expected {self.steps}, got {step}")
        return vector

    def _shaped(self, vector: np.ndarray) -> np.ndarray:
        """``vector`` as float32, or a ValueError for a wrong shape."""
        vector = np.asarray(vector, np.float32)
        if vector.shape != (self.schema.size,):
            raise ValueError(
                f"stats vector has shape {vector.shape}, schema expects ({self.schema.size},)"
            )
        return vector

    def _append_row(
        self, place: diagnosis.StepPlace, vector: np.ndarray, verdict: diagnosis.Verdict
    ) -> None:
        """One row of the compact series: SERIES_BASE_COLUMNS, then the
        per-output losses."""
        lr, loss_scale, skipped, iterations = vector[self._header_index]
        signals = verdict.signals
        row = np.empty(len(SERIES_BASE_COLUMNS) + len(self._output_loss_index), np.float32)
        row[: len(SERIES_BASE_COLUMNS)] = (
            signals.loss,
            signals.grad_norm,
            signals.logit_min,
            signals.logit_max,
            lr,
            loss_scale,
            skipped,
            1.0 if verdict.nonfinite else 0.0,
            iterations,
            place.epoch,
            place.batch,
        )
        row[len(SERIES_BASE_COLUMNS) :] = vector[self._output_loss_index]
        if not self._chunk_rows:
            self._chunk_start = place.step
        self._chunk_rows.append(row)

    # -- writing ----------------------------------------------------------

    def _write_chunk(self) -> None:
        if not self._chunk_rows:
            return
        chunk = np.stack(self._chunk_rows)
        index = self._chunk_start // metadata.CHUNK_STEPS
        self.writer.write_array(
            metadata.series_tag(index), metadata.KIND_SERIES, self._chunk_start, chunk
        )

    def _write_onset_snapshots(self, onset: int) -> None:
        """Per-layer snapshots of the ring's steps around the explosion onset
        (those not already written as periodic snapshots)."""
        steps, window = self.flight_window()
        for step, vector in zip(steps.tolist(), window, strict=True):
            periodic = self.snapshot_every and step % self.snapshot_every == 0
            if abs(step - onset) <= ONSET_SNAPSHOT_RADIUS and not periodic:
                self.writer.write_array(
                    metadata.layers_tag(step), metadata.KIND_LAYERS, step, vector
                )

    def flight_window(self) -> tuple[np.ndarray, np.ndarray]:
        """The last ``window`` steps recorded: (steps, [n, schema.size])."""
        valid = self._ring_steps >= 0
        order = np.argsort(self._ring_steps[valid])
        return self._ring_steps[valid][order], self._ring[valid][order]

    @_locked
    def flight_values(self, name: str) -> dict[int, float]:
        """The step header's ``name`` (``"loss"``, ``"lr"``, ...) of each step
        of the flight window, by step (a ValueError when the header has none)."""
        column = self.schema.header_index(name)
        steps, window = self.flight_window()
        return {int(s): float(v[column]) for s, v in zip(steps.tolist(), window, strict=True)}

    @_locked
    def cause(self) -> dict | None:
        """The cause verdict from what is in memory (the flight window, the
        current series chunk, the summary): for the console message at the
        incident, see :func:`tb_nanwatch.evidence.causes.describe`."""
        steps, window = self.flight_window()
        flight = recorded.Flight(int(steps[0]), window, self.schema) if len(steps) else None
        series = None
        if self._chunk_rows:
            rows = np.stack(self._chunk_rows)
            columns = {name: rows[:, i] for i, name in enumerate(self.series_columns)}
            first = self._chunk_start
            series = recorded.Series(np.arange(first, first + len(rows), dtype=np.int64), columns)
        record = recorded.Record(
            self.schema, self.first_nonfinite, self.explosion_onset, series, flight, self.summary()
        )
        return causes.diagnose(record)

    def _write_incident(self, incident: dict) -> None:
        if self._before_incident is not None:
            saved = self._before_incident(incident)
            if saved is not None:
                self.repro_bundle, self.repro_bundle_exact = saved
        steps, window = self.flight_window()
        if len(steps):
            self._incident_flight = (int(steps[0]), window)
            self.writer.write_array(
                metadata.TAG_FLIGHT, metadata.KIND_FLIGHT, int(steps[0]), window
            )
        self.writer.write_json(
            metadata.TAG_INCIDENT, metadata.KIND_INCIDENT, incident["step"], incident
        )
        self.flush()

    def update_run_info(self, **fields) -> None:
        """Adds ``fields`` to the run info the summary carries (they replace
        those of the same name); written by the next flush."""
        # A new dict: the worker may be writing the summary from the old one.
        self.run_info = {**self.run_info, **fields}

    def summary(self) -> dict:
        return {
            "format_version": metadata.FORMAT_VERSION,
            "steps": self.steps,
            "status": self.status,
            "first_nonfinite": self.first_nonfinite,
            "explosion": self.explosion_onset,
            "skipped_ranges": _ranges(self.skipped_steps),
            "series_columns": self.series_columns,
            "chunk_steps": metadata.CHUNK_STEPS,
            "snapshot_every": self.snapshot_every,
            "window": self.window,
            # The cause verdict replays the explosion rule with the run's factor.
            "explosion_factor": self.options.explosion_factor,
            "repro_bundle": self.repro_bundle,
            "repro_bundle_exact": self.repro_bundle_exact,
            "schema": self.schema.to_json(),
            **({"record_rewritten_at": list(self._rewritten_at)} if self._rewritten_at else {}),
            **self.run_info,
        }

    @_locked
    def flush(self) -> None:
        """Writes the partial series chunk and the run summary, then syncs
        (into a new event file when the log dir was deleted or replaced)."""
        if not self.writer.still_there():
            self._write_again()
        self._write_chunk()
        self.writer.write_json(metadata.TAG_RUN, metadata.KIND_RUN, self.steps, self.summary())
        self.writer.flush()
        self._last_flush = time.monotonic()
        self._flushed_steps = self.steps

    def _write_again(self) -> None:
        """The event file is gone (its log dir deleted or replaced): a new one,
        with what is still in memory: the incident and its flight window, the
        ring's periodic snapshots, then (by flush) the current series chunk and
        the summary. Warned once a run; the earlier chunks are lost."""
        if not self._rewritten_at:
            logger.warning(
                "NanWatch: the run dir %s was deleted or replaced during the run; the record is "
                "written again from what is still in memory (the series before step %d and "
                "older snapshots are lost)",
                printable(self.writer.log_dir),
                self._chunk_start if self._chunk_rows else self.steps,
            )
        self._rewritten_at.append(self.steps)
        self.writer = self.writer.reopened()
        if self._incident_flight is not None:
            first, window = self._incident_flight
            self.writer.write_array(metadata.TAG_FLIGHT, metadata.KIND_FLIGHT, first, window)
        if self.first_nonfinite is not None:
            incident = self.first_nonfinite
            self.writer.write_json(
                metadata.TAG_INCIDENT, metadata.KIND_INCIDENT, incident["step"], incident
            )
        steps, window = self.flight_window()
        for step, vector in zip(steps.tolist(), window, strict=True):
            if self.snapshot_every and step % self.snapshot_every == 0:
                self.writer.write_array(
                    metadata.layers_tag(step), metadata.KIND_LAYERS, step, vector
                )

    def close(self, status: str = "finished", hold: bool = False) -> None:
        """Final flush with ``status``; later calls do nothing. With ``hold``
        the journal keeps its lock for good: nothing can be recorded after the
        final summary (the process is about to end, see crash_safety)."""
        self._lock.acquire()
        try:
            self._record_queued()
            self._close(status)
        finally:
            if not hold:
                self._lock.release()

    def _close(self, status: str) -> None:
        if self.closed:
            return
        self.closed = True
        crash_safety.unwatch(self)
        self.status = status
        explosion = self.diagnosis.finish()  # a climb cut short by the end of the run
        if explosion is not None and self.explosion_onset is None:
            self.explosion_onset = explosion
        if self.early_warnings.warnings:
            self.update_run_info(warnings=self.early_warnings.finished(self.summary()))
        self.flush()
        self.writer.close()
        self._wake.put(None)  # the worker, if any, ends

    # -- crash safety (used by tb_nanwatch.record.writing.crash_safety) ---------------------

    @property
    def dirty(self) -> bool:
        """Steps recorded since the last flush."""
        return not self.closed and (self.steps != self._flushed_steps or bool(self._queued))

    @property
    def last_flush_time(self) -> float:
        return self._last_flush

    def flush_if_dirty(self, blocking: bool = True) -> bool:
        """Flushes when steps wait; with ``blocking=False`` gives up when the
        journal is busy. Returns whether it flushed."""
        if not self._lock.acquire(blocking=blocking):
            return False
        try:
            self._record_queued()
            if not self.dirty:
                return False
            self.flush()
            return True
        finally:
            self._lock.release()
