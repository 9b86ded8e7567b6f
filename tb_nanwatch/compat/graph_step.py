"""A TF1 graph's train op with NanWatch's statistics in it.

:func:`build_train_op` does what ``optimizer.minimize(loss)`` does (the
gradients of the loss, then ``apply_gradients``) and records the step on the
way, with the statistics TF2 steps use (:mod:`tb_nanwatch.record.stats`,
:class:`~tb_nanwatch.record.in_step.step_vector.StatsBuilder`, the schema's five
phases in the same order):

* input: each placeholder the loss reads;
* forward: each name scope's outputs (see :mod:`~tb_nanwatch.compat.graph_layout`),
  then the model outputs named in ``outputs`` (the logits before a final
  sigmoid or softmax);
* loss: the loss;
* backward, scopes in reverse: the gradient w.r.t. the scope's outputs, its
  variables' gradients, the gradient w.r.t. its inputs (one ``tf.gradients``
  call for all of them, as ``minimize`` makes for the variables alone);
* update: each variable after ``apply_gradients``.

The vector goes to the host through one ``tf.numpy_function`` at the end of
the train op (:class:`~tb_nanwatch.compat.graph_rows.GraphRows`); on a step
that may be non-finite a second one, before the update, hands over the fed
batch and the weights before the step.
"""

from __future__ import annotations

import dataclasses
import functools

import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

from tb_nanwatch.compat.graph_layout import GraphLayout, variable_name
from tb_nanwatch.compat.graph_rows import GraphRows
from tb_nanwatch.evidence.schema import BEFORE_FINAL_ACTIVATION
from tb_nanwatch.record.in_step.phase_stats import (
    STATS_SCOPE,
    loss_fields,
    readers_first,
    watchable_input,
)
from tb_nanwatch.record.in_step.step_vector import StatsBuilder
from tb_nanwatch.record.stats.backend import StatsBackend
from tb_nanwatch.record.stats.lazy_counts import scalar_total

_FINAL_ACTIVATIONS = ("Sigmoid", "Softmax")


@dataclasses.dataclass
class GraphStep:
    """What one train op is built from."""

    loss: tf.Tensor
    layout: GraphLayout
    variables: list
    outputs: dict[str, tf.Tensor]
    rows: GraphRows


def _gradient_target(v):
    """What ``tf.gradients`` differentiates for a variable (as ``minimize`` does)."""
    if isinstance(v, resource_variable_ops.BaseResourceVariable):
        return v
    return v._ref() if hasattr(v, "_ref") else v  # a TF1 reference variable


def _learning_rate(optimizer) -> tf.Tensor:
    for attr in ("_lr", "_learning_rate"):
        value = getattr(optimizer, attr, None)
        if value is not None:
            value = value() if callable(value) else value
            return tf.cast(value, tf.float32)
    return tf.constant(0.0)


def _read_after(op: tf.Operation, variables: list) -> list[tf.Tensor]:
    """Each variable's value after ``op`` ran."""
    with tf.control_dependencies([op]):
        return [v.read_value() for v in variables]


def _after(captured: tf.Tensor, grads: list) -> list:
    """``grads`` unchanged, made to wait for ``captured`` (the pre-step capture)."""
    with tf.control_dependencies([captured]):
        out = []
        for g in grads:
            if g is None:
                out.append(None)
            elif isinstance(g, tf.IndexedSlices):
                out.append(tf.IndexedSlices(tf.identity(g.values), g.indices, g.dense_shape))
            else:
                out.append(tf.identity(g))
        return out


