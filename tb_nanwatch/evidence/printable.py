"""Text from a run dir made inert for a terminal.

Run, layer and tensor names come from whoever wrote the run dir. Printed raw,
an ESC sequence clears the screen, moves the cursor over earlier lines, writes
the clipboard (OSC 52) or hides a link (OSC 8); a BEL rings; bidirectional
overrides reorder what is read. :func:`printable` writes every such character
as a visible escape (``\\x1b``, ``\\u202e``); the rest of the text is unchanged.
"""

from __future__ import annotations

import re

# C0 controls (newline and tab included: a name has none), DEL, C1 controls,
# the line/paragraph separators and the bidirectional controls.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ufeff]")


def _escape(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: object) -> str:
    """``str(text)`` with every control character written as a visible escape."""
    return _UNSAFE.sub(_escape, str(text))


def printable_lines(lines: list[str]) -> str:
    """The lines, each made :func:`printable`, joined by newlines."""
    return "\n".join(printable(line) for line in lines)
