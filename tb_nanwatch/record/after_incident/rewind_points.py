"""Rewind points: a state from before an incident and the batches since.

Every ``rewind_every`` steps the session takes a host snapshot of every model
variable (``model.variables``: the weights and, in Keras 3, the SeedGenerator
states that drive dropout and noise) and every optimizer variable (:class:`RewindRing`; the last two are
kept, plus the state before the first step until two later ones exist); the
compiled step keeps the batches of the last steps on the device
(:class:`~tb_nanwatch.record.in_step.batch_ring.BatchRing`, read only when a point is
saved). At an incident or a confirmed explosion the newest snapshot from
before it (before the explosion's onset, less a margin) and the batches from
it through the incident go to ``<run dir>/repro/rewind/`` (``rewind.npz`` and
``rewind.json``, with each step's learning rate and recorded loss): a
:class:`RewindPoint`, from which the remedy trials re-run the steps
(:func:`load_rewind_point`, also on a copied run dir). A point saved for an
explosion is saved again at a later incident with the batches through it
(while the ring still holds them), so the trials re-run the whole span.

On a local run dir (:class:`SnapshotDisk`) each snapshot goes to a file: the
host copy of the variables is read at the step boundary (``numpy()``), then a
background thread writes it to ``<run dir>/.nanwatch-rewind-*/snap_<step>_<n>.npz``
and releases it; the step never waits for the writer. At most one snapshot is
in host memory at a time (a snapshot due while the last is still being
written waits for the next step); a snapshot counts only once its file is
complete, and the file it replaces is removed only then. The folder is
removed when the run ends (:meth:`RewindRing.close`). A remote run dir
(``gs://``) keeps both snapshots in host memory, as before.

Memory (``rewind_memory_mb``): what is held in host memory at once plus the
batch ring: on disk, one snapshot (weights + optimizer state); in memory, two.
Disk (``rewind_disk_mb``, on disk only): four snapshots' worth (the two kept,
the one being written and the saved rewind point) plus the batch ring. Above
either no snapshot is kept and ``not_taken_why`` says why (one warning). No
TensorFlow import here: the variables are read through ``numpy()``.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import json
import math
import os
import posixpath
import shutil
import tempfile
import threading
import warnings
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
# Steps between an explosion's onset and the newest snapshot that may serve it.
ONSET_MARGIN = 2
# load_rewind_point's bound on the metadata file (its arrays: the bundles' limit).
MAX_META_BYTES = 16 << 20
# Per array: the .npy header and the zip entry around it.
_ARRAY_OVERHEAD = 4096

# The folder of a run's snapshot files, below the run dir (one per ring).
SNAPSHOT_PREFIX = ".nanwatch-rewind-"
# Snapshots' worth of disk a ring may use at once: the two kept, the one being
# written and the saved rewind point.
DISK_SNAPSHOTS = 4

# Files this process wrote (the only ones save_rewind_point overwrites).
_created: set[str] = set()
_created_lock = threading.Lock()


class RewindNotTaken(RuntimeError):
    """No rewind point can be saved; the message says why."""


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


def ring_slots(every: int, steps_per_execution: int = 1) -> int:
    """The batch ring's length: the steps from the older of two snapshots
    through the last step before the next one (snapshots fall on execution
    boundaries, so an execution of several steps can add its length twice)."""
    return 2 * every + 2 * (max(int(steps_per_execution), 1) - 1)


# -- on disk ---------------------------------------------------------------------------


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


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _declared_arrays(meta: object, max_bytes: int) -> dict[str, tuple[np.dtype, tuple, int]]:
    """Each array's (dtype, shape, bytes) as ``rewind.json`` declares them;
    a ValueError for a malformed or oversized declaration. The counts are
    bounded (``limits.MAX_REWIND_ARRAYS``) before any array name is made."""
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        raise ValueError("not a rewind point of a known format")
    steps, width = meta.get("steps"), meta.get("batch_size")
    names = (meta.get("weights"), meta.get("optimizer"))
    if not (_count(steps) and _count(width) and _count(meta.get("step"))) or not all(
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
    if dtype.hasobject or not all(_count(d) for d in shape) or len(shape) > 32:
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


# -- in the training process -------------------------------------------------------------


class Snapshot:
    """The state before step ``step``: held on the host, or (once
    :meth:`to_file` wrote it) in a file, read back when ``weights`` or
    ``optimizer`` is asked for."""

    def __init__(
        self,
        step: int,
        weights: dict[str, np.ndarray],
        optimizer: dict[str, np.ndarray],
        optimizer_built: bool,
    ) -> None:
        self.step = step
        self.optimizer_built = optimizer_built
        self.names = (list(weights), list(optimizer))
        self.nbytes = sum(a.nbytes for part in (weights, optimizer) for a in part.values())
        self.path: str | None = None
        self._held: tuple[dict, dict] | None = (weights, optimizer)

    @property
    def weights(self) -> dict[str, np.ndarray]:
        return self._part(0)

    @property
    def optimizer(self) -> dict[str, np.ndarray]:
        return self._part(1)

    def _part(self, which: int) -> dict[str, np.ndarray]:
        held = self._held
        if held is not None:
            return held[which]
        prefix = "wo"[which]
        with np.load(self.path, allow_pickle=False) as npz:
            return {name: npz[f"{prefix}/{i}"] for i, name in enumerate(self.names[which])}

    def to_file(self, path: str) -> None:
        """Writes the held arrays to the new file ``path`` (never following a
        link), then lets them go: read back from the file from then on."""
        weights, optimizer = self._held
        items = [(f"w/{i}", a) for i, a in enumerate(weights.values())]
        items += [(f"o/{i}", a) for i, a in enumerate(optimizer.values())]
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        with os.fdopen(os.open(path, flags, 0o600), "wb") as f:
            write_arrays(f, items)
        self.path = path
        self._held = None


@dataclasses.dataclass(frozen=True)
class SnapshotDisk:
    """Where a ring writes its snapshots (a local run dir) and its disk budget."""

    run_dir: str
    disk_mb: float


def write_snapshot(snapshot: Snapshot, path: str) -> None:
    """The background writer's work (a module function: tests slow it down)."""
    snapshot.to_file(path)


