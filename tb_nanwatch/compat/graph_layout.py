"""What a TF1 graph's train step is made of, as NanWatch names it.

The "layers" of a graph are the name scopes of its ops (``encoder/dense1``
for ``encoder/dense1/MatMul`` and ``encoder/dense1/Relu``; an op outside any
scope is its own layer, named by the op). :func:`graph_layout` walks the ops
the loss is computed from, in the order they were created (an order they can
run in), and finds:

* the inputs: the placeholders the loss reads (``pixels``);
* each scope's outputs (its float tensors that an op of another scope reads)
  and inputs (float tensors from another scope that are computed from a
  variable: the only ones a gradient can flow into);
* the trainable variables, each owned by the scope its name is in
  (``encoder/dense1/kernel`` -> ``encoder/dense1``).
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

# Ops that are not computation of a layer: the data, the variables, their reads.
_NOT_COMPUTATION = frozenset(
    {
        "Placeholder",
        "PlaceholderWithDefault",
        "VariableV2",
        "Variable",
        "VarHandleOp",
        "ReadVariableOp",
        "Const",
        "NoOp",
    }
)
_PLACEHOLDERS = ("Placeholder", "PlaceholderWithDefault")


@dataclasses.dataclass
class GraphScope:
    """One name scope of the forward pass: a "layer"."""

    name: str
    outputs: list[tf.Tensor] = dataclasses.field(default_factory=list)
    inputs: list[tf.Tensor] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class GraphLayout:
    """The placeholders, scopes (in execution order) and variables of a loss."""

    placeholders: list[tf.Tensor]
    scopes: list[GraphScope]
    owners: dict[str, str]  # variable name -> the scope that owns it

    def watched_tensors(self) -> list[tf.Tensor]:
        """Every scope's outputs then inputs, scope by scope (the gradient sources)."""
        return [t for s in self.scopes for t in s.outputs + s.inputs]


def scope_of(name: str) -> str:
    """The name scope of an op or variable name (the name itself at top level)."""
    name = name.split(":")[0]
    return name.rpartition("/")[0] or name


def variable_name(v) -> str:
    """A variable's name without the output index (``encoder/dense1/kernel``)."""
    return v.name.split(":")[0]


def _ancestors(loss: tf.Tensor) -> set:
    """The ops ``loss`` is computed from (data edges), itself included."""
    seen, stack = set(), [loss.op]
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        stack.extend(t.op for t in op.inputs)
    return seen


def _variable_ops(variables: list) -> set:
    ops = set()
    for v in variables:
        for attr in ("op", "_variable"):
            target = getattr(v, attr, None)
            target = getattr(target, "op", target)
            if isinstance(target, tf.Operation):
                ops.add(target)
    return ops


def _is_float(t: tf.Tensor) -> bool:
    return t.dtype.base_dtype.is_floating


def _computed_from(ops: list, sources: set) -> set:
    """The ops of ``ops`` (in creation order) that read, transitively, an op of ``sources``."""
    reached = set(sources)
    for op in ops:
        if any(t.op in reached for t in op.inputs):
            reached.add(op)
    return reached


def graph_layout(loss: tf.Tensor, variables: list, own_scope: str) -> GraphLayout:
    """The layout of the forward pass computing ``loss`` (ops under
    ``own_scope``, NanWatch's own, are left out)."""
    needed = _ancestors(loss)
    ops = [op for op in loss.graph.get_operations() if op in needed]
    ops = [op for op in ops if not op.name.startswith(own_scope)]
    placeholders = [op for op in ops if op.type in _PLACEHOLDERS]
    variable_ops = _variable_ops(variables)
    from_variables = _computed_from(ops, variable_ops)
    from_data = _computed_from(ops, variable_ops | set(placeholders))
    computation = [
        op
        for op in ops
        if op.type not in _NOT_COMPUTATION
        and op in from_data
        and not (op.type == "Identity" and op.inputs and op.inputs[0].op in variable_ops)
    ]
    in_computation = set(computation)
    scopes: dict[str, GraphScope] = {}
    for op in computation:
        scope = scopes.setdefault(scope_of(op.name), GraphScope(scope_of(op.name)))
        for t in op.outputs:
            readers = [c for c in t.consumers() if c in in_computation]
            leaves = any(scope_of(c.name) != scope.name for c in readers)
            if _is_float(t) and t is not loss and leaves:
                scope.outputs.append(t)
        for t in op.inputs:
            if (
                t.op in in_computation
                and scope_of(t.op.name) != scope.name
                and _is_float(t)
                and t.op in from_variables
                and not any(t is known for known in scope.inputs)
            ):
                scope.inputs.append(t)
    owners = {variable_name(v): scope_of(variable_name(v)) for v in variables}
    return GraphLayout(
        placeholders=[op.outputs[0] for op in placeholders],
        scopes=[s for s in scopes.values() if s.outputs],
        owners=owners,
    )
