"""The device-side ring of the last batches, for rewind points.

A :class:`BatchRing` holds the flat batch of each of the last ``slots`` steps
in replica-local variables (``ON_READ``: each replica keeps its own shard),
written inside the compiled step at the slot of the step's sequence number:
one in-place scatter a batch tensor a step, and one into a small index (each
slot's step number and tensor shapes), no device-to-host transfer. The host
reads it only when a rewind point is saved (:meth:`BatchRing.read`).

Without XLA each tensor's ring starts empty and grows, once, to the largest
batch seen (smaller batches are padded, their own shape kept beside them);
it is written only while its size stays within ``max_bytes`` (and until the
host stops it). Under XLA a variable cannot change its shape: the ring has
the traced batch's shape (a batch dimension unknown at trace time gets
``DEFAULT_ROWS`` rows; a larger batch is truncated and the step is then not
replayable from the ring), it is created only when it fits in ``max_bytes``,
and written in place on every step.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import gen_resource_variable_ops

# Rows of a fixed-shape (XLA) ring's slot when the traced batch size is unknown.
DEFAULT_ROWS = 1024


class RingMiss(RuntimeError):
    """The ring does not hold the batches asked for (the message says why)."""


class BatchRing:
    """The batches of the last ``slots`` steps, on the device."""

    def __init__(self, slots: int, max_bytes: int) -> None:
        self.slots = int(slots)
        self.max_bytes = int(max_bytes)
        self.not_kept_why: str | None = None
        self._tensors: list[tf.Variable | None] = []
        # Per slot: its step number, then the shape of each kept tensor of rank >= 1.
        self._index: tf.Variable | None = None
        self._columns: list[tuple[int, int]] = []  # each tensor's columns of the index
        self._on: tf.Variable | None = None
        self._growable = True
        self._dtypes: list[tf.DType] = []

    @property
    def created(self) -> bool:
        return self._index is not None

    # -- creation and the compiled step ---------------------------------------------

    def keep_none(self, why: str) -> None:
        """Leaves the ring uncreated: its batches cannot be kept (``why``)."""
        self.not_kept_why = why

    def create(self, batch: list[tf.Tensor], growable: bool, local_variable) -> None:
        """Creates the variables (eagerly, under ``tf.init_scope``).

        ``local_variable(initial, name, shape=None)`` makes a replica-local
        variable (the device record's). Leaves the ring uncreated, saying
        why in ``not_kept_why``, when a fixed-shape ring would not fit.
        """
        self._growable = growable
        if not growable:
            why = _fixed_ring_problem(batch, self.slots, self.max_bytes)
            if why is not None:
                self.not_kept_why = why
                return
        self._dtypes = [t.dtype for t in batch]
        self._tensors = [self._tensor_ring(t, growable, local_variable) for t in batch]
        width = 1
        for values, t in zip(self._tensors, batch, strict=True):
            rank = t.shape.rank if values is not None else 0
            self._columns.append((width, width + rank))
            width += rank
        self._index = local_variable(self._no_steps(width), "rewind_index")
        self._on = local_variable(tf.constant(True), "rewind_ring_on")

    def _tensor_ring(self, t: tf.Tensor, growable: bool, local_variable):
        if t.shape.rank is None or not (
            t.dtype.is_floating or t.dtype.is_integer or t.dtype.is_bool
        ):
            return None  # a string, or an unknown rank: not kept (RingMiss when read)
        rank = t.shape.rank or 0
        if rank == 0:
            values = local_variable(tf.zeros([self.slots], t.dtype), "rewind_batches")
        elif growable:
            empty = tf.zeros([self.slots] + [0] * rank, t.dtype)
            values = local_variable(empty, "rewind_batches", tf.TensorShape(None))
        else:
            rows = t.shape[0] if t.shape[0] is not None else DEFAULT_ROWS
            shape = [self.slots, rows] + list(t.shape[1:])
            # Never zeroed: pages no step writes stay unused (read only up to each slot's shape).
            empty = tf.raw_ops.Empty(shape=shape, dtype=t.dtype, init=False)
            values = local_variable(empty, "rewind_batches")
        return values

    def _no_steps(self, width: int) -> tf.Tensor:
        return tf.fill([self.slots, width], tf.constant(-1, tf.int64))

    def write(self, count: tf.Tensor, batch: list[tf.Tensor], stats) -> None:
        """Writes the step's batch at the slot of its sequence number ``count``
        (1 for the first step), in the compiled step."""
        if not self.created:
            return
        index = tf.reshape(tf.cast((count - 1) % self.slots, tf.int32), [1])

        def write_all() -> None:
            row = [tf.reshape(count - 1, [1])]
            for values, t in zip(self._tensors, batch, strict=False):
                if values is not None:
                    _write(values, index, t, self._growable)
                    if t.shape.rank:
                        row.append(tf.cast(tf.shape(t), tf.int64))
            _scatter(self._index, index, tf.expand_dims(tf.concat(row, 0), 0))

        if not self._growable:
            # Under XLA: in place, every step (a conditional would be one more
            # loop; the ring's size was checked when it was made).
            write_all()
            return
        stats.rare_assign(tf.logical_and(self._on.read_value(), self._fits(batch)), write_all)

    def _fits(self, batch: list[tf.Tensor]) -> tf.Tensor:
        """Whether the ring, grown to hold this batch, stays within max_bytes."""
        total = tf.constant(0, tf.int64)
        for values, t in zip(self._tensors, batch, strict=False):
            if values is None or not t.shape.rank:
                continue
            current = _variable_shape(values)[1:]
            size = tf.reduce_prod(tf.cast(tf.maximum(current, tf.shape(t)), tf.int64))
            total += size * t.dtype.size * self.slots
        return total <= self.max_bytes

    # -- on the host ---------------------------------------------------------------

    def start_over(self) -> None:
        """No step kept (a new run reusing the compiled step)."""
        if self.created:
            for local in _locals(self._index):
                local.assign(self._no_steps(local.shape[1]))
            for local in _locals(self._on):
                local.assign(True)

    def stop(self) -> None:
        """Writes nothing from now on and frees a grown ring's memory."""
        if not self.created:
            return
        for local in _locals(self._on):
            local.assign(False)
        if self._growable:
            for values in self._tensors:
                if values is not None and values.shape.rank is None:
                    for local in _locals(values):
                        shape = _variable_shape(local).numpy()
                        local.assign(tf.zeros([self.slots] + [0] * (len(shape) - 1), local.dtype))

    def nbytes(self) -> int:
        """The device memory the ring holds now, every replica's copy."""
        if not self.created:
            return 0
        total = 0
        for values, dtype in zip(self._tensors, self._dtypes, strict=False):
            if values is None:
                continue
            for local in _locals(values):
                total += int(np.prod(_variable_shape(local).numpy())) * dtype.size
        return total

    def read(self, first: int, last: int) -> list[list[np.ndarray]]:
        """The flat batch of each step ``first``..``last`` (host step numbers,
        from 0), oldest first; shards of several replicas concatenated in
        replica order. Raises :class:`RingMiss` when one is not kept."""
        if not self.created:
            raise RingMiss(self.not_kept_why or "no batch ring on the device")
        if last - first + 1 > self.slots:
            raise RingMiss(f"{last - first + 1} steps asked, the ring keeps {self.slots}")
        wanted = list(range(first, last + 1))
        indexes = [local.numpy() for local in _locals(self._index)]  # one a replica
        for step in wanted:
            if int(indexes[0][step % self.slots, 0]) != step:
                raise RingMiss(f"the batch of step {step} is no longer kept")
        columns = [
            self._column(values, columns, indexes, wanted)
            for values, columns in zip(self._tensors, self._columns, strict=True)
        ]
        return [[column[i] for column in columns] for i in range(len(wanted))]

    def _column(self, values, columns: tuple[int, int], indexes: list, steps: list[int]) -> list:
        """One batch tensor of each of ``steps`` (``columns``: its shape's in the index)."""
        if values is None:
            raise RingMiss("a batch tensor that is not a number, or of unknown rank, is not kept")
        replicas = list(zip([v.numpy() for v in _locals(values)], indexes, strict=False))
        start, end = columns
        out = []
        for step in steps:
            slot = step % self.slots
            shards = [_shard(v[slot], index[slot, start:end], step) for v, index in replicas]
            out.append(
                shards[0] if len(shards) == 1 or shards[0].ndim == 0 else np.concatenate(shards)
            )
        return out


def _fixed_ring_problem(batch: list[tf.Tensor], slots: int, max_bytes: int) -> str | None:
    """Why a fixed-shape ring of ``batch`` cannot be kept, or None."""
    total = 0
    for t in batch:
        shape = t.shape
        if not (t.dtype.is_floating or t.dtype.is_integer or t.dtype.is_bool):
            continue  # not kept (see _tensor_ring)
        if shape.rank is None or any(d is None for d in shape[1:]):
            return "a batch tensor has a dynamic shape, which XLA cannot keep in a ring"
        rows = (shape[0] if shape[0] is not None else DEFAULT_ROWS) if shape.rank else 1
        total += slots * rows * int(np.prod(shape[1:] or [1])) * t.dtype.size
    if total > max_bytes:
        return (
            f"the ring of {slots} batches would take {total / 2**20:.1f} MB, "
            f"above rewind_memory_mb ({max_bytes / 2**20:.1f} MB)"
        )
    return None


def _write(values, index: tf.Tensor, t: tf.Tensor, growable: bool) -> None:
    rank = t.shape.rank or 0
    if rank == 0:
        _scatter(values, index, tf.reshape(t, [1]))
        return
    need = tf.shape(t)
    if growable:
        current = _variable_shape(values)[1:]
        target = tf.maximum(current, need)

        def grow() -> tf.Tensor:
            extra = tf.stack([tf.zeros_like(target), target - current], axis=1)
            padding = tf.concat([tf.zeros([1, 2], tf.int32), extra], 0)
            values.assign(tf.pad(values.read_value(), padding))
            return tf.constant(True)

        tf.cond(tf.reduce_any(need > current), grow, lambda: tf.constant(False))
        kept = t
    else:
        room = values.shape[1]
        kept = t[:room]
        target = tf.constant(list(values.shape[1:]), tf.int32)
    padding = tf.stack([tf.zeros_like(target), target - tf.shape(kept)], axis=1)
    _scatter(values, index, tf.expand_dims(tf.pad(kept, padding), 0))


def _scatter(var, index: tf.Tensor, updates: tf.Tensor) -> None:
    """``var[index] = updates`` in place, on this replica's own copy (an
    ``ON_READ`` variable has no scatter method; its handle in the replica
    context is the replica's component)."""
    gen_resource_variable_ops.resource_scatter_update(var.handle, index, updates)


def _variable_shape(var) -> tf.Tensor:
    return gen_resource_variable_ops.variable_shape(var.handle, out_type=tf.int32)


def _shard(value: np.ndarray, shape: np.ndarray, step: int) -> np.ndarray:
    """One replica's batch tensor of a slot, its padding cut off."""
    if value.ndim == 0:
        return value
    if any(int(n) > int(room) for n, room in zip(shape, value.shape, strict=False)):
        raise RingMiss(f"the batch of step {step} was larger than the ring's slot (truncated)")
    return value[tuple(slice(0, int(n)) for n in shape)].copy()


def _locals(var) -> list:
    values = getattr(var, "values", None)
    if isinstance(values, (tuple, list)) and values:
        return list(values)
    return [var]