class _Writing:
    """A snapshot being written by its background thread."""

    def __init__(self, snapshot: Snapshot, path: str) -> None:
        self.snapshot, self.path = snapshot, path
        self.error: BaseException | None = None
        self.discard = False
        self.thread = threading.Thread(target=self._run, name="nanwatch-rewind-writer")
        self.thread.daemon = True

    def _run(self) -> None:
        try:
            write_snapshot(self.snapshot, self.path)
        except BaseException as error:  # noqa: BLE001 - said by the ring, never raised here
            self.error = error


def _remove(path: str | None) -> None:
    if path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass


# Steps before a foreseen trouble at which its snapshot is taken (see expect_trouble).
EXPECT_BEFORE = 2


class RewindRing:
    """The host side of the rewind points of one run (see the module docstring).

    The session calls :meth:`take` when :meth:`due`, :meth:`note_step` for
    each recorded step, and :meth:`save` at an incident or an explosion; the
    recorder (given the ring by ``StepRecorder.use_rewind_points``) calls
    :meth:`take_initial` when it builds the step.
    """

    def __init__(
        self,
        every: int,
        memory_mb: float,
        steps_per_execution: int = 1,
        disk: SnapshotDisk | None = None,
    ) -> None:
        self.every = int(every)
        self.disk = disk
        self._writing: _Writing | None = None
        self._folder: str | None = None
        self._written = 0
        self.slots = ring_slots(self.every, steps_per_execution)
        self.max_bytes = int(memory_mb * (1 << 20))
        self.snapshots: collections.deque[Snapshot] = collections.deque(maxlen=2)
        self.not_taken_why: str | None = None
        self.saved: str | None = None
        self.tried = False  # whether a save was attempted (one rewind point a run)
        self.next_step = self.every
        self._rates: dict[int, float] = {}
        self._losses: dict[int, float | None] = {}
        self._saved_through: int | None = None
        self._saved_onset: int | None = None
        self._saved_step: int | None = None
        self._before_onset: bool | None = None
        self._loss_index: int | None = None
        self._lr_index: int | None = None
        self._initial_done = False
        self._foreseen: int | None = None  # the step before a foreseen trouble

    # -- snapshots ---------------------------------------------------------------

    def take_initial(self, model, optimizer, device) -> None:
        """The state before the first step (once; never raises)."""
        if self._initial_done:
            return
        self._initial_done = True
        self.take(0, model, optimizer, device)

    def due(self, steps_done: int) -> bool:
        """Whether a snapshot is due after ``steps_done`` steps (and a
        snapshot whose file is complete joins the kept ones)."""
        self.settle()
        return self.not_taken_why is None and steps_done >= self.next_step

    def expect_trouble(self, step: int) -> None:
        """An early warning foresees trouble at ``step``: the next snapshot is
        due just before it (``EXPECT_BEFORE`` steps), so a rewind is short."""
        self._foreseen = max(int(step) - EXPECT_BEFORE, 0)
        self.next_step = min(self.next_step, self._foreseen)

    def take(self, steps_done: int, model, optimizer, device) -> None:
        """Snapshots the state before step ``steps_done`` (never raises: a
        failure or the memory bound ends the rewind points, one warning)."""
        if self.not_taken_why is not None:
            return
        try:
            self._take(steps_done, model, optimizer, device)
        except Exception as error:  # noqa: BLE001 - evidence only, never the training
            self.give_up(f"could not snapshot the weights: {error!r}", device)

    def _take(self, steps_done: int, model, optimizer, device) -> None:
        ring = device.ring
        if ring is None or (ring.not_kept_why and not ring.created):
            self.give_up(ring.not_kept_why if ring else "no batch ring on the device", device)
            return
        weights = _model_variables(model)
        built = optimizer is not None and bool(getattr(optimizer, "built", False))
        slots = _optimizer_variables(optimizer) if built else []
        why = self._over_budget(_nbytes(weights) + _nbytes(slots), ring.nbytes())
        if why:
            self.give_up(why, device)
            return
        if self.disk is None:
            self.snapshots.append(Snapshot(steps_done, _read(weights), _read(slots), built))
        elif self._writing is not None:
            return  # the last one is still being written: due again at the next step
        else:
            self._write_in_background(Snapshot(steps_done, _read(weights), _read(slots), built))
        self.next_step = steps_done + self.every
        if self._foreseen is not None and steps_done < self._foreseen < self.next_step:
            self.next_step = self._foreseen

    def _over_budget(self, state: int, ring: int) -> str | None:
        """Why a snapshot of ``state`` bytes (with a batch ring of ``ring``
        bytes) is over the memory or the disk budget, or None."""
        held, what = (state, "once") if self.disk else (2 * state, "twice")
        if held + ring > self.max_bytes:
            return (
                f"the weights and optimizer state ({what}: {held / 2**20:.1f} MB) and the batch "
                f"ring ({ring / 2**20:.1f} MB) exceed rewind_memory_mb "
                f"({self.max_bytes / 2**20:.1f} MB)"
            )
        disk = DISK_SNAPSHOTS * state + ring
        if self.disk is not None and disk > self.disk.disk_mb * (1 << 20):
            return (
                f"the rewind points' files ({disk / 2**20:.1f} MB: {DISK_SNAPSHOTS} x the weights "
                f"and optimizer state, {state / 2**20:.1f} MB, plus the batch ring) exceed "
                f"rewind_disk_mb ({self.disk.disk_mb:g} MB)"
            )
        return None

    # -- the files ---------------------------------------------------------------------

    def _write_in_background(self, snapshot: Snapshot) -> None:
        if self._folder is None:
            os.makedirs(self.disk.run_dir, exist_ok=True)
            self._folder = tempfile.mkdtemp(prefix=SNAPSHOT_PREFIX, dir=self.disk.run_dir)
        self._written += 1
        path = os.path.join(self._folder, f"snap_{snapshot.step}_{self._written}.npz")
        self._writing = _Writing(snapshot, path)
        self._writing.thread.start()

    def settle(self, wait: bool = False) -> None:
        """The snapshot being written joins the kept ones once its file is
        complete (``wait``: waits for it); the file it replaces is removed."""
        writing = self._writing
        if writing is None or (writing.thread.is_alive() and not wait):
            return
        writing.thread.join()
        self._writing = None
        if writing.discard or writing.error is not None:
            _remove(writing.path)
            if writing.error is not None:
                self.give_up(f"could not write the snapshot to disk: {writing.error!r}")
            return
        if len(self.snapshots) == self.snapshots.maxlen:
            _remove(self.snapshots[0].path)
        self.snapshots.append(writing.snapshot)

    def drop_after(self, step: int) -> None:
        """Forgets the snapshots after ``step`` (after a rewind to ``step``
        they hold the failing run's state), the one being written included."""
        if self._writing is not None:
            self._writing.discard = True
            self.settle(wait=True)
        kept = [s for s in self.snapshots if s.step <= step]
        for s in self.snapshots:
            if s.step > step:
                _remove(s.path)
        self.snapshots.clear()
        self.snapshots.extend(kept)

    def close(self) -> None:
        """The end of the run: waits for the writer, removes the snapshot files
        and their folder (the saved rewind point stays). Never raises."""
        if self._writing is not None:
            self._writing.discard = True
            self.settle(wait=True)
        self.snapshots.clear()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    def give_up(self, why: str, device=None) -> None:
        """No rewind points from now on (one warning saying ``why``)."""
        if self.not_taken_why is not None:
            return
        self.not_taken_why = why
        if self._writing is not None:
            self._writing.discard = True
        for snapshot in self.snapshots:
            _remove(snapshot.path)
        self.snapshots.clear()
        if device is not None and device.ring is not None:
            try:
                device.ring.stop()
            except Exception:  # noqa: BLE001 - freeing memory is best effort
                pass
        warnings.warn(f"NanWatch keeps no rewind points: {why}", RuntimeWarning, stacklevel=3)

    def note_step(self, step: int, vector: np.ndarray, schema) -> None:
        """Keeps step ``step``'s learning rate and loss (from its statistics vector)."""
        if self._lr_index is None:
            self._lr_index = schema.header_index("lr")
            self._loss_index = schema.header_index("loss")
        rate = float(vector[self._lr_index])
        self._rates[step] = rate if math.isfinite(rate) else None
        self._rates.pop(step - self.slots, None)
        self._losses[step] = float(vector[self._loss_index])
        self._losses.pop(step - self.slots, None)

    # -- saving ------------------------------------------------------------------------

    def save(self, run_dir: str, device, through: int, onset: int | None = None) -> str:
        """Saves the rewind point for steps through ``through`` (the incident
        or the step that confirmed an explosion whose onset is ``onset``);
        returns its relative path. Raises :class:`RewindNotTaken` saying why not."""
        if self.saved is not None:
            if self._saved_through is not None and through > self._saved_through:
                self._extend(run_dir, device, through)
            return self.saved
        self.tried = True
        self.settle(wait=True)  # the newest snapshot counts; one on the host at a time
        if self.not_taken_why is not None:
            raise RewindNotTaken(self.not_taken_why)
        snapshot, before_onset = self._choose(through, onset)
        self._write(run_dir, device, snapshot, through, onset, before_onset)
        return self.saved

    def _extend(self, run_dir: str, device, through: int) -> None:
        """The saved point again, with the batches through ``through`` (a later
        incident after an explosion), while its snapshot and the batches since
        are still kept; else the saved one stays (never raises)."""
        kept = [s for s in self.snapshots if s.step == self._saved_step]
        if not kept or through >= kept[0].step + self.slots or self.not_taken_why is not None:
            return
        try:
            self._write(run_dir, device, kept[0], through, self._saved_onset, self._before_onset)
        except RewindNotTaken:
            return  # the ring no longer holds the batches: the point saved first stays
        except Exception as error:  # noqa: BLE001 - the point saved first stays
            warnings.warn(
                f"NanWatch kept the rewind point through step {self._saved_through}: {error!r}",
                RuntimeWarning,
                stacklevel=4,
            )

    def _write(
        self, run_dir: str, device, snapshot: Snapshot, through: int, onset, before_onset
    ) -> None:
        try:
            batches = device.ring.read(snapshot.step, through)
        except RuntimeError as error:  # batch_ring.RingMiss
            raise RewindNotTaken(str(error)) from None
        point = RewindPoint(
            step=snapshot.step,
            weights=snapshot.weights,
            optimizer=snapshot.optimizer,
            batches=batches,
            structure=device.batch_structure,
            learning_rates=[self._rates.get(s) for s in range(snapshot.step, through + 1)],
            losses=[self._losses.get(s) for s in range(snapshot.step, through + 1)],
            info={
                "through_step": int(through),
                "onset": onset,
                "before_onset": before_onset,
                "optimizer_built": snapshot.optimizer_built,
                "rewind_every": self.every,
            },
        )
        self.saved = save_rewind_point(run_dir, point)
        self._saved_through, self._saved_onset = int(through), onset
        self._saved_step, self._before_onset = snapshot.step, before_onset

    def _choose(self, through: int, onset: int | None) -> tuple[Snapshot, bool | None]:
        """The newest usable snapshot at or before the incident (before the
        onset less ONSET_MARGIN for an explosion; else the oldest kept, and
        ``before_onset`` False)."""
        usable = [s for s in self.snapshots if s.step <= through < s.step + self.slots]
        if onset is None:
            if usable:
                return max(usable, key=lambda s: s.step), None
        else:
            before = [s for s in usable if s.step <= onset - ONSET_MARGIN]
            if before:
                return max(before, key=lambda s: s.step), True
            if usable:
                return min(usable, key=lambda s: s.step), False
        kept = ", ".join(str(s.step) for s in self.snapshots) or "none"
        raise RewindNotTaken(
            f"no snapshot kept from before step {through} with its batches since "
            f"(snapshots every {self.every} steps; kept: {kept})"
        )


