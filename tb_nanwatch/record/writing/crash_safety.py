"""Crash safety: the on-disk record survives kills, SIGTERM and exceptions.

Every open :class:`~tb_nanwatch.record.writing.journal.RunJournal` registers here while it is
open (it does so itself). This module then guarantees:

* **SIGKILL / power loss**: nothing can run, so the journal flushes often. It
  flushes at least every ``flush_secs`` while steps arrive, at once when an
  incident or explosion is detected, and a background thread also flushes a
  journal whose recorded steps have waited longer than ``flush_secs`` (training
  stalled, or ``fit`` raised and the process lives on in a notebook). A kill
  loses at most the last ``flush_secs`` of steps, never the incident.
* **SIGTERM**: the handler never writes (a Python handler runs on the main
  thread between two bytecodes, possibly while TensorBoard's writer holds its
  non-reentrant lock there: a write from the handler would wait for ever). It
  only records the request, then:

  - with no handler of the user's before ours (the default action), it
    restores the default action and starts a *terminator* thread. The main
    thread goes on (and releases any lock it held); the terminator closes
    every open journal with status ``"terminated"``, keeps their locks (no
    step is recorded after the final summary), and re-sends SIGTERM, so the
    process dies by SIGTERM. The close waits at most ``TERMINATE_TIMEOUT_SECS``;
  - with a handler of the user's (graceful preemption), the background flusher
    flushes every journal at once and the user's handler is called; the run
    is *not* closed: training, recording, the incident and ``on_nonfinite``
    go on. When the run then ends, its status is ``"terminated"`` unless an
    incident stopped it (``WatchSession.final_status``);
  - with SIGTERM ignored before us, it stays ignored (a flush is requested).
* **Exceptions** (in user code, a callback, the data pipeline): Keras does not
  call ``on_train_end`` when ``fit`` raises. A journal opened inside Keras'
  ``fit`` is registered with that call (:func:`close_when_call_ends`): when a
  SIGINT came (Ctrl-C, a notebook's interrupt: the kernel catches the
  ``KeyboardInterrupt`` and lives on) and the background flusher then sees
  the call gone from its thread's stack with the journal still open, it
  closes it with status ``"interrupted"``, within about a second. Otherwise
  the journal stays open and is closed by the next ``fit`` of the same
  callback (status ``"raised"``), or at interpreter exit by an ``atexit``
  hook (status ``"raised"`` after an uncaught exception, ``"interrupted"``
  otherwise); meanwhile the background flusher has put its steps on disk.
  The SIGINT handler only counts and then calls Python's default one; it is
  put in place (from the main thread) only where that default handler is.

Limits: a Python signal handler runs only between bytecodes of the main
thread, so SIGTERM during one long TensorFlow op is handled when the op
returns. Handlers can only be installed from the main thread; elsewhere only
the flusher and ``atexit`` protect the record. A second SIGTERM while the
terminator closes the record finds the default action and ends the process at
once (the steps flushed before stay on disk).
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
# How long the terminator waits for the journals to close before it ends the
# process anyway (a main thread stuck inside a write must not keep it alive).
TERMINATE_TIMEOUT_SECS = 10.0
_flush_requested = threading.Event()  # set by the handler: flush everything now
_sigterm_received = threading.Event()
_sigints = [0]  # SIGINTs seen by our handler (a list: changed without a lock)
# id(journal) -> (thread id, id of the call's frame, its code, SIGINTs before it)
_calls: dict[int, tuple[int, int, object, int]] = {}


def watch(journal) -> None:
    """Registers an open journal; installs the handlers on first use."""
    with _lock:
        _open[id(journal)] = journal
    _install()
    _install_sigint()
    _wake.set()


def unwatch(journal) -> None:
    """Forgets a journal (called when it is closed)."""
    with _lock:
        _open.pop(id(journal), None)
        _calls.pop(id(journal), None)


def close_when_call_ends(journal, name: str = "fit", module: str = "keras") -> bool:
    """Ties ``journal`` to the innermost running call ``name`` of a module
    under ``module`` on this thread (Keras' ``fit``): when that call has left
    the stack and the journal is still open, the flusher closes it (see the
    module docstring). Returns whether such a call was found."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == name and str(frame.f_globals.get("__name__", "")).startswith(module):
            with _lock:
                _calls[id(journal)] = (threading.get_ident(), id(frame), code, _sigints[0])
            return True
        frame = frame.f_back
    return False


def _call_running(thread: int, frame_id: int, code: object) -> bool:
    frame = sys._current_frames().get(thread)
    while frame is not None:
        if id(frame) == frame_id and frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def close_ended_calls() -> int:
    """Closes, with status ``"interrupted"``, each open journal whose call
    ended after a SIGINT without closing it; returns how many. A call that
    ended otherwise (an exception) is forgotten: its journal stays open."""
    with _lock:
        ended = [(j, _calls[key]) for key, j in _open.items() if key in _calls]
    closed = 0
    for journal, (thread, frame_id, code, sigints) in ended:
        if _call_running(thread, frame_id, code):
            continue
        if _sigints[0] == sigints:
            with _lock:
                _calls.pop(id(journal), None)
            continue
        try:
            journal.close("interrupted")
            closed += 1
        except Exception as error:  # noqa: BLE001 - the flusher must live on
            logger.warning("NanWatch could not close the record after its fit ended: %r", error)
            unwatch(journal)
    return closed


def open_journals() -> list:
    with _lock:
        return list(_open.values())


def close_all(status: str, hold: bool = False) -> None:
    """Closes every open journal with ``status``; never raises. With ``hold``
    each journal keeps its lock afterwards (the process is about to end)."""
    for journal in open_journals():
        try:
            journal.close(status, hold=hold)
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


def _install_sigint() -> None:
    """Counts SIGINTs, then lets Python's default handler raise
    ``KeyboardInterrupt``; only where that default handler is in place (a
    notebook kernel puts it back at each cell, so this runs at each watch)."""
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _on_sigint)
    except (ValueError, OSError, AttributeError) as error:
        logger.debug("NanWatch: no SIGINT handler installed: %r", error)


