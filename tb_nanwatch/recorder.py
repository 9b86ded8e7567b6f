"""The in-graph half of NanWatch: one train step, instrumented.

:class:`StepRecorder` computes the statistics of every phase inside the
compiled step and writes them into a small on-device ring buffer (one row per
step, ``steps_per_execution`` rows). The host reads the buffer once per
execution: one device-to-host transfer, however many steps ran.

It also keeps, on the device, the batch of the current step and (by default)
a copy of the trainable weights as they were *before* the update, so that a
reproduction bundle can hold the exact state that produced the incident.
"""

from __future__ import annotations

import dataclasses
import re
import threading
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.ops import gen_resource_variable_ops

from tb_nanwatch import step_stats
from tb_nanwatch.schema import Schema
from tb_nanwatch.taps import LayerTaps, StepTrace

# Sequence numbers are stored in float32: keep them exactly representable.
SEQ_MODULO = 1 << 23

PRE_STEP_WEIGHTS = ("every_step", "on_suspect", "off")

# The key under which the Keras train step also returns the step's row, so that
# fit hands it over with the step's outputs (see StepRecorder.hand_over).
ROW_KEY = "_nanwatch_row"

# Every op the statistics add to the step graph is created under this scope.
STATS_SCOPE = "nanwatch_stats"
# The op types that read a watched tensor directly (a reduction, or the cast
# before one); each depends on that one tensor only.
_READER_OPS = frozenset({"L2Loss", "Sum", "Min", "Max", "Cast", "Switch"})


def _names(
    value: Any, prefix: str, preferred: list[str] | None = None
) -> list[tuple[str, tf.Tensor]]:
    """Flattens inputs or targets into (name, tensor) pairs."""
    if isinstance(value, dict):
        return [(f"{prefix}{k}", value[k]) for k in sorted(value) if value[k] is not None]
    flat = [t for t in tf.nest.flatten(value) if t is not None]
    if preferred and len(preferred) == len(flat):
        return [(f"{prefix}{n}", t) for n, t in zip(preferred, flat, strict=False)]
    if len(flat) == 1:
        return [(prefix.rstrip("/:") or "input", flat[0])]
    return [(f"{prefix}{i}", t) for i, t in enumerate(flat)]


def variable_owners(model: keras.Model, taps: LayerTaps) -> dict[int, str]:
    """Maps ``id(variable)`` to the path of the watched layer that owns it."""
    owners: dict[int, str] = {}
    for layer, path in taps._layers:
        for v in getattr(layer, "_trainable_variables", []):
            owners.setdefault(id(v), path)
    return owners


@dataclasses.dataclass
class PendingStep:
    """What :meth:`StepRecorder.before_update` hands to ``after_update``."""

    builder: step_stats.StatsBuilder
    batch: list[tf.Tensor]
    gradients: list  # every gradient the statistics read (see _readers_first)


