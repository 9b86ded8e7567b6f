"""NanWatch's one voice on the console: its lines on stderr, each on a line of its own.

Keras' progress bar (``fit(verbose=1)``) leaves the cursor in the middle of its
line between two updates; a NanWatch line written then would be glued to it.
The front end that knows a bar is drawn says so after each step
(:meth:`Console.others_wrote`) and when the bar ended its line
(:meth:`Console.at_line_start`); a NanWatch line then starts on a fresh line.

Progress (the remedy trials) is one updating line on a terminal (a carriage
return rewrites it) and one line each elsewhere (a log file, a notebook's
captured output). Writing never raises: a closed or broken stream is ignored.
"""

from __future__ import annotations

import shutil
import sys
from typing import TextIO

_ERASE_LINE = "\r\x1b[K"


class Console:
    """Where NanWatch writes (stderr, looked up at each write)."""

    def __init__(self) -> None:
        self._mid_line = False  # another writer (Keras' bar) may have left the cursor mid-line
        self._progress = False  # our own updating line is on the screen, not ended

    def others_wrote(self) -> None:
        """Another writer (Keras' progress bar) may have written since our last line."""
        self._mid_line = True

    def at_line_start(self) -> None:
        """The other writer ended its line (Keras' bar was finalised)."""
        self._mid_line = False

    def lines(self, lines: list[str] | str) -> None:
        """``lines`` (already printable), each on a line of its own."""
        if isinstance(lines, str):
            lines = [lines]
        self._write(self._fresh() + "\n".join(lines) + "\n")

    def progress(self, line: str) -> None:
        """One progress line: rewritten in place on a terminal, else a line of its own."""
        if not _is_terminal(_stream()):
            self.lines([line])
            return
        start = "\n" if self._mid_line else ""
        self._mid_line = False
        self._write(f"{start}{_ERASE_LINE}{_fit(line)}")
        self._progress = True

    def end_progress(self) -> None:
        """Ends the updating line (it stays on the screen)."""
        if self._progress:
            self._write("\n")

    def _fresh(self) -> str:
        """What makes the next line start at the beginning of a line."""
        start = "\n" if self._mid_line or self._progress else ""
        self._mid_line = self._progress = False
        return start

    def _write(self, text: str) -> None:
        stream = _stream()
        try:
            stream.write(text)
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed or gone: never break training
            pass
        if text.endswith("\n"):
            self._progress = False


def _stream() -> TextIO:
    return sys.stderr


def _is_terminal(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def _fit(line: str) -> str:
    """``line`` cut to the terminal's width (a wrapped line cannot be rewritten)."""
    width = shutil.get_terminal_size((100, 24)).columns
    return line if len(line) < width else line[: max(width - 2, 10)] + "…"


# The process has one stderr: one console for every watcher in it.
CONSOLE = Console()


def keras_bar_follows(params: dict | None) -> None:
    """Called at the end of a callback's batch hook: Keras' progress bar
    (``fit(verbose=1)``, ``"auto"``: its ``ProgbarLogger`` runs after the other
    callbacks) draws its line next, and leaves the cursor in the middle of it."""
    if (params or {}).get("verbose") in (1, "auto"):
        CONSOLE.others_wrote()


def keras_bar_ended() -> None:
    """Keras' progress bar ended its line (at an epoch's end, before the next
    epoch's hooks and the end of training)."""
    CONSOLE.at_line_start()
