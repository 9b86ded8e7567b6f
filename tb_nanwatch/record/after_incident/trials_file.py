"""The trials file, ``<run dir>/repro/trials.json``: written once, after the trials.

Read back by ``evidence/trials.py`` (``parse_trials``); its layout is in the
on-disk format reference.
"""

from __future__ import annotations

import json
import posixpath

import tensorflow as tf

from tb_nanwatch.evidence import run_dir_box
from tb_nanwatch.evidence.trials import MAX_TRIALS_BYTES, TRIALS_FILE, TRIALS_VERSION
from tb_nanwatch.record.after_incident.bundle import BUNDLE_DIR
from tb_nanwatch.record.after_incident.trials import TrialList


def write_trials(run_dir: str, step: int, cause: dict, trials: TrialList) -> str:
    """Writes ``<run dir>/repro/trials.json``; returns its path.

    Never through a symlink, never outside the run dir, and never over a file
    that is not a trials file (a ValueError says so).
    """
    body = {
        "version": TRIALS_VERSION,
        "step": step,
        "cause": cause.get("id"),
        "plan": trials.plan,
        "fidelity": trials.fidelity,
        "compiled": trials.compiled,
        "baseline": None if trials.baseline is None else trials.baseline.to_json(),
        "trials": [t.to_json() for t in trials],
    }
    text = json.dumps(body, indent=1, allow_nan=True)
    directory = posixpath.join(run_dir, BUNDLE_DIR)
    path = posixpath.join(directory, TRIALS_FILE)
    if run_dir_box.is_remote(run_dir):
        tf.io.gfile.makedirs(directory)
        exists = tf.io.gfile.exists(path)
        _check_ours(path, exists)
        if exists:
            tf.io.gfile.remove(path)  # some file systems do not truncate on open
        with tf.io.gfile.GFile(path, "w") as f:
            f.write(text)
        return path
    relative = f"{BUNDLE_DIR}/{TRIALS_FILE}"
    try:  # only inside the run dir, a regular file, never waiting on a FIFO
        previous = run_dir_box.read_inside(run_dir, relative, MAX_TRIALS_BYTES, relative)
    except FileNotFoundError:
        previous = None
    except run_dir_box.RunDirError as error:
        raise run_dir_box.RunDirError(f"not written: {error}") from None
    if previous is not None:
        _check_ours(path, True, previous)
    return run_dir_box.safe_write_bytes(run_dir, relative, text.encode("utf-8"), make_dirs=True)


def _check_ours(path: str, exists: bool, data: bytes | None = None) -> None:
    """A ValueError unless ``path`` (its bytes ``data``, read here when None)
    is absent or a trials file."""
    if not exists:
        return
    try:
        if data is None:
            with tf.io.gfile.GFile(path, "rb") as f:
                data = f.read(MAX_TRIALS_BYTES)
        previous = json.loads(data)
        ours = isinstance(previous, dict) and previous.get("version") == TRIALS_VERSION
    except (ValueError, OSError, tf.errors.OpError):
        ours = False
    if not ours or "trials" not in previous:
        raise ValueError(f"{path} exists and is not a trials file: not replaced")
