"""The in-graph half of NanWatch, for both front ends: one train step, recorded.

:class:`StepRecorder` composes the three parts a watched step needs: the
layer taps (:mod:`tb_nanwatch.record.in_step.taps`, which tensors are watched), the
statistics of each phase (:mod:`tb_nanwatch.record.in_step.phase_stats`) and the device
record (:mod:`tb_nanwatch.record.in_step.device_record`: ring buffer, batch stash, pre-step
weight copies, the one host read). The Keras train step
(:mod:`tb_nanwatch.record.in_step.train_step`) and the custom-loop handle
(:class:`~tb_nanwatch.record.custom_loop.StepRecording`) call
:meth:`~StepRecorder.before_update` before the optimizer's update and
:meth:`~StepRecorder.after_update` after it.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Protocol

import keras
import tensorflow as tf

from tb_nanwatch.evidence.options import WatchOptions
from tb_nanwatch.evidence.schema import FIELDS, Schema
from tb_nanwatch.record.in_step import step_undo, step_vector
from tb_nanwatch.record.in_step.device_record import DeviceRecord
from tb_nanwatch.record.in_step.phase_stats import (
    STATS_SCOPE,
    PhaseStatistics,
    StepInputs,
    readers_first,
)
from tb_nanwatch.record.in_step.taps import LayerTaps, StepTrace, keras_kinds
from tb_nanwatch.record.stats import backend, choose


class RewindPoints(Protocol):
    """What the recorder needs of the rewind points' host side
    (:class:`~tb_nanwatch.record.after_incident.rewind_points.RewindRing`)."""

    slots: int  # steps of batches the device-side ring keeps
    max_bytes: int  # the memory the ring may use

    def give_up(self, why: str) -> None: ...

    def take_initial(self, model, optimizer, device) -> None: ...


class _OpenSteps(threading.local):
    """The step each graph (and replica thread) is building, between its
    first pass and ``after_update``: one dict a thread."""

    def __init__(self) -> None:
        self.steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class StepPatternError(Exception):
    """A step written in a way the recorder cannot follow (raised at trace
    time, never a wrong record): e.g. more forward passes than
    ``micro_batches``, or a pass inside a ``tf.while_loop`` body.

    A plain ``Exception`` subclass (no ``__init__`` of its own), so that
    autograph re-raises it as itself from a traced step."""


@dataclasses.dataclass
class PendingStep:
    """What :meth:`StepRecorder.before_update` hands to ``after_update``."""

    builder: step_vector.StatsBuilder
    batch: list[tf.Tensor]
    gradients: list  # every gradient the statistics read (see readers_first)
    weight_gradients: list  # the weights' gradients (of the latest pass), for the update
    # Gradient accumulation: each pass's (StepInputs, gradient fields) and flat batch.
    passes: list = dataclasses.field(default_factory=list)
    batches: list = dataclasses.field(default_factory=list)
    pass_entries: list | None = None  # what micro-batch 0 recorded, to compare the others


class StepRecorder:
    """Records the statistics of every step of ``model`` on the device."""

    def __init__(
        self,
        model: keras.Model,
        steps_per_execution: int = 1,
        pre_step_weights: str = WatchOptions.pre_step_weights,
        micro_batches: int = 1,
    ) -> None:
        self.model = model
        # Forward/backward passes per step (gradient accumulation); see before_update.
        self.micro_batches = micro_batches
        self._open = _OpenSteps()
        # Whether a step was built for XLA (None until one is built).
        self.built_for_xla: bool | None = None
        self.device = DeviceRecord(steps_per_execution, pre_step_weights)
        self.taps = LayerTaps(model)
        self.statistics = PhaseStatistics(self.taps)
        self.device_facts = backend.DeviceFacts()  # probed once a run, not once a step
        self.schema: Schema | None = None
        self.trace_error: Exception | None = None
        self.tapped_layers = [path for _, path in self.taps.layers]
        # Watched layers never seen in the step graph (see ``not_watched``).
        self.unwatched_layers: list[str] | None = None
        # Layers called in the step with no float output (see ``not_watched``).
        self.not_float_layers: list[str] = []
        self.strategy = getattr(model, "distribute_strategy", None) or tf.distribute.get_strategy()
        self._discarded_trace = None  # see _trace_never_runs
        # The optimizer the step applies (known from the first trace on), and
        # the rewind points' host side, which takes the state before the
        # first step when that trace is built (see use_rewind_points).
        self.optimizer = None
        self.rewind: RewindPoints | None = None

    @property
    def steps_per_execution(self) -> int:
        return self.device.steps_per_execution

    @property
    def watched_weights(self) -> list | None:
        """The variables whose pre-step copies the device record holds."""
        return self.device.watched_weights

    def use_rewind_points(self, rewind: RewindPoints) -> None:
        """Keeps the batches of the last ``rewind.slots`` steps on the device
        for ``rewind`` and hands it the state before the first step."""
        self.rewind = rewind
        if self.micro_batches > 1:
            rewind.give_up("a step of several micro-batches is not kept in the batch ring")
            return
        self.device.configure_rewind(rewind.slots, rewind.max_bytes)
        if self.device.row_width:  # a step built by an earlier fit: no new trace
            rewind.take_initial(self.model, self.optimizer, self.device)

    def undo_nonfinite_steps(self) -> None:
        """The compiled step undoes a non-finite step (``on_nonfinite`` "skip"
        or "rewind"); before the step is traced."""
        self.device.undo_nonfinite_steps()

    def fail_trace(self, error: Exception) -> None:
        """The step cannot be recorded: ``error`` says why (raised on the host)."""
        self.trace_error = error

    def install(self) -> None:
        self.taps.install()

    def uninstall(self) -> None:
        self.taps.uninstall()

    @staticmethod
    def watched_tensors(trace: StepTrace) -> list[tf.Tensor]:
        """The layer outputs and inputs whose gradients the step asks for."""
        out = []
        for call in trace.calls:
            out.extend(call.outputs)
            out.extend(call.inputs)
        return out

    # -- in the compiled step ------------------------------------------------------

    def before_update(self, inputs: StepInputs) -> PendingStep:
        """Adds header, input, forward, loss and backward entries; copies the
        weights before the update (see ``pre_step_weights``).

        With ``micro_batches`` > 1 each call records one forward/backward
        pass of the step (a micro-batch) into the same pending step; the
        returned step's ``weight_gradients`` are this pass's.
        """
        graph = tf.compat.v1.get_default_graph()
        open_steps = self._open_steps()
        pending = open_steps.get(graph)
        if pending is None:
            pending = self._first_pass(inputs)
            open_steps[graph] = pending
            return pending
        if len(pending.passes) >= self.micro_batches:
            raise StepPatternError(
                f"{len(pending.passes) + 1} forward passes in one step with "
                f"micro_batches={self.micro_batches}: for gradient accumulation pass the "
                "number of micro-batches a step runs, and call rec.after_update() once a "
                "step, after the update"
            )
        self._next_pass(pending, inputs)
        return pending

    def _open_steps(self) -> weakref.WeakKeyDictionary:
        return self._open.steps

    def _first_pass(self, inputs: StepInputs) -> PendingStep:
        """Micro-batch 0 (the only pass without accumulation): the header,
        the pass's entries, the device record, the pre-step weight copy."""
        if self.unwatched_layers is None:
            seen = {call.path.split("#")[0] for call in inputs.trace.calls}
            self.not_float_layers = [p for p in inputs.trace.not_float if p not in seen]
            seen.update(inputs.trace.not_float)
            self.unwatched_layers = [p for p in self.tapped_layers if p not in seen]
        # A trace that is never run needs only the entries (for the
        # variables' shapes); see _trace_never_runs.
        schema_only = self._trace_never_runs(inputs)
        weight_gradients = list(inputs.grads[: len(inputs.weights)])
        # The statistics backend, chosen once for the step being built: it
        # knows whether XLA compiles the step and holds this build's caches.
        stats = choose.for_current_graph(self.device_facts)
        self.optimizer = inputs.optimizer if inputs.optimizer is not None else self.optimizer
        self.built_for_xla = backend.in_xla()
        accumulating = self.micro_batches > 1
        with tf.name_scope(STATS_SCOPE):
            made = step_vector.SchemaOnlyBuilder if schema_only else step_vector.StatsBuilder
            builder = made(stats)
            grad_fields = self.statistics.before_update(
                inputs, builder, 0 if accumulating else None
            )
            # The buffer's width is known only now; create it before any use.
            pass_size = builder.schema.size - builder.schema.header().size
            size = _vector_size_after_update(builder, inputs.weights)
            size += (self.micro_batches - 1) * pass_size
            batch = self.device.ensure(
                size, inputs.data, inputs.weights, stats, retrace=schema_only
            )
            pending = PendingStep(builder, batch, [], weight_gradients)
            pending.pass_entries = _pass_entries(builder.schema, 1)
            pending.passes.append((inputs, grad_fields))
            pending.batches.append(batch)
            if schema_only:
                return pending
            self._before_first_step()
            pending.weight_gradients = self.device.copy_pre_step_weights(
                inputs.weights,
                builder.maybe_nonfinite,
                weight_gradients,
                stats,
                optimizer_variables(inputs.optimizer),
            )
        pending.gradients = [g for g in inputs.grads if g is not None]
        return pending

    def _next_pass(self, pending: PendingStep, inputs: StepInputs) -> None:
        """Micro-batch 1, 2, ...: its entries after the earlier passes'; the
        pre-step copy again (the weights do not change within a step)."""
        builder = pending.builder
        index = len(pending.passes)
        start = len(builder.schema.entries)
        weight_gradients = list(inputs.grads[: len(inputs.weights)])
        with tf.name_scope(STATS_SCOPE):
            grad_fields = self.statistics.before_update(inputs, builder, index)
            if _pass_entries(builder.schema, start) != pending.pass_entries:
                raise StepPatternError(
                    f"micro-batch {index} records other tensors than micro-batch 0 "
                    "(other layers called, or other outputs): every micro-batch of a "
                    "step must run the same model calls"
                )
            pending.passes.append((inputs, grad_fields))
            pending.batches.append(
                [t for t in tf.nest.flatten(inputs.data) if isinstance(t, tf.Tensor)]
            )
            if len(pending.passes) == self.micro_batches:
                self.statistics.accumulated_header(builder, pending.passes)
            if not builder.records_values:
                pending.weight_gradients = weight_gradients
                return
            pending.weight_gradients = self.device.copy_pre_step_weights(
                inputs.weights,
                builder.maybe_nonfinite,
                weight_gradients,
                builder.stats,
                optimizer_variables(inputs.optimizer),
            )
        pending.gradients += [g for g in inputs.grads if g is not None]

    def after_update(self, pending: PendingStep, weights: list) -> tf.Tensor:
        """Adds the update entries and writes the step's row; returns the row."""
        self._close_step(pending)
        builder = pending.builder
        if not builder.records_values:  # a trace that never runs (see before_update)
            # The update built the optimizer: its copies are made in this first
            # trace (the trace that runs may not create variables).
            variables = optimizer_variables(self.optimizer)
            self.device.ensure_optimizer_copies(variables, builder.stats)
            return tf.zeros([self.device.row_width], tf.float32)
        with tf.name_scope(STATS_SCOPE):
            self.statistics.update(builder, weights)
            vector = builder.vector()
            if self.device.restores:  # "skip"/"rewind": a non-finite step is undone
                step_undo.undo_if_nonfinite(self.device, builder.schema, vector, builder.stats)
            if self.schema is None:
                self.schema = builder.schema
            batch = pending.batch
            if len(pending.batches) > 1:
                first = _first_nonfinite_pass(builder.schema, vector, len(pending.batches))
                batch = _pick(first, pending.batches)
            row = self.device.write_row(
                builder.schema,
                vector,
                builder.replica_first_nonfinite,
                batch,
                builder.stats,
            )
        readers_first(pending.gradients)
        return row

    def _close_step(self, pending: PendingStep) -> None:
        """Ends the step this graph was building; a pattern error if it is
        not ``pending`` or has too few passes."""
        open_steps = self._open_steps()
        graph = tf.compat.v1.get_default_graph()
        if open_steps.get(graph) is not pending:
            raise StepPatternError(
                "rec.after_update() runs in another graph than the step's forward passes: "
                "micro-batches inside a tf.while_loop (a tf.range loop) cannot be recorded; "
                "loop over them with a Python range instead"
            )
        del open_steps[graph]
        if len(pending.passes) != self.micro_batches:
            raise StepPatternError(
                f"the step ran {len(pending.passes)} forward pass(es) with "
                f"micro_batches={self.micro_batches}: pass the number of micro-batches "
                "each step runs"
            )

    def _before_first_step(self) -> None:
        """On the first trace that runs, hands the state before the first
        step to the rewind points (read eagerly)."""
        if self.rewind is not None:
            with tf.init_scope():
                self.rewind.take_initial(self.model, self.optimizer, self.device)

    def _trace_never_runs(self, inputs: StepInputs) -> bool:
        """Whether tf.function will trace this step again and run only that
        second trace (decided on the first trace, for all its replicas).

        A tf.function whose first trace creates variables does that. Keras
        builds the optimizer and the compiled metrics in the first trace
        unless they were built before ``fit`` (a second ``fit``, a loaded
        model, a distribution strategy) or NanWatch built them out of the
        trace's sight (``train_step.build_out_of_the_trace``); layers built
        in the trace create variables too. When it does, this trace builds
        only the entries and creates the device record's variables where
        tf.function sees them, which makes the retrace certain; when it does
        not, the record's variables are hidden from tf.function and this
        first trace, built in full, is the one that runs.
        """
        if tf.executing_eagerly():
            return False
        graph = tf.compat.v1.get_default_graph()
        if self.device.created_in_graph is None:
            # A weak reference: the discarded trace's graph is not ours to keep.
            discarded = _trace_creates_variables(inputs)
            self._discarded_trace = weakref.ref(graph) if discarded else None
        return self._discarded_trace is not None and self._discarded_trace() is graph

    def guarded(self, method, *args):
        """``method(*args)``, or None after remembering its error.

        A failure in our own statistics must not change or break the step: it
        is remembered (the session warns and stops watching) and the step goes
        on exactly as it would unwatched.
        """
        try:
            return method(*args)
        except StepPatternError:
            raise  # the user's step, not the watcher, must change: say so at trace time
        except Exception as error:  # noqa: BLE001
            self.trace_error = error
            return None

    # -- on the host -------------------------------------------------------------------

    def not_watched(self) -> list[str]:
        """What is not (fully) watched, one ``"<layer path or input>: <why>"`` each.

        * a model input or target of a type the step cannot read (a string
          tensor); a sparse or ragged one is read through its values;
        * a layer whose output is not a float tensor (a ``StringLookup``);
        * a layer whose calls the step graph never saw: it runs inside an
          inner loop or function (a ``tf.while_loop`` body, a nested
          ``tf.function``) or was not called in training;
        * the cell of an RNN layer: only the call Keras makes for time step 0,
          outside its loop, is seen; later time steps are not watched one by
          one (the RNN layer's own output, which covers them, is).
        """
        unwatched = self.unwatched_layers or []
        notes = list(self.statistics.not_watched_inputs)
        notes += [
            f"{path}: its output is not a float tensor (cannot hold NaN/Inf); not watched"
            for path in self.not_float_layers
        ]
        notes += [
            f"{path}: never called in the step graph (inside an inner loop or function, "
            "or unused in training); not watched"
            for path in unwatched
        ]
        layers = self.taps.layers
        for layer, path in layers:
            if not isinstance(layer, keras_kinds("layers.RNN")):
                continue
            cell = getattr(layer, "cell", None)
            cells = getattr(cell, "cells", None) or ([cell] if cell is not None else [])
            cell_paths = [p for c in cells for other, p in layers if other is c]
            notes += [
                f"{cell_path}: RNN cell, only time step 0 is watched "
                f"(later steps run inside {path}'s loop; {path}'s output is watched)"
                for cell_path in cell_paths
                if cell_path not in unwatched
            ]
        return notes


