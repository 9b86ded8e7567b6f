"""The files of a reproduction bundle, read and written inside the run dir.

A bundle dir ``<run dir>/repro/step_<N>/`` (or ``repro/rewind/``, which holds
the model of an explosion) may come from anyone: every file of it is read
inside the run dir without following a symlink below it, only when it is a
regular file and never waiting on one (a FIFO, a device), every path named
in ``bundle.json`` must be relative, and what ``bundle.json`` and
``bundle.npz`` declare is checked against :mod:`tb_nanwatch.evidence.limits`
before anything is loaded (``model.keras``: the bundle limit). Writes never
follow a symlink (:func:`tb_nanwatch.evidence.run_dir_box.safe_write_bytes`).
A problem is one line: a ``ValueError`` (``RunDirError``, ``LimitError``) or a
``FileNotFoundError``. Paths are taken literally (no glob). URL-like paths
(``gs://``, ``ram://``) go through ``tf.io.gfile``, with the same limits.
"""

from __future__ import annotations

import io
import os
import posixpath
import re
from typing import Any

import numpy as np

from tb_nanwatch.evidence import limits, run_dir_box
from tb_nanwatch.record.writing.files import gfile

BUNDLE_DIR = "repro"
_STEP_DIR = re.compile(r"step_\d+")
_REWIND = "rewind"


def bundle_box(directory: str) -> tuple[str, str]:
    """``(run dir, "repro/step_<N>")`` for a bundle dir in its run dir (or
    ``"repro/rewind"``, the rewind point's dir that holds ``model.json``),
    else ``(directory, "")``: what the bundle's files are checked against."""
    norm = directory.rstrip("/") or directory
    parent, name = posixpath.split(norm)
    run_dir, repro = posixpath.split(parent)
    if repro == BUNDLE_DIR and (_STEP_DIR.fullmatch(name) or name == _REWIND):
        return run_dir or ".", f"{BUNDLE_DIR}/{name}"
    return norm, ""


def member(directory: str, name: object, what: str = "bundle file") -> str:
    """The path of the file ``name`` of a bundle dir; a ``RunDirError``
    unless it is relative and resolves inside the bundle dir and its run dir."""
    clean = run_dir_box.relative_path(name, what)
    if run_dir_box.is_remote(directory):
        return posixpath.join(directory, clean)
    root, relative = bundle_box(directory)
    if relative:
        run_dir_box.inside(root, f"{relative}/{clean}", what)
    return run_dir_box.inside(directory, clean, what)


def find_bundle_dir(path: str) -> str:
    """``path`` when it holds ``bundle.json``, else its first ``repro/step_<N>``
    (listed literally: a path with ``[`` or ``*`` is a name, not a pattern)."""
    remote = run_dir_box.is_remote(path)
    exists = gfile().exists if remote else os.path.lexists
    if exists(posixpath.join(path, "bundle.json")):
        return path
    repro = posixpath.join(path, BUNDLE_DIR)
    try:
        names = gfile().listdir(repro) if remote else run_dir_box.list_inside(path, BUNDLE_DIR)
    except run_dir_box.RunDirError:
        raise
    except Exception:  # noqa: BLE001 - missing or unreadable: no bundle
        names = []
    steps = sorted(n.rstrip("/") for n in names if _STEP_DIR.fullmatch(n.rstrip("/")))
    if not steps:
        raise FileNotFoundError(f"no reproduction bundle under {path!r}")
    return posixpath.join(repro, steps[0])


def read_member(directory: str, name: object, max_bytes: int, what: str) -> bytes:
    """The bytes of the file ``name`` of a bundle dir, at most ``max_bytes``:
    locally only inside the run dir (no symlink below it followed, a regular
    file opened without blocking), see :func:`run_dir_box.read_inside`."""
    if run_dir_box.is_remote(directory):
        return _read_remote(member(directory, name, what), max_bytes, what)
    clean = run_dir_box.relative_path(name, what)
    root, relative = bundle_box(directory)
    target = f"{relative}/{clean}" if relative else clean
    try:
        return run_dir_box.read_inside(root, target, max_bytes, what)
    except run_dir_box.RunDirError:
        raise
    except ValueError as error:  # over max_bytes
        raise limits.LimitError(str(error)) from None