def _on_sigint(signum, frame) -> None:
    _sigints[0] += 1
    signal.default_int_handler(signum, frame)


def sigterm_received() -> bool:
    """Whether this process has received SIGTERM (since NanWatch installed its handler)."""
    return _sigterm_received.is_set()


def _on_sigterm(signum, frame) -> None:
    # Lock-free: sets events and starts a thread, never writes (see the module doc).
    first = not _sigterm_received.is_set()
    _sigterm_received.set()
    previous = _previous_sigterm
    if callable(previous):
        _request_flush()
        previous(signum, frame)
    elif previous == signal.SIG_IGN:
        _request_flush()
    elif first:  # SIG_DFL, or None (set from C): close the record, then die by SIGTERM
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        threading.Thread(target=_terminate, name="nanwatch-terminator", daemon=True).start()


def _request_flush() -> None:
    _flush_requested.set()
    _wake.set()


def _terminate() -> None:
    """Closes every journal (bounded wait), then ends the process by SIGTERM."""
    closer = threading.Thread(
        target=close_all, args=("terminated", True), name="nanwatch-closer", daemon=True
    )
    closer.start()
    closer.join(TERMINATE_TIMEOUT_SECS)
    if closer.is_alive():
        logger.warning(
            "NanWatch: the record could not be closed within %ss", TERMINATE_TIMEOUT_SECS
        )
    os.kill(os.getpid(), signal.SIGTERM)


def _at_exit() -> None:
    # sys.last_value is set when an uncaught exception ended the program.
    if sigterm_received():
        close_all("terminated")
    else:
        close_all("raised" if getattr(sys, "last_value", None) is not None else "interrupted")


# -- background flusher ----------------------------------------------------------


def _due(journal, now: float) -> bool:
    return getattr(journal, "dirty", False) and now - journal.last_flush_time >= journal.flush_secs


def flush_due(now: float | None = None, everything: bool = False) -> int:
    """Flushes every open journal with steps waiting longer than its
    ``flush_secs`` (with ``everything``: every journal with steps waiting);
    returns how many were flushed. Never blocks on a journal busy recording
    (it flushes on its own then)."""
    now = time.monotonic() if now is None else now
    flushed = 0
    for journal in open_journals():
        if not (_due(journal, now) or (everything and getattr(journal, "dirty", False))):
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
        everything = _flush_requested.is_set()
        _flush_requested.clear()
        flush_due(everything=everything)
        close_ended_calls()
