"""A rewind point on disk: ``<run dir>/repro/rewind/`` (``rewind.npz``, ``rewind.json``).

A :class:`RewindPoint` is the state before a step (every model and optimizer
variable) and the batches from it through the incident, with each step's
learning rate and recorded loss; the remedy trials re-run the steps from it
(:func:`load_rewind_point`, also on a copied run dir). Written by the
training process's ring (``rewind_points.py``) and never over a file this
process did not write; read as untrusted input: the metadata's size, the
arrays' count, dtypes and shapes and their total are checked against
``evidence/limits.py`` before any array is read, and no symbolic link below
the run dir is followed. No TensorFlow import here.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import posixpath
import threading
import zipfile
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from tb_nanwatch.evidence import limits, run_dir_box
from tb_nanwatch.evidence.run_dir_box import is_remote
from tb_nanwatch.record.after_incident.bundle import jsonable_structure
from tb_nanwatch.record.writing.files import gfile

REWIND_DIR = "repro/rewind"
ARRAYS_FILE = "rewind.npz"
META_FILE = "rewind.json"
FORMAT_VERSION = 1
# load_rewind_point's bound on the metadata file (its arrays: the bundles' limit).
MAX_META_BYTES = 16 << 20
# Per array: the .npy header and the zip entry around it.
_ARRAY_OVERHEAD = 4096

# Files this process wrote (the only ones save_rewind_point overwrites).
_created: set[str] = set()
_created_lock = threading.Lock()


@dataclasses.dataclass
class RewindPoint:
    """The state before step ``step`` and the batches from it on.

    ``batches[i]`` is the flat batch of step ``step + i`` (``structure``
    rebuilds it, as a reproduction bundle's); ``learning_rates[i]`` its
    learning rate when known, ``losses[i]`` its recorded loss (None: not
    known). ``info``: where it came from (``through_step``, ``onset``,
    ``before_onset``, ``optimizer_built``, ...).
    """

    step: int
    weights: dict[str, np.ndarray]
    optimizer: dict[str, np.ndarray]
    batches: list[list[np.ndarray]]
    structure: Any
    learning_rates: list[float | None]
    info: dict = dataclasses.field(default_factory=dict)
    losses: list[float | None] = dataclasses.field(default_factory=list)

    def recorded_losses(self) -> dict[int, float]:
        """The recorded loss of each of its steps that has one, by step."""
        return {self.step + i: v for i, v in enumerate(self.losses) if v is not None}


def save_rewind_point(run_dir: str, point: RewindPoint) -> str:
    """Writes ``point`` under ``run_dir``; returns its path relative to it.

    Never follows a symbolic link below ``run_dir`` and never overwrites a
    file this process did not write (FileExistsError).
    """
    arrays: dict[str, np.ndarray] = {}
    declared: dict[str, list] = {}

    def add(key: str, value) -> None:
        value = np.asarray(value)
        arrays[key] = value
        declared[key] = [value.dtype.str, list(value.shape)]

    for i, value in enumerate(point.weights.values()):
        add(f"w/{i}", value)
    for i, value in enumerate(point.optimizer.values()):
        add(f"o/{i}", value)
    for i, batch in enumerate(point.batches):
        for j, value in enumerate(batch):
            add(f"b/{i}/{j}", value)
    meta = {
        "format_version": FORMAT_VERSION,
        "step": int(point.step),
        "steps": len(point.batches),
        "batch_size": len(point.batches[0]) if point.batches else 0,
        "structure": jsonable_structure(point.structure),
        "learning_rates": [None if r is None else float(r) for r in point.learning_rates],
        "losses": [_jsonable_loss(v) for v in point.losses],
        "weights": list(point.weights),
        "optimizer": list(point.optimizer),
        "arrays": declared,
        "bytes": int(sum(a.nbytes for a in arrays.values())),
        "info": point.info,
    }
    directory = _directory_for_writing(run_dir)
    if is_remote(directory):
        buffer = io.BytesIO()
        write_arrays(buffer, arrays.items())
        data: bytes | Callable = buffer.getvalue()
    else:  # straight into the file: no second copy in memory
        data = lambda f: write_arrays(f, arrays.items())  # noqa: E731
    _write_new(posixpath.join(directory, ARRAYS_FILE), data)
    _write_new(posixpath.join(directory, META_FILE), json.dumps(meta, indent=1).encode())
    return REWIND_DIR


def load_rewind_point(path: str, max_bytes: int | None = None) -> RewindPoint:
    """The rewind point at ``path``: a run dir, its ``repro/rewind`` dir or
    the ``rewind.json`` file. Read only inside the run dir (no symlink below
    it followed, regular files only, never waiting on a FIFO); the declared
    sizes (at most ``max_bytes`` of arrays, by default the bundles' limit
    ``limits.max_bundle_bytes()``, and ``limits.MAX_REWIND_ARRAYS`` arrays)
    are checked before anything is loaded; no pickles."""
    max_bytes = limits.max_bundle_bytes() if max_bytes is None else max_bytes
    read = _reader(path)
    meta = limits.loads_bounded(read(META_FILE, MAX_META_BYTES), META_FILE, MAX_META_BYTES)
    declared = _declared_arrays(meta, max_bytes)
    limit = sum(nbytes for _, _, nbytes in declared.values())
    limit += _ARRAY_OVERHEAD * (len(declared) + 1)
    arrays = _checked_arrays(read(ARRAYS_FILE, limit), declared)
    steps, width = meta["steps"], meta["batch_size"]
    weights = {name: arrays[f"w/{i}"] for i, name in enumerate(meta["weights"])}
    optimizer = {name: arrays[f"o/{i}"] for i, name in enumerate(meta["optimizer"])}
    batches = [[arrays[f"b/{i}/{j}"] for j in range(width)] for i in range(steps)]
    return RewindPoint(
        step=int(meta["step"]),
        weights=weights,
        optimizer=optimizer,
        batches=batches,
        structure=meta.get("structure"),
        learning_rates=_read_rates(meta.get("learning_rates"), steps),
        info=dict(info) if isinstance(info := meta.get("info"), dict) else {},
        losses=_read_losses(meta.get("losses"), steps),
    )


def write_arrays(file: Any, items: Iterable[tuple[str, np.ndarray]]) -> None:
    """An ``.npz`` (uncompressed, as ``np.savez`` writes; no pickles) of
    ``items`` into the open binary ``file``, one array at a time."""
    with zipfile.ZipFile(file, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        for key, value in items:
            with archive.open(f"{key}.npy", "w", force_zip64=True) as entry:
                np.lib.format.write_array(entry, np.asarray(value), allow_pickle=False)


def _jsonable_loss(value: float | None) -> float | str | None:
    """A loss for rewind.json: a number, ``"nan"``/``"inf"``/``"-inf"``, or None."""
    if value is None:
        return None
    value = float(value)
    if math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def _read_losses(values: object, steps: int) -> list[float | None]:
    """The recorded losses of rewind.json (an older file has none: all None)."""
    if not isinstance(values, list) or len(values) != steps:
        return [None] * steps
    out: list[float | None] = []
    for value in values:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out.append(float(value))
        elif value in ("nan", "inf", "-inf"):
            out.append(float(value))
        else:
            out.append(None)
    return out


def _read_rates(values: object, steps: int) -> list[float | None]:
    """The learning rates of rewind.json: a number or None per step."""
    if not isinstance(values, list) or len(values) != steps:
        return [None] * steps
    number = (int, float)
    return [float(v) if isinstance(v, number) and not isinstance(v, bool) else None for v in values]


def _declared_arrays(meta: object, max_bytes: int) -> dict[str, tuple[np.dtype, tuple, int]]:
    """Each array's (dtype, shape, bytes) as ``rewind.json`` declares them;
    a ValueError for a malformed or oversized declaration. The counts are
    bounded (``limits.MAX_REWIND_ARRAYS``) before any array name is made."""
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        raise ValueError("not a rewind point of a known format")
    steps, width = meta.get("steps"), meta.get("batch_size")
    names = (meta.get("weights"), meta.get("optimizer"))
    counts = (steps, width, meta.get("step"))
    if any(limits.count(v) is None for v in counts) or not all(
        isinstance(n, list) and all(isinstance(p, str) for p in n) for n in names
    ):
        raise ValueError("rewind.json: malformed step, steps, batch_size, weights or optimizer")
    arrays = meta.get("arrays")
    count = steps * width + len(names[0]) + len(names[1])
    if count > limits.MAX_REWIND_ARRAYS:
        raise limits.LimitError(
            f"rewind.json declares {count} arrays, more than the limit of "
            f"{limits.MAX_REWIND_ARRAYS}"
        )
    if not isinstance(arrays, dict) or len(arrays) != count:
        raise ValueError("rewind.json: the declared arrays do not match its steps and names")
    expected = {f"w/{i}" for i in range(len(names[0]))} | {f"o/{i}" for i in range(len(names[1]))}
    expected |= {f"b/{i}/{j}" for i in range(steps) for j in range(width)}
    if set(arrays) != expected:
        raise ValueError("rewind.json: the declared arrays do not match its steps and names")
    out: dict[str, tuple[np.dtype, tuple, int]] = {}
    total = 0
    for key, declaration in arrays.items():
        dtype, shape = _declaration(key, declaration)
        nbytes = limits.declared_bytes(shape, dtype.itemsize)
        total += nbytes
        if total > max_bytes:
            raise limits.LimitError(
                f"the rewind point declares more than {max_bytes / limits.MB:g} MB of arrays "
                f"(the limit; set {limits.BUNDLE_LIMIT_VARIABLE} for a trusted run dir)"
            )
        out[key] = (dtype, shape, nbytes)
    return out


def _declaration(key: str, declaration: object) -> tuple[np.dtype, tuple]:
    """The (dtype, shape) of one declared array; a ValueError if malformed."""
    try:
        dtype, shape = np.dtype(declaration[0]), tuple(declaration[1])
    except (TypeError, ValueError, IndexError, KeyError):
        raise ValueError(f"rewind.json: array {key} has a malformed declaration") from None
    if dtype.hasobject or any(limits.count(d) is None for d in shape) or len(shape) > 32:
        raise ValueError(f"rewind.json: array {key} has a bad dtype or shape")
    return dtype, shape


def _checked_arrays(raw: bytes, declared: dict) -> dict[str, np.ndarray]:
    """The arrays of ``raw`` (an npz), each checked against its declaration
    (the entry's size and its ``.npy`` header before the data is read)."""
    out = {}
    with np.load(io.BytesIO(raw), allow_pickle=False) as npz:
        entries = {info.filename: info for info in npz.zip.infolist()}
        for key, (dtype, shape, nbytes) in declared.items():
            entry = entries.get(f"{key}.npy")
            if entry is None or entry.file_size > nbytes + _ARRAY_OVERHEAD:
                raise ValueError(f"rewind.npz: array {key} is missing or larger than declared")
            if _npy_header(npz.zip, entry) != (dtype, shape):
                raise ValueError(f"rewind.npz: array {key} is not the declared {dtype} {shape}")
            out[key] = npz[key]
    return out


def _npy_header(archive, entry) -> tuple[np.dtype, tuple] | None:
    """The (dtype, shape) an ``.npy`` entry's header declares (None if unreadable)."""
    try:
        shape, dtype = limits.npy_header(archive, entry)
    except (ValueError, OSError):
        return None
    return dtype, shape


def _reader(path: str) -> Callable[[str, int], bytes]:
    """A function reading one file of the rewind point at ``path`` (see
    :func:`load_rewind_point`) within a byte bound: locally, only inside the
    run dir, through :func:`run_dir_box.read_inside`."""
    path = os.fspath(path)
    if is_remote(path):
        directory = _remote_directory(path)
        return lambda name, limit: _read_remote(posixpath.join(directory, name), limit)
    directory = os.path.dirname(path) if path.endswith(META_FILE) else path
    norm = os.path.normpath(directory)
    parent, name = os.path.split(norm)
    if name == "rewind" and os.path.basename(parent) == "repro":
        root, prefix = os.path.dirname(parent), REWIND_DIR
    elif os.path.lexists(os.path.join(norm, META_FILE)):
        root, prefix = norm, ""
    else:
        root, prefix = norm, REWIND_DIR
    if not os.path.lexists(os.path.join(root, *prefix.split("/"), META_FILE)):
        raise FileNotFoundError(f"no rewind point under {path!r}")
    root = root or "."

    def read(name: str, limit: int) -> bytes:
        relative = f"{prefix}/{name}" if prefix else name
        return run_dir_box.read_inside(root, relative, limit, f"the rewind point's {name}")

    return read


def _remote_directory(path: str) -> str:
    if path.endswith(META_FILE):
        return posixpath.dirname(path)
    fs = gfile()
    for candidate in (path, posixpath.join(path, REWIND_DIR)):
        if fs.exists(posixpath.join(candidate, META_FILE)):
            return candidate
    raise FileNotFoundError(f"no rewind point under {path!r}")


def _read_remote(path: str, limit: int) -> bytes:
    """The file's bytes; a ValueError when it is larger than ``limit``."""
    fs = gfile()
    if fs.stat(path).length > limit:
        raise ValueError(f"{path} is larger than expected ({limit} bytes at most)")
    with fs.GFile(path, "rb") as f:
        return f.read(limit + 1)


def _directory_for_writing(run_dir: str) -> str:
    """``<run_dir>/repro/rewind``, made as needed; no symbolic link below ``run_dir``."""
    if is_remote(run_dir):
        directory = posixpath.join(run_dir, REWIND_DIR)
        gfile().makedirs(directory)
        return directory
    directory = run_dir
    for part in REWIND_DIR.split("/"):
        directory = os.path.join(directory, part)
        if os.path.islink(directory):
            raise FileExistsError(f"{directory} is a symbolic link; not followed")
        if not os.path.isdir(directory):
            os.makedirs(directory, exist_ok=True)
    return directory


def _write_new(path: str, data: bytes | Callable[[Any], None]) -> None:
    """Writes ``path``, which must not exist unless this process wrote it
    (``data``: the bytes, or a function writing into the open file)."""
    with _created_lock:
        if is_remote(path):
            fs = gfile()
            if fs.exists(path) and path not in _created:
                raise FileExistsError(f"{path} exists and is not NanWatch's; not overwritten")
            with fs.GFile(path, "wb") as f:
                data(f) if callable(data) else f.write(data)
        else:
            if os.path.lexists(path):
                if path not in _created or os.path.islink(path):
                    raise FileExistsError(f"{path} exists and is not NanWatch's; not overwritten")
                os.unlink(path)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
            with os.fdopen(os.open(path, flags, 0o644), "wb") as f:
                data(f) if callable(data) else f.write(data)
        _created.add(path)
