"""Where a watcher writes: one run dir per watcher, one stage dir per later fit.

The rule (README, "options"):

* a watcher (a ``NanWatch`` or ``StepWatcher`` object) writes its run into
  ``log_dir``, unless ``log_dir`` already holds another run's record (event
  files written by NanWatch, or claimed by another watcher of this process):
  then into the first free ``<log_dir>/run_<N>`` (N = 2, 3, ...), with a
  warning naming it. Two runs' records are never mixed in one run dir;
* each later ``fit`` of the same ``NanWatch`` (freeze, then fine-tune) is a
  new *stage* of its run, written to ``<run dir>/stage_<N>`` (N = 2, 3, ...);
  a fit that recorded nothing does not use up a stage. Each stage is a run of
  its own for TensorBoard and the report, named by its path, and says
  ``"stage": N`` in its run summary.
"""

from __future__ import annotations

import logging
import posixpath
import threading

import tensorflow as tf

from tb_nanwatch.record.event_writer import EVENT_FILE_SUFFIX

logger = logging.getLogger("tb_nanwatch")

_lock = threading.Lock()
_claimed: set[str] = set()  # run dirs taken by a watcher of this process


def holds_record(run_dir: str) -> bool:
    """Whether ``run_dir`` holds a NanWatch event file (unreadable: no)."""
    try:
        return bool(tf.io.gfile.glob(posixpath.join(run_dir, f"*{EVENT_FILE_SUFFIX}")))
    except Exception:  # noqa: BLE001 - a dir we cannot list holds nothing of ours
        return False


def claim_run_dir(log_dir: str) -> str:
    """``log_dir``, or the first free ``<log_dir>/run_<N>`` when it is taken."""
    with _lock:
        candidate, number = log_dir, 1
        while candidate in _claimed or holds_record(candidate):
            number += 1
            candidate = posixpath.join(log_dir, f"run_{number}")
        _claimed.add(candidate)
    if candidate != log_dir:
        logger.warning(
            "NanWatch: log_dir %s already holds another run's record; this run is written to %s",
            log_dir,
            candidate,
        )
    return candidate


class RunPlacement:
    """One watcher's run dir and its stages (see the module docstring)."""

    def __init__(self) -> None:
        self.run_dir: str | None = None
        self.stage = 0
        self._current: str | None = None

    def next_stage(self, log_dir: str) -> str:
        """The dir the next stage writes to (``log_dir``: the requested dir)."""
        if self.run_dir is None:
            self.run_dir = self._current = claim_run_dir(log_dir)
            self.stage = 1
        elif holds_record(self._current):
            self.stage += 1
            self._current = posixpath.join(self.run_dir, f"stage_{self.stage}")
        return self._current