class StepRecorder:
    """Instruments the train step of ``model`` and buffers its statistics."""

    def __init__(
        self,
        model: keras.Model,
        steps_per_execution: int = 1,
        pre_step_weights: str = "on_suspect",
    ) -> None:
        if pre_step_weights not in PRE_STEP_WEIGHTS:
            raise ValueError(
                f"pre_step_weights must be one of {PRE_STEP_WEIGHTS}, got {pre_step_weights!r}"
            )
        self.model = model
        self.capacity = max(int(steps_per_execution), 1)
        self.pre_step_weights = pre_step_weights
        self.taps = LayerTaps(model)
        self.schema: Schema | None = None
        self._lock = threading.Lock()
        self._buffer: tf.Variable | None = None
        self._counter: tf.Variable | None = None
        self._batch_vars: list[tf.Variable] | None = None
        self._batch_structure: Any = None
        self._shadows: list[tf.Variable] | None = None
        self._shadow_count: tf.Variable | None = None
        self._stash_count: tf.Variable | None = None
        self._frozen: tf.Variable | None = None
        self._replicas = 1
        self.watched_weights: list | None = None  # the variables of the stashed weights
        self._last_seq = 0
        self._handed_row: tf.Tensor | None = None
        self.trace_error: Exception | None = None
        self.tapped_layers = [path for _, path in self.taps._layers]
        # Watched layers never seen in the step graph (see ``not_watched``).
        self.unwatched_layers: list[str] | None = None
        self.strategy = getattr(model, "distribute_strategy", None) or tf.distribute.get_strategy()

    # -- setup -------------------------------------------------------------

    def install(self) -> None:
        self.taps.install()

    def uninstall(self) -> None:
        self.taps.uninstall()

    def _ensure_buffers(self, size: int, batch: list[tf.Tensor], weights: list) -> None:
        """Creates the ring buffer and batch stash on first trace (eagerly).

        Every variable is replica-local (``ON_READ``): each replica writes its
        own copy inside the step with no cross-replica traffic, and the host
        reads them once per execution. The buffer rows are identical on every
        replica (the statistics are reduced before they are written); the
        batch stash holds each replica's own shard.
        """
        replicas = step_stats.replicas_in_sync()
        width = 1 + size + replicas
        with self._lock:
            if self._buffer is not None:
                if self._buffer.shape[1] != width:
                    raise RuntimeError(
                        "the watched model changed its structure between traces; "
                        "create a new NanWatch for the new model"
                    )
                return
            with tf.init_scope():
                self._replicas = replicas
                self._buffer = _local_variable(
                    tf.zeros([self.capacity, width], tf.float32), "nanwatch_buffer"
                )
                self._counter = _local_variable(tf.constant(0, tf.int64), "nanwatch_counter")
                self._stash_count = _local_variable(tf.constant(0, tf.int64), "nanwatch_batch_of")
                self._frozen = _local_variable(tf.constant(False), "nanwatch_captured")
                self._batch_vars = [_stash_variable(t) for t in batch]
                self.watched_weights = list(weights)
                if self.pre_step_weights != "off":
                    self._shadows = [
                        _local_variable(tf.zeros(v.shape, v.dtype), "nanwatch_pre_step")
                        for v in weights
                    ]
                    self._shadow_count = _local_variable(
                        tf.constant(0, tf.int64), "nanwatch_pre_step_of"
                    )

    # -- the instrumented Keras train step ----------------------------------

    def keras_train_step(self, data):
        """A drop-in for ``keras.Model.train_step`` (TensorFlow backend)."""
        from keras.src.losses import loss as loss_module
        from keras.src.trainers.data_adapters import data_adapter_utils

        model = self.model
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            with self.taps.recording(tape) as trace:
                if model._call_has_training_arg:
                    y_pred = model(x, training=True)
                else:
                    y_pred = model(x)
                self.taps.install_loss_taps(y, y_pred)
                loss = model._compute_loss(
                    x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
                )
            model._loss_tracker.update_state(
                loss_module.unscale_loss_for_distribution(loss),
                sample_weight=tf.shape(next(i for i in tf.nest.flatten(x) if i is not None))[0],
            )
            scaled_loss = model.optimizer.scale_loss(loss) if model.optimizer is not None else loss
        weights = model.trainable_weights
        if weights:
            sources = list(weights) + self.watched_tensors(trace)
            all_grads = tape.gradient(scaled_loss, sources)
            grads = all_grads[: len(weights)]
        else:
            all_grads, grads = [], []
        # A failure in our own statistics must not change or break the step:
        # it is remembered (the callback warns and stops watching) and the
        # step goes on exactly as Keras' own would.
        pending, row = None, None
        try:
            pending = self.before_update(
                trace, x, y, y_pred, loss, weights, all_grads, model.optimizer, data, model
            )
        except Exception as error:  # noqa: BLE001
            self.trace_error = error
        if weights:
            model.optimizer.apply_gradients(zip(grads, weights, strict=False))
        if pending is not None:
            try:
                row = self.after_update(pending, weights, model)
            except Exception as error:  # noqa: BLE001
                self.trace_error = error
        logs = model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        if row is not None and self.capacity == 1 and step_stats.replicas_in_sync() == 1:
            logs = {**logs, ROW_KEY: row}
        return logs

    @staticmethod
    def watched_tensors(trace: StepTrace) -> list[tf.Tensor]:
        out = []
        for call in trace.calls:
            out.extend(call.outputs)
            out.extend(call.inputs)
        return out

    # -- statistics ------------------------------------------------------------

    def before_update(
        self,
        trace: StepTrace,
        x,
        y,
        y_pred,
        loss,
        weights: list,
        all_grads: list,
        optimizer,
        data,
        model: keras.Model,
    ) -> PendingStep:
        """Adds header, input, forward, loss and backward entries; copies the
        weights before the update (see ``pre_step_weights``)."""
        with tf.name_scope(STATS_SCOPE):
            return self._before_update(
                trace, x, y, y_pred, loss, weights, all_grads, optimizer, data, model
            )

    def _before_update(
        self, trace, x, y, y_pred, loss, weights, all_grads, optimizer, data, model
    ) -> PendingStep:
        grads = list(all_grads[: len(weights)])
        watched = list(all_grads[len(weights) :])
        if self.unwatched_layers is None:
            seen = {call.path.split("#")[0] for call in trace.calls}
            self.unwatched_layers = [p for p in self.tapped_layers if p not in seen]
        builder = step_stats.StatsBuilder()
        is_lso = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        if is_lso:
            scale = optimizer.dynamic_scale if optimizer.built else optimizer.initial_scale
            scale = tf.cast(scale, tf.float32)
        else:
            scale = tf.constant(1.0)
        grad_fields = [step_stats.gradient_fields([g]) for g in grads]
        grad_sumsq = tf.add_n([f["norm"] for f in grad_fields]) if grad_fields else tf.constant(0.0)
        skipped = _skipped_by_loss_scaler(grad_fields, grad_sumsq) if is_lso else tf.constant(0.0)
        lr = optimizer.learning_rate if optimizer is not None else 0.0
        iterations = optimizer.iterations if optimizer is not None else 0
        builder.add(
            "header",
            "header",
            None,
            "step header",
            {
                "loss": tf.cast(loss, tf.float32),
                "grad_norm": grad_sumsq / (scale * scale),
                "lr": tf.cast(lr, tf.float32),
                "loss_scale": scale if is_lso else tf.constant(0.0),
                "skipped": skipped,
                "iterations": tf.cast(iterations, tf.float32),
            },
        )
        input_names = [getattr(t, "name", None) for t in getattr(model, "inputs", None) or []]
        input_names = [n.split(":")[0] for n in input_names if n]
        for name, t in _names(x, "", input_names):
            builder.add(
                "input", "input", name, f"model input {name}", step_stats.tensor_fields([t])
            )
        if y is not None:
            for name, t in _names(y, "target/"):
                builder.add("input", "input", name, f"target {name}", step_stats.tensor_fields([t]))
        for call in trace.calls:
            builder.add(
                "forward",
                "activation",
                call.path,
                f"output of {call.path}",
                step_stats.tensor_fields(call.outputs),
            )
        output_names = list(getattr(model, "output_names", None) or [])
        flat_pred = [t for t in tf.nest.flatten(y_pred) if t is not None]
        if len(output_names) != len(flat_pred):
            output_names = [f"output_{i}" for i in range(len(flat_pred))]
        for name, t in zip(output_names, flat_pred, strict=False):
            logits = getattr(t, "_keras_logits", None)
            what = "logits (before the final activation)" if logits is not None else "output"
            builder.add(
                "forward",
                "logits",
                name,
                f"{what} of model output {name}",
                step_stats.tensor_fields([logits if logits is not None else t]),
            )
        for name, value in trace.losses:
            builder.add("loss", "loss", name, f"loss of output {name}", _loss_fields(value))
        builder.add("loss", "loss", None, "total loss", _loss_fields(loss))

        owners = variable_owners(model, self.taps)
        grads_by_owner: dict[str | None, list[tuple[Any, dict]]] = {}
        for v, fields in zip(weights, grad_fields, strict=False):
            grads_by_owner.setdefault(owners.get(id(v)), []).append((v, fields))
        position = 0
        slots = []
        for call in trace.calls:
            n_out, n_in = len(call.outputs), len(call.inputs)
            slots.append(
                (
                    call,
                    watched[position : position + n_out],
                    watched[position + n_out : position + n_out + n_in],
                )
            )
            position += n_out + n_in
        for call, out_grads, in_grads in reversed(slots):
            builder.add(
                "backward",
                "grad_out",
                call.path,
                f"gradient w.r.t. output of {call.path}",
                step_stats.gradient_fields(out_grads),
            )
            if "#" not in call.path:
                for v, fields in grads_by_owner.pop(call.path, []):
                    builder.add("backward", "grad_var", call.path, f"gradient of {v.path}", fields)
            if in_grads:  # none when the input is not computed from any weight
                builder.add(
                    "backward",
                    "grad_in",
                    call.path,
                    f"gradient w.r.t. input of {call.path}",
                    step_stats.gradient_fields(in_grads),
                )
        for owner, items in grads_by_owner.items():
            for v, fields in items:
                builder.add("backward", "grad_var", owner, f"gradient of {v.path}", fields)

        flat_batch = [t for t in tf.nest.flatten(data) if isinstance(t, tf.Tensor)]
        self._batch_structure = tf.nest.map_structure(lambda t: None if t is None else 0, data)
        # The buffer's width is known only now; create it before any use.
        self._ensure_buffers(_schema_size_after_update(builder, weights), flat_batch, weights)
        self._copy_weights(builder, weights)
        return PendingStep(builder, flat_batch, [g for g in all_grads if g is not None])

    def _copy_weights(self, builder: step_stats.StatsBuilder, weights: list) -> None:
        """Copies the weights before the update: every step, or on_suspect."""
        if self._shadows is None:
            return
        # The copies are frozen at the first step that the journal will call
        # an incident (see after_update), so with steps_per_execution > 1 the
        # later steps of the same execution do not overwrite them.
        this_step = self._counter.read_value() + 1
        capturing = tf.logical_not(self._frozen.read_value())

        def copy():
            for shadow, v in zip(self._shadows, weights, strict=False):
                shadow.assign(v)
            self._shadow_count.assign(this_step)
            return tf.constant(True)

        if self.pre_step_weights == "every_step":
            tf.cond(capturing, copy, lambda: tf.constant(False))
        else:
            suspect = builder.suspect()
            step_stats.rare_cond(
                tf.logical_and(suspect, capturing), copy, lambda: tf.constant(False)
            )

    def after_update(self, pending: PendingStep, weights: list, model) -> tf.Tensor:
        """Adds the update entries and writes the step's row into the buffer.

        The batch is kept only for a step that went non-finite (it is still
        at hand after the update), so a healthy step copies nothing.
        """
        with tf.name_scope(STATS_SCOPE):
            row = self._after_update(pending, weights, model)
        _readers_first(pending.gradients)
        return row

    def _after_update(self, pending: PendingStep, weights: list, model) -> tf.Tensor:
        builder = pending.builder
        owners = variable_owners(model, self.taps)
        for v in weights:
            value = tf.convert_to_tensor(v)
            builder.add(
                "update",
                "weights",
                owners.get(id(v)),
                f"{v.path} after the update",
                {"nan": step_stats.count_nan(value), "inf": step_stats.count_inf(value)},
            )
        vector = builder.vector()
        if self.schema is None:
            self.schema = builder.schema
        # Freeze the stash once a step is what the journal will call an
        # incident: non-finite somewhere, and not a step the loss scaler skipped.
        schema = builder.schema
        counts = [e.offset + i for e in schema.entries if e.kind != "header" for i in (0, 1)]
        bad = tf.reduce_sum(tf.gather(vector, tf.constant(counts, tf.int32))) > 0
        skipped = vector[schema.header().offset + 4] > 0
        incident = tf.logical_and(bad, tf.logical_not(skipped))
        count = self._counter.assign_add(1)
        capturing = tf.logical_not(self._frozen.read_value())

        def keep_batch():
            for var, t in zip(self._batch_vars, pending.batch, strict=False):
                _stash(var, t)
            self._stash_count.assign(count)
            return tf.constant(True)

        step_stats.rare_cond(tf.logical_and(bad, capturing), keep_batch, lambda: tf.constant(False))
        self._frozen.assign(tf.logical_or(tf.logical_not(capturing), incident))
        slot = tf.cast((count - 1) % self.capacity, tf.int32)
        seq = tf.cast(count % SEQ_MODULO, tf.float32)
        first_bad = tf.reshape(builder.replica_first_bad, [-1])
        row = tf.concat([tf.reshape(seq, [1]), vector, first_bad], 0)
        # assign(tensor_scatter_nd_update(...)) rather than scatter_nd_update:
        # distributed variables implement only assign.
        self._buffer.assign(
            tf.tensor_scatter_nd_update(
                self._buffer.read_value(), tf.reshape(slot, [1, 1]), tf.reshape(row, [1, -1])
            )
        )
        return row

    # -- host side ---------------------------------------------------------------

    def fetch_rows(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """The steps written since the last fetch, oldest first (one transfer).

        Each item is ``(stats vector, first_bad)``: ``first_bad[r]`` is the
        ordinal of replica ``r``'s first non-finite diagnosed entry as that
        replica saw it before the cross-replica reduction (the number of
        diagnosed entries when it had none).
        """
        if self._buffer is None:
            return []
        handed, self._handed_row = self._handed_row, None
        # The row fit handed over is already a host-side output of the step;
        # otherwise one read of the device buffer.
        rows = handed._numpy()[None, :] if handed is not None else _read(_first_local(self._buffer))
        seqs = rows[:, 0].astype(np.int64)
        ahead = (seqs - self._last_seq) % SEQ_MODULO
        fresh = [(a, i) for i, a in enumerate(ahead) if 0 < a <= self.capacity]
        fresh.sort()
        if fresh:
            self._last_seq = int(seqs[fresh[-1][1]])
        size = rows.shape[1] - 1 - self._replicas
        return [(rows[i, 1 : 1 + size], rows[i, 1 + size :]) for _, i in fresh]

    def hand_over(self, row: tf.Tensor) -> None:
        """Takes the row a Keras train function returned under ``ROW_KEY``
        (one step, one replica), so that ``fetch_rows`` needs no read."""
        self._handed_row = row

    def fetch(self) -> list[np.ndarray]:
        """The stats vectors written since the last fetch, oldest first."""
        return [vector for vector, _ in self.fetch_rows()]

    def pre_step_state(self) -> tuple[list[np.ndarray], list[np.ndarray], Any]:
        """(weights before the stashed step or [], flat batch, batch structure).

        Under a distribution strategy the batch is this process's replicas'
        shards, concatenated in replica order.
        """
        weights: list[np.ndarray] = []
        if self._shadows:
            # A replica-local copy; take the replica that copied last (with
            # pre_step_weights="on_suspect" only a suspect replica copies).
            counts = [int(c.numpy()) for c in _locals(self._shadow_count)]
            best = int(np.argmax(counts))
            weights = [_locals(v)[best].numpy() for v in self._shadows]
        batch = [_unstash(v) for v in self._batch_vars] if self._batch_vars else []
        return weights, batch, self._batch_structure

    def stashed_steps(self) -> tuple[int | None, int | None]:
        """(step of the stashed batch, step before which the weights were
        copied), counted from 0 as the host counts steps; None if none yet."""

        def step(var):
            if var is None:
                return None
            count = max(int(c.numpy()) for c in _locals(var))
            return count - 1 if count > 0 else None

        return step(self._stash_count), step(self._shadow_count)

    def not_watched(self) -> list[str]:
        """What is not (fully) watched, one ``"<layer path>: <why>"`` each.

        * a layer whose calls the step graph never saw: it runs inside an
          inner loop or function (a ``tf.while_loop`` body, a nested
          ``tf.function``) or was not called in training;
        * the cell of an RNN layer: only the call Keras makes for time step 0,
          outside its loop, is seen; later time steps are not watched one by
          one (the RNN layer's own output, which covers them, is).
        """
        notes = [
            f"{path}: never called in the step graph (inside an inner loop or function, "
            "or unused in training); not watched"
            for path in self.unwatched_layers or []
        ]
        for layer, path in self.taps._layers:
            if isinstance(layer, keras.layers.RNN):
                cell = getattr(layer, "cell", None)
                cells = getattr(cell, "cells", None) or ([cell] if cell is not None else [])
                for c in cells:
                    for other, other_path in self.taps._layers:
                        if other is c and other_path not in (self.unwatched_layers or []):
                            notes.append(
                                f"{other_path}: RNN cell, only time step 0 is watched "
                                f"(later steps run inside {path}'s loop; {path}'s output is watched)"
                            )
        return notes


def _local_variable(initial, name: str) -> tf.Variable:
    """A non-trainable variable each replica writes on its own (``ON_READ``).

    Without a distribution strategy it is a plain variable.
    """
    return tf.Variable(
        initial,
        trainable=False,
        name=name,
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


# The batch of the current step is kept in a fixed-shape variable (XLA cannot
# assign a new shape to a variable): rows beyond the first traced batch size
# are not kept; a smaller batch is padded and its length kept in row 0 of a
# companion counter.
_DEFAULT_ROWS = 1024


def _stash_variable(t: tf.Tensor) -> tuple[tf.Variable, tf.Variable] | None:
    shape = t.shape
    if shape.rank is None or not all(d is not None for d in shape[1:]):
        return None  # dynamic feature dims: not kept
    rows = shape[0] if shape.rank and shape[0] is not None else _DEFAULT_ROWS
    full = [rows] + list(shape[1:]) if shape.rank else []
    return (
        _local_variable(tf.zeros(full, t.dtype), "nanwatch_batch"),
        _local_variable(tf.constant(0, tf.int32), "nanwatch_batch_rows"),
    )


def _stash(slot, t: tf.Tensor) -> None:
    if slot is None:
        return
    var, rows = slot
    if t.shape.rank == 0:
        var.assign(t)
        return
    capacity = var.shape[0]
    kept = t[:capacity]
    n = tf.shape(kept)[0]
    padding = [[0, capacity - n]] + [[0, 0]] * (t.shape.rank - 1)
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


# A name scope opened twice in one graph becomes ``nanwatch_stats_1``, and a
# replica's ops are prefixed (``replica_1/...``): match any path component.
_OUR_SCOPE = re.compile(rf"(^|/){STATS_SCOPE}(_\d+)?/")


def _is_ours(op) -> bool:
    return _OUR_SCOPE.search(op.name) is not None


def _readers_first(tensors: list) -> None:
    """Makes the step's own consumers of each tensor wait for our readers.

    TensorFlow lets an elementwise op write its result into its input's
    buffer when it is that buffer's last user (``ReluGrad`` into the incoming
    gradient, the optimizer's ``Sub``/``Mul`` into a weight's gradient). A
    statistic reading the same gradient afterwards takes that away, and every
    such op then allocates a fresh buffer: on a CPU that cost more than the
    statistics themselves. Running our reader first (a few microseconds; it
    depends on that tensor only, so no cycle can form) gives the buffer back
    to the step's op. Values are unchanged; only the order is.
    """
    seen = set()
    for t in tensors:
        if isinstance(t, tf.IndexedSlices):
            t = t.values
        if not hasattr(t, "consumers") or id(t) in seen:
            continue
        seen.add(id(t))
        consumers = t.consumers()
        readers = [op for op in consumers if _is_ours(op) and op.type in _READER_OPS]
        if not readers:
            continue
        for op in consumers:
            if not _is_ours(op):
                for reader in readers:
                    op._add_control_input(reader)


def _skipped_by_loss_scaler(grad_fields: list[dict], grad_sumsq: tf.Tensor) -> tf.Tensor:
    """1.0 when a gradient holds a NaN/Inf (the loss scaler skips the step).

    The exact test runs only when the sum of squares, which any NaN/Inf
    makes non-finite, is not finite."""
    if not grad_fields:
        return tf.constant(0.0)

    def exact() -> tf.Tensor:
        bad = tf.add_n([step_stats.exact_bad_count(f) for f in grad_fields])
        return tf.cast(bad > 0, tf.float32)

    return step_stats.rare_cond(tf.math.is_finite(grad_sumsq), lambda: tf.constant(0.0), exact)


def _loss_fields(value) -> dict:
    value = tf.cast(tf.reduce_mean(value), tf.float32)
    return {
        "nan": tf.cast(tf.math.is_nan(value), tf.float32),
        "inf": tf.cast(tf.math.is_inf(value), tf.float32),
        "value": value,
    }


def _schema_size_after_update(builder: step_stats.StatsBuilder, weights: list) -> int:
    # Each variable adds one "weights" entry (nan, inf) after the update.
    return builder.schema.size + 2 * len(weights)
