"""The statistics of one train step, phase by phase, inside the compiled step.

:class:`PhaseStatistics` turns what one step computed (a :class:`StepInputs`)
into the entries of the per-step vector, in diagnosis order: the header, then
one method per phase (input, forward, loss, backward, update). The tensor
statistics themselves (NaN/Inf counts, extremes, norms, the cross-replica
reduction) are built by the step's statistics backend
(:mod:`tb_nanwatch.record.stats`), which the builder holds.

Every op the statistics add is created under the name scope ``STATS_SCOPE``,
and :func:`readers_first` orders the step's own consumers of a watched tensor
after our readers of it (see there why).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import keras
import tensorflow as tf

from tb_nanwatch.evidence.schema import BEFORE_FINAL_ACTIVATION
from tb_nanwatch.record.in_step import io_names
from tb_nanwatch.record.in_step.taps import LayerTaps, StepTrace, variable_path
from tb_nanwatch.record.stats.lazy_counts import scalar_total

# Every op the statistics add to the step graph is created under this scope.
STATS_SCOPE = "nanwatch_stats"
# The op types that read a watched tensor directly (a reduction, or the cast
# before one); each depends on that one tensor only.
_READER_OPS = frozenset({"L2Loss", "Sum", "Min", "Max", "Cast", "Slice"})


@dataclasses.dataclass
class StepInputs:
    """What one (replica's) train step computed, as the statistics read it.

    ``grads`` holds the gradients of ``weights`` followed by those of the
    watched layer tensors (``trace``'s calls, see ``StepRecorder.watched_tensors``).
    """

    trace: StepTrace
    x: Any
    y: Any
    y_pred: Any
    loss: tf.Tensor
    weights: list
    grads: list
    optimizer: Any
    data: Any
    model: keras.Model
    # Whether the step created variables tf.function sees before the
    # statistics (see StepRecorder._trace_never_runs); Keras' step only.
    created_variables: bool = False

    @property
    def weight_grads(self) -> list:
        return list(self.grads[: len(self.weights)])

    @property
    def watched_grads(self) -> list:
        return list(self.grads[len(self.weights) :])


def named_tensors(
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


def watchable_input(value: Any) -> tuple[tf.Tensor | None, str]:
    """(the tensor whose statistics stand for an input, "") or (None, why not).

    A ``SparseTensor`` is read through its stored values, a ``RaggedTensor``
    through its flat values (NaN/Inf live there; the implicit zeros and the
    row partition are finite); a number tensor as it is. Strings and other
    non-numeric dtypes cannot hold NaN/Inf: nothing to read.
    """
    if isinstance(value, tf.SparseTensor):
        value = value.values
    elif isinstance(value, tf.RaggedTensor):
        value = value.flat_values
    if not isinstance(value, (tf.Tensor, tf.Variable)):
        return None, f"a {type(value).__name__}, not a tensor"
    if not (value.dtype.is_floating or value.dtype.is_integer):
        return None, f"a {value.dtype.name} tensor, which cannot hold NaN/Inf"
    return value, ""


class PhaseStatistics:
    """Adds each phase's entries to a :class:`~tb_nanwatch.record.in_step.step_vector.StatsBuilder`."""

    def __init__(self, taps: LayerTaps) -> None:
        self.taps = taps
        # "<input>: <why>" for each model input or target the step cannot
        # read (filled when the step is traced).
        self.not_watched_inputs: list[str] = []

    def before_update(self, inputs: StepInputs, builder, micro_batch: int | None = None) -> list:
        """The header, input, forward, loss and backward entries of one step
        (of its micro-batch ``micro_batch`` with gradient accumulation: the
        header comes with micro-batch 0). Returns the fields of the weights'
        gradients (see :meth:`accumulated_header`).

        Each entry's fields are given to ``builder`` (a
        :class:`~tb_nanwatch.record.in_step.step_vector.StatsBuilder`) as a function: a
        :class:`~tb_nanwatch.record.in_step.step_vector.SchemaOnlyBuilder` never calls it.
        """
        if builder.records_values:
            grad_fields = builder.stats.gradient_fields_each(inputs.weight_grads)
        else:
            grad_fields = [{} for _ in inputs.weight_grads]
        if not micro_batch:
            self.header(builder, inputs, grad_fields)
        with builder.entries_of_micro_batch(micro_batch):
            self.input(builder, inputs)
            self.forward(builder, inputs)
            self.loss(builder, inputs)
            self.backward(builder, inputs, grad_fields)
        return grad_fields

    def accumulated_header(self, builder, passes: list[tuple[StepInputs, list]]) -> None:
        """The header of a step with several micro-batches (``passes``: each
        one's inputs and gradient fields): the mean of their losses, the root
        of the sum of their squared gradient norms, a loss-scaler skip if any
        gradient holds a NaN/Inf. The learning rate and iterations stay as
        micro-batch 0 read them (before the update)."""
        if not builder.records_values or len(passes) < 2:
            return
        grad_fields = [f for _, fields in passes for f in fields]
        losses = [tf.cast(tf.reduce_mean(i.loss), tf.float32) for i, _ in passes]
        fields = _header_fields(builder.stats, passes[0][0], grad_fields)
        fields["loss"] = tf.add_n(losses) / float(len(losses))
        builder.replace_header({k: fields[k] for k in ("loss", "grad_norm", "skipped")})

    def header(self, builder, inputs: StepInputs, grad_fields: list[dict]) -> None:
        """Loss, gradient norm (unscaled), learning rate, loss scale, skipped, iterations."""
        fields = functools.partial(_header_fields, builder.stats, inputs, grad_fields)
        builder.add("header", "header", None, "step header", fields)

    def input(self, builder, inputs: StepInputs) -> None:
        """The model inputs and the targets."""
        for name, t in named_tensors(inputs.x, "", io_names.input_names(inputs.model)):
            self._add_input(builder, name, t, f"model input {name}")
        if inputs.y is not None:
            flat_y = [t for t in tf.nest.flatten(inputs.y) if t is not None]
            output_names = io_names.output_names(inputs.model, len(flat_y))
            preferred = output_names if len(output_names) > 1 else None  # one: "target"
            for name, t in named_tensors(inputs.y, "target/", preferred):
                text = "target" if name == "target" else f"target for output {name[7:]}"
                self._add_input(builder, name, t, text)

    def _add_input(self, builder, name: str, value: Any, tensor: str) -> None:
        """One input entry: a sparse or ragged input by its values; a string
        input is noted in ``not_watched_inputs`` (the layers after it are watched)."""
        watched, why = watchable_input(value)
        if watched is None:
            note = f"{tensor}: {why}; not watched (the layers after it are)"
            if note not in self.not_watched_inputs:
                self.not_watched_inputs.append(note)
            return
        fields = functools.partial(builder.stats.tensor_fields, [watched], taken_extremes=True)
        builder.add("input", "input", name, tensor, fields)

    def forward(self, builder, inputs: StepInputs) -> None:
        """Every watched layer's output, then each model output's logits.

        A softmax or sigmoid model output carries the logits it came from,
        and Keras's cross-entropy reads those: the plain step never computes
        the probabilities. Its layer's entry reads the logits too (see
        :func:`logits_read_instead`), the same statistics as the logits entry,
        so that watching adds no softmax to the step.
        """
        flat_pred = [t for t in tf.nest.flatten(inputs.y_pred) if t is not None]
        instead = logits_read_instead(flat_pred)
        made: dict[tuple, dict] = {}  # the statistics of each list of tensors read

        def fields_of(tensors: list) -> dict:
            key = tuple(id(t) for t in tensors)
            if key not in made:
                made[key] = builder.stats.tensor_fields(tensors, taken_extremes=True)
            return made[key]

        for call in inputs.trace.calls:
            read = [instead.get(id(t), t) for t in call.outputs]
            tensor = f"output of {call.path}"
            if any(id(t) in instead for t in call.outputs):
                tensor = f"logits of {call.path} {BEFORE_FINAL_ACTIVATION}"
            builder.add(
                "forward", "activation", call.path, tensor, functools.partial(fields_of, read)
            )
        output_names = io_names.output_names(inputs.model, len(flat_pred))
        for name, t in zip(output_names, flat_pred, strict=False):
            tensor = f"model output {name}"
            if id(t) in instead:
                tensor = f"logits of model output {name} {BEFORE_FINAL_ACTIVATION}"
            fields = functools.partial(fields_of, [instead.get(id(t), t)])
            builder.add("forward", "logits", name, tensor, fields)

    def loss(self, builder, inputs: StepInputs) -> None:
        """Each output's loss, then the total."""
        for name, value in inputs.trace.losses:
            fields = functools.partial(loss_fields, builder.stats, value)
            builder.add("loss", "loss", name, f"loss of output {name}", fields)
        builder.add(
            "loss",
            "loss",
            None,
            "total loss",
            functools.partial(loss_fields, builder.stats, inputs.loss),
        )

    def backward(self, builder, inputs: StepInputs, grad_fields: list[dict]) -> None:
        """In reverse execution order, per layer: the gradient w.r.t. its
        output, its variables' gradients, the gradient w.r.t. its input."""
        owners = self.taps.variable_owners()
        grads_by_owner: dict[str | None, list[tuple[Any, dict]]] = {}
        for v, fields in zip(inputs.weights, grad_fields, strict=False):
            grads_by_owner.setdefault(owners.get(id(v)), []).append((v, fields))
        for call, out_grads, in_grads in reversed(_grads_per_call(inputs)):
            path = call.path
            if any(g is not None for g in out_grads):  # else no gradient: not a zero one
                fields = functools.partial(builder.stats.gradient_fields, out_grads)
                tensor = f"gradient w.r.t. output of {path}"
                builder.add("backward", "grad_out", path, tensor, fields)
            if "#" not in path:
                for v, fields in grads_by_owner.pop(path, []):
                    text = f"gradient of {variable_path(v)}"
                    builder.add("backward", "grad_var", path, text, fields)
            if in_grads:  # none when the input is not computed from any weight
                fields = functools.partial(builder.stats.gradient_fields, in_grads)
                tensor = f"gradient w.r.t. input of {path}"
                builder.add("backward", "grad_in", path, tensor, fields)
        for owner, items in grads_by_owner.items():
            for v, fields in items:
                text = f"gradient of {variable_path(v)}"
                builder.add("backward", "grad_var", owner, text, fields)

    def update(self, builder, weights: list) -> None:
        """Each variable after the optimizer's update."""
        owners = self.taps.variable_owners()

        @functools.cache
        def fields_of_all() -> list[dict]:
            return builder.stats.value_fields_each([tf.convert_to_tensor(v) for v in weights])

        for index, v in enumerate(weights):
            fields = functools.partial(_nth, fields_of_all, index)
            builder.add(
                "update",
                "weights",
                owners.get(id(v)),
                f"{variable_path(v)} after the update",
                fields,
            )


def _header_fields(stats, inputs: StepInputs, grad_fields: list[dict]) -> dict:
    """The header's values (see ``PhaseStatistics.header``)."""
    optimizer = inputs.optimizer
    scale = loss_scale(optimizer)
    is_lso = scale is not None
    if scale is None:
        scale = tf.constant(1.0)
    grad_sumsq = scalar_total([f["norm"] for f in grad_fields]) if grad_fields else tf.constant(0.0)
    skipped = (
        _skipped_by_loss_scaler(stats, grad_fields, grad_sumsq) if is_lso else tf.constant(0.0)
    )
    lr = current_learning_rate(optimizer)
    iterations = optimizer.iterations if optimizer is not None else 0
    return {
        "loss": tf.cast(inputs.loss, tf.float32),
        "grad_norm": grad_sumsq / (scale * scale),
        "lr": tf.cast(lr, tf.float32),
        "loss_scale": scale if is_lso else tf.constant(0.0),
        "skipped": skipped,
        "iterations": tf.cast(iterations, tf.float32),
    }


def loss_scale(optimizer) -> tf.Tensor | None:
    """The loss scale (float32) of a loss-scaling optimizer (Keras 3's
    ``LossScaleOptimizer``, or tf_keras' one), None for any other."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        scale = optimizer.dynamic_scale if optimizer.built else optimizer.initial_scale
        return tf.cast(scale, tf.float32)
    if hasattr(optimizer, "get_scaled_loss") and hasattr(optimizer, "loss_scale"):
        return tf.cast(optimizer.loss_scale, tf.float32)
    return None


def current_learning_rate(optimizer):
    """The learning rate the step uses (a schedule's value at the step); 0
    when there is none or it cannot be read before the first update."""
    if optimizer is None:
        return 0.0
    try:
        lr = optimizer.learning_rate
    except (AttributeError, ValueError):  # a tf_keras schedule before its first update
        return 0.0
    if callable(lr) and not isinstance(lr, tf.Variable):
        return lr(optimizer.iterations)
    return lr


def _nth(make_all, index: int) -> dict:
    return make_all()[index]


def _grads_per_call(inputs: StepInputs) -> list[tuple[Any, list, list]]:
    """(layer call, gradients w.r.t. its outputs, w.r.t. its inputs), in call order."""
    watched = inputs.watched_grads
    position, per_call = 0, []
    for call in inputs.trace.calls:
        n_out, n_in = len(call.outputs), len(call.inputs)
        outs = watched[position : position + n_out]
        ins = watched[position + n_out : position + n_out + n_in]
        per_call.append((call, outs, ins))
        position += n_out + n_in
    return per_call


def _skipped_by_loss_scaler(stats, grad_fields: list[dict], grad_sumsq: tf.Tensor) -> tf.Tensor:
    """1.0 when a gradient holds a NaN/Inf (the loss scaler skips the step).

    The exact test runs only when the sum of squares, which any NaN/Inf
    makes non-finite, is not finite."""
    if not grad_fields:
        return tf.constant(0.0)

    def exact() -> tf.Tensor:
        nonfinite = scalar_total([stats.exact_nonfinite_count(f) for f in grad_fields])
        return tf.cast(nonfinite > 0, tf.float32)

    return stats.rare_cond(stats.is_finite(grad_sumsq), lambda: tf.constant(0.0), exact)


def logits_read_instead(outputs: list) -> dict[int, tf.Tensor]:
    """``{id(output): logits}`` for each of the model's ``outputs`` that carries
    the logits it was computed from (``_keras_logits``: Keras's softmax and
    sigmoid keep them for its losses).

    Keras's losses read those logits, not the probabilities, so the step never
    computes such an output: reading it would add the whole activation to
    every step (a 2000-way softmax over the transformer's batch). The logits
    are read in its place.
    """
    instead = {}
    for t in outputs:
        logits = getattr(t, "_keras_logits", None)
        if logits is not None:
            instead[id(t)] = logits
    return instead


def loss_fields(stats, value) -> dict:
    """The loss entry's fields: its mean, and whether that is NaN or Inf."""
    value = tf.cast(tf.reduce_mean(value), tf.float32)
    return {
        "nan": tf.cast(stats.is_nan(value), tf.float32),
        "inf": tf.cast(stats.is_inf(value), tf.float32),
        "value": value,
    }


# A name scope opened twice in one graph becomes ``nanwatch_stats_1``, and a
# replica's ops are prefixed (``replica_1/...``): match any path component.
_OUR_SCOPE = re.compile(rf"(^|/){STATS_SCOPE}(_\d+)?/")


def is_ours(op) -> bool:
    """Whether ``op`` belongs to the statistics (was made under ``STATS_SCOPE``)."""
    return _OUR_SCOPE.search(op.name) is not None


def readers_first(tensors: list) -> None:
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
    if tf.executing_eagerly():
        return  # an eager step runs in program order; nothing to reorder
    seen = set()
    for t in tensors:
        if isinstance(t, tf.IndexedSlices):
            t = t.values
        if not hasattr(t, "consumers") or id(t) in seen:
            continue
        seen.add(id(t))
        consumers = t.consumers()
        readers = [op for op in consumers if is_ours(op) and op.type in _READER_OPS]
        # A Slice that holds the tensor runs after its trigger, which is
        # computed from every other reader: waiting for it is enough.
        readers = [op for op in readers if op.type == "Slice"] or readers
        if not readers:
            continue
        for op in consumers:
            if not is_ours(op):
                for reader in readers:
                    op._add_control_input(reader)
