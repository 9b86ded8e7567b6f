"""Crash safety: the on-disk record survives kills, SIGTERM and exceptions.

Every open :class:`~tb_nanwatch.journal.RunJournal` registers here while it is
open (it does so itself). This module then guarantees:

* **SIGKILL / power loss**: nothing can run, so the journal flushes often. It
  flushes at least every ``flush_secs`` while steps arrive, at once when an
  incident or explosion is detected, and a background thread also flushes a
  journal whose recorded steps have waited longer than ``flush_secs`` (training
  stalled, or ``fit`` raised and the process lives on in a notebook). A kill
  loses at most the last ``flush_secs`` of steps, never the incident.
* **SIGTERM**: a handler closes every open journal with status
  ``"terminated"``, then chains to the handler that was there before (the
  default one re-raises SIGTERM, so the exit status stays "killed by SIGTERM").
* **Exceptions** (in user code, a callback, the data pipeline): Keras does not
  call ``on_train_end`` when ``fit`` raises. The journal stays open and is
  closed by the next ``fit`` of the same callback (status ``"raised"``), or at
  interpreter exit by an ``atexit`` hook (status ``"raised"`` after an uncaught
  exception, ``"interrupted"`` otherwise); meanwhile the background flusher has
  put its steps on disk.

Limits: a Python signal handler runs only between bytecodes of the main
thread, so SIGTERM during one long TensorFlow op is handled when the op
returns. Handlers can only be installed from the main thread; elsewhere only
the flusher and ``atexit`` protect the record.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import time

logger = logging.getLogger("tb_nanwatch")

# The longest the flusher sleeps between two looks at the open journals.
_MAX_POLL_SECS = 1.0
_MIN_POLL_SECS = 0.02

_lock = threading.Lock()
_open: dict[int, object] = {}  # id -> journal; strong refs: an open journal must be closed
_installed = False
_previous_sigterm = None
_flusher: threading.Thread | None = None
_wake = threading.Event()


def watch(journal) -> None:
    """Registers an open journal; installs the handlers on first use."""
    with _lock:
        _open[id(journal)] = journal
    _install()
    _wake.set()


def unwatch(journal) -> None:
    """Forgets a journal (called when it is closed)."""
    with _lock:
        _open.pop(id(journal), None)


def open_journals() -> list:
    with _lock:
        return list(_open.values())


def close_all(status: str) -> None:
    """Closes every open journal with ``status``; never raises."""
    for journal in open_journals():
        try:
            journal.close(status)
        except Exception as error:  # noqa: BLE001 - keep closing the others
            logger.warning(
                "NanWatch could not close the record in %s: %r",
                getattr(journal.writer, "log_dir", "?"),
                error,
            )
            unwatch(journal)


# -- installation -------------------------------------------------------------


def _install() -> None:
    global _installed, _flusher
    with _lock:
        if _installed:
            return
        _installed = True
        atexit.register(_at_exit)
        _flusher = threading.Thread(target=_flush_loop, name="nanwatch-flusher", daemon=True)
        _flusher.start()
    _install_sigterm()


def _install_sigterm() -> None:
    global _previous_sigterm
    if threading.current_thread() is not threading.main_thread():
        logger.debug("NanWatch: not on the main thread, no SIGTERM handler installed")
        return
    try:
        _previous_sigterm = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError, AttributeError) as error:  # no signals here (embedded, ...)
        logger.debug("NanWatch: no SIGTERM handler installed: %r", error)


def _on_sigterm(signum, frame) -> None:
    close_all("terminated")
    previous = _previous_sigterm
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_IGN:
        return
    else:  # SIG_DFL, or None (set from C): die the way SIGTERM kills
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _at_exit() -> None:
    # sys.last_value is set when an uncaught exception ended the program.
    close_all("raised" if getattr(sys, "last_value", None) is not None else "interrupted")


# -- background flusher ----------------------------------------------------------


def _due(journal, now: float) -> bool:
    return getattr(journal, "dirty", False) and now - journal.last_flush_time >= journal.flush_secs


def flush_due(now: float | None = None) -> int:
    """Flushes every open journal with steps waiting longer than its
    ``flush_secs``; returns how many were flushed. Never blocks on a journal
    busy recording (it flushes on its own then)."""
    now = time.monotonic() if now is None else now
    flushed = 0
    for journal in open_journals():
        if not _due(journal, now):
            continue
        try:
            if journal.flush_if_dirty(blocking=False):
                flushed += 1
        except Exception as error:  # noqa: BLE001 - the flusher must live on
            logger.warning("NanWatch background flush failed: %r", error)
    return flushed


def _poll_interval() -> float:
    journals = open_journals()
    if not journals:
        return _MAX_POLL_SECS
    shortest = min(float(getattr(j, "flush_secs", _MAX_POLL_SECS)) for j in journals)
    return max(_MIN_POLL_SECS, min(_MAX_POLL_SECS, shortest / 2))


def _flush_loop() -> None:
    while True:
        _wake.wait(_poll_interval())
        _wake.clear()
        flush_due()
