"""Rewind points: a state from before an incident and the batches since.

Every ``rewind_every`` steps the session takes a host snapshot of every model
variable (``model.variables``: the weights and, in Keras 3, the SeedGenerator
states that drive dropout and noise) and every optimizer variable (:class:`RewindRing`; the last two are
kept, plus the state before the first step until two later ones exist); the
compiled step keeps the batches of the last steps on the device
(:class:`~tb_nanwatch.record.in_step.batch_ring.BatchRing`, read only when a point is
saved). At an incident or a confirmed explosion the newest snapshot from
before it (before the explosion's onset, less a margin) and the batches from
it through the incident go to ``<run dir>/repro/rewind/`` as a
:class:`~tb_nanwatch.record.after_incident.rewind_file.RewindPoint`
(``rewind_file.py``: the format, written and read), from which the remedy
trials re-run the steps. A point saved for an
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
import math
import os
import shutil
import tempfile
import threading
import warnings

import numpy as np

from tb_nanwatch.record.after_incident.rewind_file import (
    RewindPoint,
    save_rewind_point,
    write_arrays,
)

# Steps between an explosion's onset and the newest snapshot that may serve it.
ONSET_MARGIN = 2

# The folder of a run's snapshot files, below the run dir (one per ring).
SNAPSHOT_PREFIX = ".nanwatch-rewind-"
# Snapshots' worth of disk a ring may use at once: the two kept, the one being
# written and the saved rewind point.
DISK_SNAPSHOTS = 4


class RewindNotTaken(RuntimeError):
    """No rewind point can be saved; the message says why."""


def ring_slots(every: int, steps_per_execution: int = 1) -> int:
    """The batch ring's length: the steps from the older of two snapshots
    through the last step before the next one (snapshots fall on execution
    boundaries, so an execution of several steps can add its length twice)."""
    return 2 * every + 2 * (max(int(steps_per_execution), 1) - 1)


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