class GraphStepBuilder:
    """Builds the statistics of one TF1 train op; see the module docstring."""

    def __init__(self, step: GraphStep, stats: StatsBackend, pre_step_weights: str) -> None:
        self.step = step
        self.stats = stats
        self.builder = StatsBuilder(stats)
        self.pre_step_weights = pre_step_weights  # one of options.PRE_STEP_WEIGHTS
        self._iterations: tf.Tensor | None = None  # the header's read of the global step

    def train_op(self, optimizer, global_step=None, name: str | None = None) -> tf.Operation:
        step = self.step
        watched = step.layout.watched_tensors()
        sources = [_gradient_target(v) for v in step.variables] + watched
        grads = tf.compat.v1.gradients(step.loss, sources, gate_gradients=True)
        n = len(step.variables)
        var_grads, watched_grads = grads[:n], grads[n:]
        with tf.name_scope(STATS_SCOPE):
            grad_fields = self.stats.gradient_fields_each(var_grads)
            self._header(grad_fields, optimizer, global_step)
            self._inputs()
            self._forward()
            self.builder.add("loss", "loss", None, "total loss", loss_fields(self.stats, step.loss))
            self._backward(grad_fields, watched_grads)
            captured = self._capture()
            var_grads = _after(captured, var_grads)
        pairs = [(g, v) for g, v in zip(var_grads, step.variables, strict=True)]
        # The header reads the global step from before this step's increment: nothing
        # else orders that read before apply_gradients' assign_add.
        with tf.control_dependencies([self._iterations]):
            apply = optimizer.apply_gradients(pairs, global_step=global_step)
        with tf.name_scope(STATS_SCOPE):
            self._update(_read_after(apply, step.variables))
            vector = self.builder.vector()
            handed = tf.numpy_function(step.rows.receive_row, [vector], tf.bool, stateful=True)
        readers_first([g for g in grads if g is not None])
        return tf.group(apply, handed, name=name or "nanwatch_train_op")

    def _header(self, grad_fields: list[dict], optimizer, global_step) -> None:
        # No global step: the optimizer's iterations are not known (NaN: "not recorded").
        iterations = global_step if global_step is not None else tf.constant(float("nan"))
        # A cast, not an identity: an identity of a reference variable may alias the
        # buffer that the increment then changes.
        self._iterations = tf.cast(iterations, tf.float32)
        fields = {
            "loss": tf.cast(tf.reduce_mean(self.step.loss), tf.float32),
            "grad_norm": scalar_total([f["norm"] for f in grad_fields])
            if grad_fields
            else tf.constant(0.0),
            "lr": _learning_rate(optimizer),
            "loss_scale": tf.constant(0.0),
            "skipped": tf.constant(0.0),
            "iterations": self._iterations,
        }
        self.builder.add("header", "header", None, "step header", fields)

    def _inputs(self) -> None:
        for t in self.step.layout.placeholders:
            watched, _ = watchable_input(t)
            if watched is None:
                continue
            name = t.op.name
            fields = functools.partial(self.stats.tensor_fields, [t], taken_extremes=True)
            self.builder.add("input", "input", name, f"placeholder {name}", fields)

    def _forward(self) -> None:
        for scope in self.step.layout.scopes:
            fields = functools.partial(self.stats.tensor_fields, scope.outputs, taken_extremes=True)
            text = f"output of {scope.name}"
            self.builder.add("forward", "activation", scope.name, text, fields)
        for name, t in self.step.outputs.items():
            read, text = t, f"model output {name}"
            if t.op.type in _FINAL_ACTIVATIONS:
                read = t.op.inputs[0]
                text = f"logits of model output {name} {BEFORE_FINAL_ACTIVATION}"
            fields = functools.partial(self.stats.tensor_fields, [read], taken_extremes=True)
            self.builder.add("forward", "logits", name, text, fields)

    def _backward(self, grad_fields: list[dict], watched_grads: list) -> None:
        layout, add = self.step.layout, self.builder.add
        by_owner: dict[str, list] = {}
        for v, fields in zip(self.step.variables, grad_fields, strict=True):
            owner = layout.owners.get(variable_name(v))
            by_owner.setdefault(owner, []).append((variable_name(v), fields))
        position, per_scope = 0, []
        for scope in layout.scopes:
            n_out, n_in = len(scope.outputs), len(scope.inputs)
            outs = watched_grads[position : position + n_out]
            ins = watched_grads[position + n_out : position + n_out + n_in]
            per_scope.append((scope.name, outs, ins))
            position += n_out + n_in
        gradient = self.stats.gradient_fields
        for name, outs, ins in reversed(per_scope):
            if any(g is not None for g in outs):
                fields = functools.partial(gradient, outs)
                add("backward", "grad_out", name, f"gradient w.r.t. output of {name}", fields)
            for var, fields in by_owner.pop(name, []):
                add("backward", "grad_var", name, f"gradient of {var}", fields)
            if any(g is not None for g in ins):
                fields = functools.partial(gradient, ins)
                add("backward", "grad_in", name, f"gradient w.r.t. input of {name}", fields)
        for owner, items in by_owner.items():
            for var, fields in items:
                add("backward", "grad_var", owner, f"gradient of {var}", fields)

    def _capture(self) -> tf.Tensor:
        """Hands the fed batch and the pre-step weights to the host when the
        step may be non-finite (a boolean tensor the update waits for)."""
        step = self.step
        variables = step.variables if self.pre_step_weights != "off" else []

        def capture() -> tf.Tensor:
            values = list(step.layout.placeholders) + [v.read_value() for v in variables]
            return tf.numpy_function(step.rows.receive_capture, values, tf.bool, stateful=True)

        if self.pre_step_weights == "every_step":
            return capture()
        return tf.cond(self.builder.maybe_nonfinite(), capture, lambda: tf.constant(False))

    def _update(self, values: list[tf.Tensor]) -> None:
        fields_each = self.stats.value_fields_each(values)
        owners = self.step.layout.owners
        for v, fields in zip(self.step.variables, fields_each, strict=True):
            name = variable_name(v)
            text = f"{name} after the update"
            self.builder.add("update", "weights", owners.get(name), text, fields)