def _model_variables(model) -> list:
    """Every variable of the model: ``model.variables`` (Keras 3: the weights
    and the SeedGenerator states), else its weights."""
    found = getattr(model, "variables", None)
    found = found() if callable(found) else found
    return list(found if found is not None else model.weights)


def _optimizer_variables(optimizer) -> list:
    """Its variables (a property in Keras 3, a method in older optimizers)."""
    found = getattr(optimizer, "variables", [])
    return list(found() if callable(found) else found)


def _nbytes(variables: list) -> int:
    total = 0
    for v in variables:
        try:
            total += math.prod(int(d) for d in v.shape) * np.dtype(_dtype_name(v)).itemsize
        except TypeError:
            total += _value(v).nbytes
    return total


def _dtype_name(v) -> str:
    dtype = v.dtype
    return getattr(dtype, "name", dtype)


def _value(v) -> np.ndarray:
    """The variable's value now, in an array of its own (Keras 3's ``numpy()``
    already is one; a view of a tensor's buffer is copied)."""
    value = v.numpy()
    if isinstance(value, np.ndarray) and value.flags.owndata and value.flags.writeable:
        return value
    return np.array(value, copy=True)


def _read(variables: list) -> dict[str, np.ndarray]:
    """Each variable's value by path (a repeated path gets ``#<n>``)."""
    out: dict[str, np.ndarray] = {}
    for v in variables:
        path = getattr(v, "path", None)  # as taps.variable_path: Keras 3's, or tf_keras' name
        name = path if isinstance(path, str) else v.name.split(":")[0]
        key, n = name, 1
        while key in out:
            key, n = f"{name}#{n}", n + 1
        out[key] = _value(v)
    return out