def optimizer_variables(optimizer) -> list:
    """The optimizer's variables (iterations, learning rate, slots) once it
    is built, else []."""
    if optimizer is None or not getattr(optimizer, "built", False):
        return []
    found = getattr(optimizer, "variables", [])  # a method in older optimizers
    return list(found() if callable(found) else found)


def _trace_creates_variables(inputs: StepInputs) -> bool:
    """Whether the step being traced created variables before the
    statistics, or its rest builds the optimizer (the update) or the
    compiled metrics (``compute_metrics``), which create variables.

    A wrong guess costs time, never a record: a trace guessed to run that
    tf.function traces again is built in full a second time."""
    if inputs.created_variables:
        return True
    optimizer = inputs.optimizer
    if inputs.weights and optimizer is not None and not getattr(optimizer, "built", True):
        return True
    metrics = getattr(inputs.model, "_compile_metrics", None)
    return metrics is not None and not getattr(metrics, "built", True)


def _pass_entries(schema: Schema, start: int) -> list[tuple]:
    """What one pass recorded from entry ``start`` on, without its micro-batch label."""
    return [
        (
            e.phase,
            e.kind,
            e.layer,
            e.tensor if e.micro_batch is None else e.tensor.split(": ", 1)[1],
        )
        for e in schema.entries[start:]
    ]


