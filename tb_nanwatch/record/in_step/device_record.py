"""The device side of the record: what the compiled step keeps on the device.

A :class:`DeviceRecord` holds, in replica-local variables:

* a ring buffer of ``steps_per_execution`` rows, one per step (a sequence
  number, the statistics vector, each replica's first non-finite entry),
  written inside the step and read by the host once per execution
  (:meth:`DeviceRecord.fetch_rows`: one device-to-host transfer however many
  steps ran; with ``fit`` and one step per execution not even that, the row
  is handed over with the step's outputs, see :meth:`DeviceRecord.hand_over`);
* the batch of the last step that went non-finite (the batch stash);
* a copy of the trainable weights and of the optimizer's variables (slots,
  iterations) as they were before the step (``pre_step_weights``), every step
  or only in a step that may be non-finite;
* with rewind points on, the batches of the last steps
  (:class:`~tb_nanwatch.record.in_step.batch_ring.BatchRing`), read by the host only
  when a rewind point is saved.

The copies stop changing at the first incident, so the reproduction bundle
holds the exact state that produced it (:meth:`pre_step_state`,
:meth:`pre_step_optimizer`). With ``on_nonfinite="skip"``/``"rewind"``
(``restores``) they are taken at every step that may be non-finite instead,
and :mod:`~tb_nanwatch.record.in_step.step_undo` assigns them back after the update
of a step to be undone.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import gen_resource_variable_ops

from tb_nanwatch.evidence.options import WatchOptions
from tb_nanwatch.evidence.schema import Schema
from tb_nanwatch.record.in_step import step_undo, step_vector
from tb_nanwatch.record.in_step.batch_ring import BatchRing
from tb_nanwatch.record.in_step.taps import variable_path
from tb_nanwatch.record.in_step.unseen_variables import hidden_from_tf_function
from tb_nanwatch.record.stats.backend import StatsBackend

# Sequence numbers are stored in float32: keep them exactly representable.
SEQ_MODULO = 1 << 23


class DeviceRecord:
    """The ring buffer, batch stash and pre-step weight copies of one run."""

    def __init__(
        self, steps_per_execution: int = 1, pre_step_weights: str = WatchOptions.pre_step_weights
    ) -> None:
        # pre_step_weights: one of options.PRE_STEP_WEIGHTS (WatchOptions validates it).
        self.steps_per_execution = max(int(steps_per_execution), 1)
        self.pre_step_weights = pre_step_weights
        self._lock = threading.Lock()
        self._buffer: tf.Variable | None = None
        self._step_count: tf.Variable | None = None
        self._batch_stash: list | None = None
        self._batch_structure: Any = None
        # Why the batch is not kept whole (a sparse or ragged part), None when it is.
        self.batch_not_kept_why: str | None = None
        self._batch_of: tf.Variable | None = None
        self._pre_step_copies: list[tf.Variable] | None = None
        self._pre_step_copies_of: tf.Variable | None = None
        self._incident_captured: tf.Variable | None = None
        self._replicas = 1
        self.watched_weights: list | None = None  # the variables of the weight copies
        self._optimizer_copies: list[tf.Variable] | None = None
        self.watched_optimizer_variables: list = []  # the variables of those copies
        self.ring: BatchRing | None = None  # see configure_rewind
        # Whether a non-finite step is undone ("skip"/"rewind", set by the
        # session before the step is traced): see record/in_step/step_undo.py.
        self.restores = False
        self._last_seq = 0
        self._handed_row: tf.Tensor | None = None
        # The graph being traced when the variables were created (None
        # until then, or when they were created eagerly).
        self.created_in_graph = None

    def undo_nonfinite_steps(self) -> None:
        """The step undoes a non-finite step (see ``restores``); before it is traced."""
        self.restores = True

    def configure_rewind(self, slots: int, max_bytes: int) -> None:
        """Keeps the batches of the last ``slots`` steps on the device (for
        rewind points), within ``max_bytes``; before the step is traced (a
        ring made by an earlier trace is kept)."""
        if self.ring is None and slots > 0:
            self.ring = BatchRing(slots, max_bytes)

    @property
    def batch_structure(self) -> Any:
        """The nest structure of the step's batch (None for a non-tensor leaf)."""
        return self._batch_structure

    @property
    def row_width(self) -> int:
        """Width of one buffer row (0 before the buffer exists)."""
        return int(self._buffer.shape[1]) if self._buffer is not None else 0

    # -- in the compiled step ------------------------------------------------------

    def ensure(
        self, vector_size: int, data, weights: list, stats: StatsBackend, retrace: bool = True
    ) -> list[tf.Tensor]:
        """Creates the variables on the first trace (eagerly); the flat batch.

        Every variable is replica-local (``ON_READ``): each replica writes its
        own copy inside the step with no cross-replica traffic, and the host
        reads them once per execution. The buffer rows are identical on every
        replica (the statistics are reduced before they are written); the
        batch stash holds each replica's own shard.

        ``retrace``: whether the tf.function being traced is to see the
        variables created, so that it traces the step again and never runs
        this trace (see ``StepRecorder._trace_never_runs``); otherwise they are
        kept from it and this trace is the one that runs. ``stats``: the step's
        statistics backend (whether the copies may start empty).
        """
        batch = [t for t in tf.nest.flatten(data) if isinstance(t, tf.Tensor)]
        self._batch_structure = tf.nest.map_structure(
            lambda t: 0 if isinstance(t, tf.Tensor) else None, data
        )
        self.batch_not_kept_why = _not_kept_why(data)
        replicas = step_vector.replicas_in_sync()
        width = 1 + vector_size + replicas
        with self._lock:
            if self._buffer is not None:
                if self._buffer.shape[1] != width:
                    raise RuntimeError(
                        "the watched model changed its structure between traces; "
                        "create a new NanWatch for the new model"
                    )
                return batch
            if not tf.executing_eagerly():
                self.created_in_graph = tf.compat.v1.get_default_graph()
            with tf.init_scope(), hidden_from_tf_function(not retrace):
                self._create(width, batch, weights, stats.growable_copies)
                self._replicas = replicas
        return batch

    def _create(self, width: int, batch: list[tf.Tensor], weights: list, growable: bool) -> None:
        """The variables. The batch stash and the weight copies hold nothing
        until a step may be non-finite (``growable``; under XLA they are
        allocated at their full size)."""
        rows = self.steps_per_execution
        self._buffer = _local_variable(tf.zeros([rows, width], tf.float32), "nanwatch_buffer")
        self._step_count = _local_variable(tf.constant(0, tf.int64), "nanwatch_counter")
        self._batch_of = _local_variable(tf.constant(0, tf.int64), "nanwatch_batch_of")
        self._incident_captured = _local_variable(tf.constant(False), "nanwatch_incident_captured")
        self._batch_stash = [_stash_variable(t, growable) for t in batch]
        self.watched_weights = list(weights)
        if self.ring is not None and self.batch_not_kept_why is not None:
            self.ring.keep_none(self.batch_not_kept_why)
        elif self.ring is not None:
            self.ring.create(batch, growable, _local_variable)
        if self.pre_step_weights != "off":
            self._pre_step_copies = [_weight_copy(v, growable) for v in weights]
            self._pre_step_copies_of = _local_variable(
                tf.constant(0, tf.int64), "nanwatch_pre_step_weights_of"
            )

    def copy_pre_step_weights(
        self,
        weights: list,
        maybe_nonfinite,
        gradients: list,
        stats: StatsBackend,
        optimizer_variables: list = (),
    ) -> list:
        """Copies the weights and ``optimizer_variables`` (the optimizer's
        slots and iterations, when it is built) before the update: every
        step, or ``on_suspect`` when ``maybe_nonfinite()`` (a scalar bool
        tensor) is true.

        Returns ``gradients`` (the weights', ``None`` where a weight has none)
        for the update to apply: under XLA the update then waits for the copy
        (see ``XlaStats.rare_assign``). Values are unchanged.
        """
        if self._pre_step_copies is None:
            return gradients
        self.ensure_optimizer_copies(optimizer_variables, stats)
        # The copies are frozen at the first incident (see write_row), so with
        # steps_per_execution > 1 the later steps of the same execution do not
        # overwrite them.
        this_step = self._step_count.read_value() + 1
        capturing = tf.logical_not(self._incident_captured.read_value())

        def copy() -> None:
            for copy_var, v in zip(self._pre_step_copies, weights, strict=False):
                copy_var.assign(v)
            for copy_var, v in zip(
                self._optimizer_copies or [], self.watched_optimizer_variables, strict=False
            ):
                copy_var.assign(v)
            self._pre_step_copies_of.assign(this_step)

        if self.restores:
            # Every suspect step, also after the incident: it may be undone.
            every = self.pre_step_weights == "every_step"
            copying = tf.constant(True) if every else step_undo.agreed(maybe_nonfinite())
        elif self.pre_step_weights == "every_step":
            copying = capturing
        else:
            copying = tf.logical_and(maybe_nonfinite(), capturing)
        # An IndexedSlices' dense_shape stays out: XLA needs it as a constant.
        tensors = [
            (g.values, g.indices) if isinstance(g, tf.IndexedSlices) else (g,) for g in gradients
        ]
        present = [t for parts in tensors for t in parts if t is not None]
        carried = iter(stats.rare_assign(copying, copy, present))
        out = []
        for g in gradients:
            if g is None:
                out.append(None)
            elif isinstance(g, tf.IndexedSlices):
                out.append(tf.IndexedSlices(next(carried), next(carried), g.dense_shape))
            else:
                out.append(next(carried))
        return out

    def copied_this_step(self) -> tf.Tensor:
        """Whether the step being written copied the weights (before
        :meth:`write_row` counts it), in the graph."""
        if self._pre_step_copies_of is None:
            return tf.constant(False)
        return tf.equal(self._pre_step_copies_of.read_value(), self._step_count.read_value() + 1)

    def pre_step_pairs(self) -> list[tuple[Any, tf.Variable]]:
        """(variable, its pre-step copy) for each weight and optimizer variable copied."""
        pairs = list(zip(self.watched_weights or [], self._pre_step_copies or [], strict=False))
        optimizer = zip(
            self.watched_optimizer_variables, self._optimizer_copies or [], strict=False
        )
        return pairs + list(optimizer)

    def ensure_optimizer_copies(self, variables: list, stats: StatsBackend) -> None:
        """Creates the copies of the optimizer's ``variables`` once it is built:
        in the first trace, eagerly (hidden from the tf.function when that
        trace is the one that runs; a later trace may not create variables).
        Without them the bundle holds no optimizer state."""
        with self._lock:
            if self._optimizer_copies is not None or not variables:
                return
            try:
                with tf.init_scope(), hidden_from_tf_function():
                    copies = [_weight_copy(v, stats.growable_copies) for v in variables]
            except ValueError:  # a later trace of a tf.function may not create any
                copies, variables = [], []
            self.watched_optimizer_variables = list(variables)
            self._optimizer_copies = copies

    def start_over(self) -> None:
        """Back to the state of a new run, for a compiled step that a later
        ``fit`` reuses: no step counted, nothing captured, an empty buffer."""
        kept = (self._buffer, self._step_count, self._batch_of, self._incident_captured)
        for var in (*kept, self._pre_step_copies_of):
            if var is not None:
                for local in _locals(var):
                    local.assign(tf.zeros(local.shape, local.dtype))
        if self.ring is not None:
            self.ring.start_over()
        self._last_seq = 0
        self._handed_row = None

    def write_row(
        self,
        schema: Schema,
        vector: tf.Tensor,
        replica_first_nonfinite,
        batch: list,
        stats: StatsBackend,
    ) -> tf.Tensor:
        """Writes the step's row into the ring buffer; stashes a non-finite
        step's batch (still at hand after the update: a healthy step copies
        nothing). Returns the row."""
        nonfinite, incident = _nonfinite_and_incident(schema, vector)
        count = self._step_count.assign_add(1)
        capturing = tf.logical_not(self._incident_captured.read_value())

        def keep_batch() -> None:
            for slot, t in zip(self._batch_stash, batch, strict=False):
                _stash(slot, t)
            self._batch_of.assign(count)

        stats.rare_assign(tf.logical_and(nonfinite, capturing), keep_batch)
        if self.ring is not None:
            self.ring.write(count, batch, stats)
        self._incident_captured.assign(tf.logical_or(tf.logical_not(capturing), incident))
        seq = tf.cast(count % SEQ_MODULO, tf.float32)
        first = tf.reshape(replica_first_nonfinite, [-1])
        row = tf.concat([tf.reshape(seq, [1]), vector, first], 0)
        if self.steps_per_execution == 1:
            self._buffer.assign(tf.reshape(row, [1, -1]))
            return row
        slot = tf.cast((count - 1) % self.steps_per_execution, tf.int32)
        # assign(tensor_scatter_nd_update(...)) rather than scatter_nd_update:
        # distributed variables implement only assign.
        self._buffer.assign(
            tf.tensor_scatter_nd_update(
                self._buffer.read_value(), tf.reshape(slot, [1, 1]), tf.reshape(row, [1, -1])
            )
        )
        return row

    # -- on the host -----------------------------------------------------------------

    def hand_over(self, row: tf.Tensor) -> None:
        """Takes the row the instrumented Keras train function returned (one
        step, one replica), so that :meth:`fetch_rows` needs no read."""
        self._handed_row = row

    def fetch_rows(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """The steps written since the last fetch, oldest first (one transfer).

        Each item is ``(stats vector, replica_first_nonfinite)``: item ``r``
        of the latter is the ordinal of replica ``r``'s first non-finite
        diagnosed entry as that replica saw it before the cross-replica
        reduction (the number of diagnosed entries when it had none); with
        one replica it is not computed (-1): the vector itself says it.
        """
        if self._buffer is None:
            return []
        handed, self._handed_row = self._handed_row, None
        if handed is not None:
            # Already a host-side output of the step, and always its one new
            # step (a row is handed over only with one step an execution).
            row = handed._numpy()
            self._last_seq = int(row[0])
            return [self._split_row(row)]
        rows = _read(_first_local(self._buffer))  # the one read of the device buffer
        seqs = rows[:, 0].astype(np.int64)
        ahead = (seqs - self._last_seq) % SEQ_MODULO
        fresh = sorted((a, i) for i, a in enumerate(ahead) if 0 < a <= self.steps_per_execution)
        if fresh:
            self._last_seq = int(seqs[fresh[-1][1]])
        return [self._split_row(rows[i]) for _, i in fresh]

    def _split_row(self, row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A row ``[seq, stats vector..., one entry a replica...]`` as
        ``(stats vector, replica_first_nonfinite)``."""
        size = row.shape[0] - 1 - self._replicas
        return row[1 : 1 + size], row[1 + size :]

    def pre_step_state(self) -> tuple[list[np.ndarray], list[np.ndarray], Any]:
        """(weights before the stashed step or [], flat batch, batch structure).

        Under a distribution strategy the batch is this process's replicas'
        shards, concatenated in replica order.
        """
        weights: list[np.ndarray] = []
        if self._pre_step_copies:
            # A replica-local copy; take the replica that copied last (with
            # pre_step_weights="on_suspect" only a replica that may be
            # non-finite copies).
            counts = [int(c.numpy()) for c in _locals(self._pre_step_copies_of)]
            best = int(np.argmax(counts))
            if counts[best] > 0:  # else never copied (a growable copy is still empty)
                weights = [_locals(v)[best].numpy() for v in self._pre_step_copies]
        batch = [_unstash(slot) for slot in self._batch_stash] if self._batch_stash else []
        return weights, batch, self._batch_structure

    def pre_step_optimizer(self) -> dict[str, np.ndarray]:
        """The optimizer's variables (slots, iterations) from before the
        stashed step, by path, copied with the weights; {} when not copied."""
        if not self._optimizer_copies:
            return {}
        counts = [int(c.numpy()) for c in _locals(self._pre_step_copies_of)]
        best = int(np.argmax(counts))
        if counts[best] <= 0:
            return {}
        values = [_locals(v)[best].numpy() for v in self._optimizer_copies]
        if any(v.size == 0 and v.ndim == 1 for v in values):
            return {}  # a growable copy the copying step did not fill (created after it)
        paths = [variable_path(v) for v in self.watched_optimizer_variables]
        return dict(zip(paths, values, strict=False))

    def stashed_steps(self) -> tuple[int | None, int | None]:
        """(step of the stashed batch, step before which the weights were
        copied), counted from 0 as the host counts steps; None if none yet."""

        def step(var):
            if var is None:
                return None
            count = max(int(c.numpy()) for c in _locals(var))
            return count - 1 if count > 0 else None

        return step(self._batch_of), step(self._pre_step_copies_of)


def _nonfinite_and_incident(schema: Schema, vector: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """(any diagnosed entry non-finite, the step is an incident), in the graph.

    The same rule as the journal's (the incident rule's home is diagnosis.py):
    a non-zero nan or inf count in any diagnosed entry, in a step the loss
    scaler did not skip. (Skip streaks and the loss-scale floor, which need
    the run's history, are judged on the host only.)
    """
    diagnosed = [e for e in schema.entries if e.kind != "header"]
    counts = schema.indices(diagnosed, "nan") + schema.indices(diagnosed, "inf")
    nonfinite = tf.reduce_sum(tf.gather(vector, tf.constant(sorted(counts), tf.int32))) > 0
    skipped = vector[schema.header_index("skipped")] > 0
    return nonfinite, tf.logical_and(nonfinite, tf.logical_not(skipped))


def _local_variable(initial, name: str, shape=None) -> tf.Variable:
    """A non-trainable variable each replica writes on its own (``ON_READ``).

    Without a distribution strategy it is a plain variable. ``shape``:
    ``tf.TensorShape(None)`` for one that may be assigned any shape.
    """
    return tf.Variable(
        initial,
        trainable=False,
        name=name,
        shape=shape,
        synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
    )


def _locals(var) -> list:
    """The per-replica components of ``var`` held by this process."""
    values = getattr(var, "values", None)
    if isinstance(values, (tuple, list)) and values:
        return list(values)
    return [var]


def _first_local(var):
    return _locals(var)[0]


def _read(var) -> np.ndarray:
    """The variable's value on the host: one raw read op (``var.numpy()``
    costs several times more Python around the same transfer)."""
    return gen_resource_variable_ops.read_variable_op(var.handle, var.dtype)._numpy()


def _weight_copy(v, growable: bool) -> tf.Variable:
    if growable:
        empty = tf.zeros([0], v.dtype)
        return _local_variable(empty, "nanwatch_pre_step_weights", tf.TensorShape(None))
    return _local_variable(_unwritten(v.shape, v.dtype), "nanwatch_pre_step_weights")


def _unwritten(shape, dtype: tf.DType) -> tf.Tensor:
    """A tensor of ``shape`` whose memory is never written (not zeroed): the
    kernel then touches none of its pages, so a full-size buffer under XLA,
    read only after a step wrote it, holds no resident memory until then."""
    dtype = tf.as_dtype(dtype)
    if len(shape) and (dtype.is_floating or dtype.is_integer or dtype.is_bool):
        return tf.raw_ops.Empty(shape=list(shape), dtype=dtype, init=False)
    return tf.zeros(shape, dtype)


# Under XLA the batch of the current step is kept in a fixed-shape variable
# (XLA cannot assign a new shape to a variable): rows beyond the first traced
# batch size are not kept; a smaller batch is padded and its length kept in a
# companion variable. Elsewhere the variable starts empty and takes the
# batch's shape.
_DEFAULT_ROWS = 1024


def _stash_variable(t: tf.Tensor, growable: bool) -> tuple[tf.Variable, tf.Variable] | None:
    shape = t.shape
    if growable and shape.rank:
        stash = _local_variable(
            tf.zeros([0] * shape.rank, t.dtype), "nanwatch_batch", tf.TensorShape(None)
        )
    elif shape.rank is None or not all(d is not None for d in shape[1:]):
        return None  # dynamic feature dims: not kept
    else:
        rows = shape[0] if shape.rank and shape[0] is not None else _DEFAULT_ROWS
        full = [rows] + list(shape[1:]) if shape.rank else []
        stash = _local_variable(_unwritten(full, t.dtype), "nanwatch_batch")
    return stash, _local_variable(tf.constant(0, tf.int32), "nanwatch_batch_rows")


def _stash(slot, t: tf.Tensor) -> None:
    if slot is None:
        return
    var, rows = slot
    if t.shape.rank == 0:
        var.assign(t)
        return
    if var.shape.rank is None:  # growable: the whole batch, as it is
        var.assign(t)
        rows.assign(tf.shape(t)[0])
        return
    room = var.shape[0]
    kept = t[:room]
    n = tf.shape(kept)[0]
    padding = [[0, room - n]] + [[0, 0]] * (t.shape.rank - 1)
    var.assign(tf.pad(kept, padding))
    rows.assign(n)


def _unstash(slot) -> np.ndarray | None:
    if slot is None:
        return None
    var, rows = slot
    shards = []
    for value, n in zip(_locals(var), _locals(rows), strict=False):
        value = value.numpy()
        if value.ndim == 0:
            return value
        shards.append(value[: int(n.numpy())])
    return shards[0] if len(shards) == 1 else np.concatenate(shards, 0)


def _not_kept_why(data) -> str | None:
    """Why a batch cannot be kept whole: its sparse or ragged parts (only
    dense tensors are stashed), None when every part is a dense tensor."""
    leaves = tf.nest.flatten(data)
    kinds = sorted({type(t).__name__ for t in leaves if not isinstance(t, (tf.Tensor, type(None)))})
    if not kinds:
        return None
    return f"the batch holds a {' and a '.join(kinds)}, which is not kept (dense tensors only)"
