"""The in-graph half of NanWatch, for both front ends: one train step, recorded.

:class:`StepRecorder` composes the three parts a watched step needs: the
layer taps (:mod:`tb_nanwatch.record.taps`, which tensors are watched), the
statistics of each phase (:mod:`tb_nanwatch.record.phase_stats`) and the device
record (:mod:`tb_nanwatch.record.device_record`: ring buffer, batch stash, pre-step
weight copies, the one host read). The Keras train step
(:mod:`tb_nanwatch.record.train_step`) and the custom-loop handle
(:class:`~tb_nanwatch.record.custom_loop.StepRecording`) call
:meth:`~StepRecorder.before_update` before the optimizer's update and
:meth:`~StepRecorder.after_update` after it.
"""

from __future__ import annotations

import dataclasses
import weakref

import keras
import tensorflow as tf

from tb_nanwatch.evidence.options import WatchOptions
from tb_nanwatch.evidence.schema import FIELDS, Schema
from tb_nanwatch.record import step_stats
from tb_nanwatch.record.device_record import DeviceRecord
from tb_nanwatch.record.phase_stats import STATS_SCOPE, PhaseStatistics, StepInputs, readers_first
from tb_nanwatch.record.stats import backend
from tb_nanwatch.record.taps import LayerTaps, StepTrace


@dataclasses.dataclass
class PendingStep:
    """What :meth:`StepRecorder.before_update` hands to ``after_update``."""

    builder: step_stats.StatsBuilder
    batch: list[tf.Tensor]
    gradients: list  # every gradient the statistics read (see readers_first)
    weight_gradients: list  # the weights' gradients, for the update to apply


class StepRecorder:
    """Records the statistics of every step of ``model`` on the device."""

    def __init__(
        self,
        model: keras.Model,
        steps_per_execution: int = 1,
        pre_step_weights: str = WatchOptions.pre_step_weights,
    ) -> None:
        self.model = model
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

    @property
    def steps_per_execution(self) -> int:
        return self.device.steps_per_execution

    @property
    def watched_weights(self) -> list | None:
        """The variables whose pre-step copies the device record holds."""
        return self.device.watched_weights

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
        weights before the update (see ``pre_step_weights``)."""
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
        stats = backend.for_current_graph(self.device_facts)
        with tf.name_scope(STATS_SCOPE):
            made = step_stats.SchemaOnlyBuilder if schema_only else step_stats.StatsBuilder
            builder = self.statistics.before_update(inputs, made(stats))
            # The buffer's width is known only now; create it before any use.
            size = _vector_size_after_update(builder, inputs.weights)
            batch = self.device.ensure(
                size, inputs.data, inputs.weights, stats, retrace=schema_only
            )
            if schema_only:
                return PendingStep(builder, batch, [], weight_gradients)
            weight_gradients = self.device.copy_pre_step_weights(
                inputs.weights, builder.maybe_nonfinite, weight_gradients, stats
            )
        gradients = [g for g in inputs.grads if g is not None]
        return PendingStep(builder, batch, gradients, weight_gradients)

    def after_update(self, pending: PendingStep, weights: list) -> tf.Tensor:
        """Adds the update entries and writes the step's row; returns the row."""
        builder = pending.builder
        if not builder.records_values:  # a trace that never runs (see before_update)
            return tf.zeros([self.device.row_width], tf.float32)
        with tf.name_scope(STATS_SCOPE):
            self.statistics.update(builder, weights)
            vector = builder.vector()
            if self.schema is None:
                self.schema = builder.schema
            row = self.device.write_row(
                builder.schema,
                vector,
                builder.replica_first_nonfinite,
                pending.batch,
                builder.stats,
            )
        readers_first(pending.gradients)
        return row

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
            if not isinstance(layer, keras.layers.RNN):
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


def _vector_size_after_update(builder: step_stats.StatsBuilder, weights: list) -> int:
    # Each variable adds one "weights" entry after the update.
    return builder.schema.size + len(FIELDS["weights"]) * len(weights)
