"""Shared bits of the demo scripts: quiet TensorFlow, progress lines, the
result in words, an argument parser.

A demo process prints ``@progress N/TOTAL`` lines while it trains (run_all.py
turns them into one progress line per scenario) and, last, what NaN Watch
found, in words.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

PROGRESS_PREFIX = "@progress "
PROGRESS_EVERY_S = 0.25
EXIT_INTERRUPTED = 130


class Progress:
    """Counts training steps; prints a progress line at most every PROGRESS_EVERY_S."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self._last_print = 0.0

    def advance(self) -> None:
        self.done += 1
        now = time.monotonic()
        if now - self._last_print >= PROGRESS_EVERY_S:
            self._last_print = now
            print(f"{PROGRESS_PREFIX}{self.done}/{self.total}", flush=True)


def progress_lines(total: int):
    """A Keras callback printing progress lines for a fit of ``total`` steps."""
    import keras  # here: run_all.py imports this module and must not load TensorFlow

    progress = Progress(total)
    return keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: progress.advance())


def parse_progress(line: str) -> tuple[int, int] | None:
    """``(done, total)`` of a progress line, None for any other line."""
    if not line.startswith(PROGRESS_PREFIX):
        return None
    done, _, total = line[len(PROGRESS_PREFIX) :].partition("/")
    return int(done), int(total)


def describe(entry: dict) -> str:
    """One run of ``tb-nanwatch report --json``, in words."""
    first = entry["first_nonfinite"]
    if first:
        where = f"phase {first['phase']}"
        if first["layer"]:
            where += f", layer {first['layer']}"
        return f"first non-finite at step {first['step']}, {where} ({first['kind']})"
    explosion = entry["explosion"]
    if explosion:
        return (
            f"no NaN/Inf in {entry['steps']} steps; explosion onset at step "
            f"{explosion['step']} (first signal: {explosion['signal']})"
        )
    return f"no NaN/Inf and no explosion in {entry['steps']} steps"


def describe_run(log_dir: str) -> str:
    """What ``tb-nanwatch report LOG_DIR`` found in the run written there, in words."""
    result = subprocess.run(
        [sys.executable, "-m", "tb_nanwatch.cli", "report", log_dir, "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    (entry,) = json.loads(result.stdout)["runs"]
    return describe(entry)


def main_with_log_dir(run, default: str) -> None:
    """Command line of one demo: trains into LOG_DIR, then says what was found."""
    parser = argparse.ArgumentParser(description=run.__doc__)
    parser.add_argument("log_dir", nargs="?", default=default)
    args = parser.parse_args()
    try:
        run(args.log_dir)
    except KeyboardInterrupt:
        sys.exit(EXIT_INTERRUPTED)
    print(describe_run(args.log_dir), flush=True)
