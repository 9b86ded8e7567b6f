"""Where a watcher writes: one run dir per watcher, one stage dir per later fit.

The rule (docs/reference/on-disk-format.md):

* a watcher (a ``NanWatch`` or ``StepWatcher`` object) writes its run into
  ``log_dir``, unless ``log_dir`` already holds another run's record (event
  files written by NanWatch, or claimed by another watcher of this process):
  then into the first free ``<log_dir>/run_<N>`` (N = 2, 3, ...), with a
  warning naming it. Two runs' records are never mixed in one run dir:
  a watcher takes a local run dir by creating its lock file
  ``.nanwatch-writer`` (``O_EXCL``, holding ``pid@host``); a second process
  given the same ``log_dir``, even at the same moment, finds it taken and
  writes to ``run_<N>`` as above. A lock left by a dead process of this host
  over a dir with no record is taken over (a lock that is not a regular
  file, a FIFO, is never waited on: the dir is taken). A ``run_<N>`` that is
  there as anything but a directory (a file, a symlink) is skipped as taken,
  never followed. (A remote ``log_dir``, ``gs://``, has no exclusive create:
  there only the record and this process count.)
  The path is taken literally: ``sweep/lr[0.1]`` is a name, never a pattern;
* each later ``fit`` of the same ``NanWatch`` (freeze, then fine-tune) is a
  new *stage* of its run, written to ``<run dir>/stage_<N>`` (N = 2, 3, ...);
  a fit that recorded nothing does not use up a stage. Each stage is a run of
  its own for TensorBoard and the report, named by its path, and says
  ``"stage": N`` in its run summary.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import posixpath
import socket
import stat
import threading

from tb_nanwatch.evidence import run_dir_box
from tb_nanwatch.record.writing.event_writer import EVENT_FILE_SUFFIX
from tb_nanwatch.record.writing.files import gfile

logger = logging.getLogger("tb_nanwatch")

_lock = threading.Lock()
_claimed: set[str] = set()  # run dirs taken by a watcher of this process
LOCK_FILE = ".nanwatch-writer"


def holds_record(run_dir: str) -> bool:
    """Whether ``run_dir`` holds a NanWatch event file (unreadable: no).
    Listed literally: no character of the path is a glob pattern."""
    try:
        names = gfile().listdir(run_dir)
    except Exception:  # noqa: BLE001 - a dir we cannot list holds nothing of ours
        return False
    return any(name.endswith(EVENT_FILE_SUFFIX) for name in names)


def _owner() -> str:
    return f"{os.getpid()}@{socket.gethostname()}"


def _stale(run_dir: str) -> bool:
    """A lock of a process of this host that has ended (a lock that is not a
    regular file, a FIFO say, is never opened for waiting: it is taken)."""
    try:
        text = run_dir_box.read_inside(run_dir, LOCK_FILE, 200, "the writer's lock")
        pid, _, host = text.decode("utf-8", "replace").strip().partition("@")
        if host != socket.gethostname() or not pid.isdigit():
            return False
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (OSError, ValueError):
        return False
    return False


def take_lock(run_dir: str) -> bool:
    """Creates ``run_dir``'s lock file for this process; False when another
    writer holds it. Remote dirs have no exclusive create: always True."""
    if run_dir_box.is_remote(run_dir):
        return True
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, LOCK_FILE)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except FileExistsError:
        if not (_stale(run_dir) and not holds_record(run_dir)):
            return False
        os.unlink(path)  # a dead writer's claim over an empty dir
        return take_lock(run_dir)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.EEXIST):
            return False
        raise
    with os.fdopen(fd, "w", encoding="utf-8") as outfile:
        outfile.write(_owner())
    return True


def _free(candidate: str, log_dir: str) -> bool:
    if candidate != log_dir and _planted(candidate):
        return False
    return candidate not in _claimed and not holds_record(candidate) and take_lock(candidate)


def _planted(candidate: str) -> bool:
    """Whether a ``run_<N>`` is there as something other than a directory of
    its own (a file, a FIFO, a symlink): taken, never followed."""
    if run_dir_box.is_remote(candidate):
        return False
    try:
        mode = os.lstat(candidate).st_mode
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return not stat.S_ISDIR(mode)


def claim_run_dir(log_dir: str) -> str:
    """``log_dir``, or the first free ``<log_dir>/run_<N>`` when it is taken."""
    with _lock:
        candidate, number = log_dir, 1
        while not _free(candidate, log_dir):
            number += 1
            candidate = posixpath.join(log_dir, f"run_{number}")
        _claimed.add(candidate)
    if candidate != log_dir:
        logger.warning(
            "NanWatch: log_dir %s already holds another run's record (or another process "
            "writes it); this run is written to %s",
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


@dataclasses.dataclass
class WorkerInfo:
    """Where this process sits in a multi-worker cluster."""

    task_type: str
    task_id: int
    is_chief: bool
    tasks: list[str]  # every task, in global replica order ("chief_0", "worker_0", ...)

    @property
    def name(self) -> str:
        return f"{self.task_type}_{self.task_id}"


def worker_info(strategy) -> WorkerInfo | None:
    """The cluster position under MultiWorkerMirroredStrategy, else None."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None:
        return None
    try:
        spec = resolver.cluster_spec().as_dict()
    except Exception:  # noqa: BLE001
        return None
    if not spec or resolver.task_type is None:
        return None
    tasks = [f"chief_{i}" for i in range(len(spec.get("chief", [])))]
    tasks += [f"worker_{i}" for i in range(len(spec.get("worker", [])))]
    if len(tasks) <= 1:
        return None
    task_type, task_id = str(resolver.task_type), int(resolver.task_id or 0)
    is_chief = task_type == "chief" or (
        task_type == "worker" and task_id == 0 and "chief" not in spec
    )
    return WorkerInfo(task_type, task_id, is_chief, tasks)


def worker_run_dir(log_dir: str, info: WorkerInfo | None) -> str:
    """The chief (or a single process) writes ``log_dir``; others a subdir."""
    if info is None or info.is_chief:
        return log_dir
    return posixpath.join(log_dir, info.name)
