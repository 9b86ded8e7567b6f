"""TensorFlow's own output around a block of work, kept instead of printed.

Under ``tf.debugging.enable_check_numerics`` (the replay) TensorFlow's C++
runtime logs each failing op, its input tensors and the stack of its
creation straight to file descriptor 2: a hundred lines and more that
``sys.stderr`` never sees. :func:`captured` points file descriptors 1 and 2
(and ``sys.stdout`` / ``sys.stderr``) at a temporary file for the block and
reads the text back, bounded (:data:`MAX_BYTES`), for the caller to keep.

Python warnings raised inside the block are NanWatch's own or the user's:
they are shown after the block, not kept. Where the descriptors cannot be
redirected (no fd 1/2), nothing is captured and the block runs as it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator

# The most of the captured text kept (the first bytes: the first failing op).
MAX_BYTES = 256 * 1024


@dataclasses.dataclass
class Captured:
    """The text written to stdout and stderr inside the block ('' until it ends)."""

    text: str = ""
    dropped_bytes: int = 0  # beyond MAX_BYTES, not kept


@contextlib.contextmanager
def captured() -> Iterator[Captured]:
    """Redirects file descriptors 1 and 2 into a temporary file; see the module docstring."""
    found = Captured()
    _flush()
    try:
        saved = (os.dup(1), os.dup(2))
    except OSError:  # no descriptors to redirect (an embedded interpreter)
        yield found
        return
    raised: list[warnings.WarningMessage] = []
    try:
        with tempfile.TemporaryFile() as sink, warnings.catch_warnings(record=True) as raised:
            try:
                with _redirected(sink.fileno(), saved):
                    yield found
            finally:
                _read_back(sink, found)
    finally:
        for caught in raised:
            warnings.showwarning(caught.message, caught.category, caught.filename, caught.lineno)


@contextlib.contextmanager
def _redirected(target: int, saved: tuple[int, int]) -> Iterator[None]:
    """Descriptors 1 and 2, and Python's streams, into ``target``; all put back after."""
    python_side = open(os.dup(target), "w", encoding="utf-8", errors="replace")  # noqa: SIM115
    try:
        os.dup2(target, 1)
        os.dup2(target, 2)
        with contextlib.redirect_stdout(python_side), contextlib.redirect_stderr(python_side):
            yield
    finally:
        _flush(python_side)
        python_side.close()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def _flush(*streams) -> None:
    """Python's buffers out to their descriptors (before a descriptor changes)."""
    for stream in (sys.stdout, sys.stderr, *streams):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass


def _read_back(sink, found: Captured) -> None:
    sink.seek(0, os.SEEK_END)
    size = sink.tell()
    sink.seek(0)
    found.text = sink.read(MAX_BYTES).decode("utf-8", errors="replace")
    found.dropped_bytes = max(size - MAX_BYTES, 0)