def _read_remote(path: str, max_bytes: int, what: str) -> bytes:
    fs = gfile()
    size = fs.stat(path).length
    if size > max_bytes:
        raise limits.LimitError(
            f"{what} is {size / limits.MB:.0f} MB, more than the {max_bytes / limits.MB:g} MB limit"
        )
    with fs.GFile(path, "rb") as reader:
        return reader.read(max_bytes + 1)


def read_json(directory: str, name: str = "bundle.json") -> dict:
    """A JSON object file of a bundle dir, within the size and depth limits."""
    data = read_member(directory, name, limits.MAX_JSON_BYTES, name)
    value = limits.loads_bounded(data, name)
    if not isinstance(value, dict):
        raise ValueError(f"{name} is not a JSON object")
    return value


def read_meta(directory: str) -> dict:
    """``bundle.json``, checked: what the loader reads of it is well formed
    and within the limits (batch parts, names)."""
    meta = read_json(directory)
    step, size = meta.get("step"), meta.get("batch_size")
    if limits.count(step, 2**53) is None:
        raise ValueError(f"bundle.json: step {step!r} is not a step")
    if limits.count(size, limits.MAX_BATCH_PARTS) is None:
        raise limits.LimitError(
            f"bundle.json: batch_size {size!r} is not a count up to {limits.MAX_BATCH_PARTS}"
        )
    for key in ("weights", "optimizer_variables"):
        names = meta.get(key) or []
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"bundle.json: {key} is not a list of names")
    leaves = _leaves(meta.get("batch_structure"))
    if leaves > size:
        raise ValueError(f"bundle.json: batch_structure has {leaves} parts, batch_size {size}")
    return meta


def _leaves(structure: Any) -> int:
    """The array places of a batch structure (JSON depth is already bounded)."""
    if isinstance(structure, dict):
        return sum(_leaves(v) for v in structure.values())
    if isinstance(structure, list):
        return sum(_leaves(v) for v in structure)
    return 0 if structure is None else 1


def read_arrays(directory: str, required: list[str], optional: list[str]) -> dict[str, np.ndarray]:
    """The arrays ``required`` (each must be there: one line names a missing
    one) and those of ``optional`` that are there, from ``bundle.npz``, once
    their declared sizes are within ``limits.max_bundle_bytes()``."""
    budget = limits.max_bundle_bytes()
    data = io.BytesIO(read_member(directory, "bundle.npz", budget, "bundle.npz"))
    with np.load(data, allow_pickle=False) as arrays:
        present = set(arrays.files)
        missing = [name for name in required if name not in present]
        if missing:
            raise ValueError(f"bundle.npz holds no array {missing[0]!r} (named in bundle.json)")
        names = list(required) + [name for name in optional if name in present]
        limits.check_npz(data, names, budget, "bundle.npz")
        return {name: arrays[name] for name in names}


def write_member(directory: str, name: str, data: bytes) -> str:
    """Writes the file ``name`` of a bundle dir, never through a symlink."""
    if run_dir_box.is_remote(directory):
        fs = gfile()
        fs.makedirs(directory)
        path = posixpath.join(directory, run_dir_box.relative_path(name))
        if fs.exists(path):
            # Removed first: some file systems (ram://) do not truncate a file
            # opened for writing, and a shorter body would leave the old tail.
            fs.remove(path)
        with fs.GFile(path, "wb") as f:
            f.write(data)
        return path
    root, relative = bundle_box(directory)
    target = f"{relative}/{name}" if relative else name
    return run_dir_box.safe_write_bytes(root, target, data, make_dirs=True)
