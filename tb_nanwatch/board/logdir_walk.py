"""Finds the run directories of a local log dir, whatever else the tree holds.

TensorBoard's Python walker follows symlinks (a cycle never ends), raises on
an unreadable directory, and opens anything named like an event file (a FIFO
blocks the reader forever). This walk instead reads each directory once
(tracked by ``(st_dev, st_ino)``), skips what it cannot read, and accepts only
readable regular files as event files; each thing skipped costs one warning
line. The log dir is a closed box: a symlinked directory is followed only
when it resolves inside the log dir, and an event file only read when it
resolves inside its run dir (a symlink out of it is skipped with a warning).
Needs no TensorFlow.
"""

from __future__ import annotations

import logging
import os
import stat

from tb_nanwatch.evidence import run_dir_box
from tb_nanwatch.evidence.printable import printable

logger = logging.getLogger(__name__)

_FILE_TYPES = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


is_remote = run_dir_box.is_remote  # a URL-like log dir (gs://, s3:// ...), not a local path


def _warn(path: str, reason: str) -> None:
    logger.warning("nanwatch: skipping %s: %s", printable(path), printable(reason))


def _error_text(error: OSError) -> str:
    return f"{type(error).__name__}: {error.strerror or error}"


def is_event_file_name(name: str) -> bool:
    """The names TensorBoard's loader takes for event files."""
    return "tfevents" in name and not name.endswith(".profile-empty")


def _file_type(mode: int) -> str:
    return next((text for test, text in _FILE_TYPES if test(mode)), "not a regular file")


def event_file_problem(path: str) -> str | None:
    """Why the event file ``path`` cannot be loaded, or None when it can.

    Opened only once it is known to be a regular file: opening a FIFO for
    reading blocks until a writer comes.
    """
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            return f"named like an event file but {_file_type(mode)}"
        with open(path, "rb"):
            pass
    except OSError as error:
        return f"event file cannot be read ({_error_text(error)})"
    return None


def is_loadable_event_file(path: str) -> bool:
    """A readable regular file named like an event file, inside its run dir
    after symlinks (no warning)."""
    return (
        is_event_file_name(os.path.basename(path))
        and not links_out(path)
        and event_file_problem(path) is None
    )


def links_out(path: str) -> bool:
    """Whether ``path`` is a symlink that resolves outside its own directory."""
    return os.path.islink(path) and not run_dir_box.within(os.path.dirname(path), path)


class _Walk:
    """One walk of a log dir: real directories first, then symlinked ones."""

    def __init__(self, logdir: str) -> None:
        self.logdir = logdir
        self.seen: dict[tuple[int, int], str] = {}
        self.pending: list[str] = []
        self.linked: list[str] = []
        self.run_dirs: list[str] = []

    def visit(self, directory: str) -> None:
        try:
            info = os.stat(directory)
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError as error:
            _warn(directory, f"directory cannot be read ({_error_text(error)})")
            return
        key = (info.st_dev, info.st_ino)
        if key in self.seen:
            _warn(directory, f"the same directory as {self.seen[key]} (a symlink), not read again")
            return
        self.seen[key] = directory
        has_events = False
        for entry in entries:
            has_events |= self._entry(entry)
        if has_events:
            self.run_dirs.append(directory)

    def _entry(self, entry: os.DirEntry) -> bool:
        """Queues a subdirectory; True for a loadable event file."""
        try:
            if entry.is_dir(follow_symlinks=True):
                if not entry.is_symlink():
                    self.pending.append(entry.path)
                elif run_dir_box.within(self.logdir, entry.path):
                    self.linked.append(entry.path)
                else:
                    _warn(entry.path, "a symlink to a directory outside the log dir, not followed")
                return False
        except OSError as error:
            _warn(entry.path, f"cannot be read ({_error_text(error)})")
            return False
        if not is_event_file_name(entry.name):
            return False
        if links_out(entry.path):
            _warn(entry.path, "a symlink to a file outside its run dir, not read")
            return False
        problem = event_file_problem(entry.path)
        if problem:
            _warn(entry.path, problem)
        return problem is None

    def next_directory(self) -> str | None:
        for queue in (self.pending, self.linked):
            if queue:
                return queue.pop()
        return None


def find_run_dirs(logdir: str) -> list[str]:
    """Every directory under ``logdir`` (itself included) that holds at least
    one loadable event file, sorted; symlinked directories are followed once."""
    walk = _Walk(logdir)
    directory: str | None = logdir
    while directory is not None:
        walk.visit(directory)
        directory = walk.next_directory()
    return sorted(walk.run_dirs)


def run_name(logdir: str, run_dir: str) -> str:
    """The run's name as TensorBoard gives it: its path relative to ``logdir``."""
    return os.path.relpath(run_dir, logdir)