def _first_nonfinite_pass(schema: Schema, vector: tf.Tensor, passes: int) -> tf.Tensor:
    """The index of the first micro-batch with a NaN/Inf entry (0 when none), in the graph."""
    flags = []
    for index in range(passes):
        entries = [e for e in schema.entries if e.micro_batch == index]
        counts = schema.indices(entries, "nan") + schema.indices(entries, "inf")
        flags.append(tf.reduce_sum(tf.gather(vector, tf.constant(counts, tf.int32))) > 0)
    flags.append(tf.constant(True))
    first = tf.argmax(tf.cast(tf.stack(flags), tf.int32), output_type=tf.int32)
    return tf.minimum(first, passes - 1)


def _pick(index: tf.Tensor, batches: list[list[tf.Tensor]]) -> list[tf.Tensor]:
    """The flat batch of micro-batch ``index`` (the stash keeps that one)."""
    if any(len(b) != len(batches[0]) for b in batches):
        return batches[0]
    branches = [lambda b=b: [tf.identity(t) for t in b] for b in batches]
    picked = tf.switch_case(index, branches)
    return list(picked) if isinstance(picked, (list, tuple)) else [picked]


def _vector_size_after_update(builder: step_vector.StatsBuilder, weights: list) -> int:
    # Each variable adds one "weights" entry after the update.
    return builder.schema.size + len(FIELDS["weights"]) * len(weights)
