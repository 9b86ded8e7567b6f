"""Taps on layer outputs: which layers are watched, under which path names.

A tap replaces ``layer.call`` on the instance by a wrapper that, while a step
is being traced, remembers the layer's inputs and outputs and asks the active
``GradientTape`` to watch them, so the step can ask for the gradient with
respect to each layer's output and input in the same backward pass. Outside a
traced step the wrapper only forwards the call: the model's math is untouched.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from typing import Any

import keras
import tensorflow as tf

from tb_nanwatch.record.in_step import io_names


@dataclasses.dataclass
class LayerCall:
    """One traced call of a watched layer."""

    path: str
    inputs: list[tf.Tensor]
    outputs: list[tf.Tensor]


@dataclasses.dataclass
class StepTrace:
    """What the taps saw while one replica's step was traced."""

    tape: tf.GradientTape
    graph: Any
    calls: list[LayerCall] = dataclasses.field(default_factory=list)
    losses: list[tuple[str, tf.Tensor]] = dataclasses.field(default_factory=list)
    call_counts: dict[str, int] = dataclasses.field(default_factory=dict)
    # Layers called in the step whose outputs hold no float tensor (a
    # StringLookup, an argmax): nothing in them can be NaN/Inf.
    not_float: list[str] = dataclasses.field(default_factory=list)


def _float_tensors(value: Any) -> list[tf.Tensor]:
    return [
        t
        for t in tf.nest.flatten(value)
        if isinstance(t, (tf.Tensor, tf.Variable)) and t.dtype.is_floating
    ]


# Ops that hand out a dataset element: the resource they read is an iterator,
# not a variable, so the walk in ``_reads_variables`` stops there.
_ITERATOR_OPS = ("Iterator", "MultiDeviceIterator", "AnonymousIterator")


def _reads_variables(t: tf.Tensor) -> bool:
    """Whether ``t`` is computed from a variable (conservatively: any op with a
    resource input other than a dataset iterator, such as ``ReadVariableOp``).

    A tensor that is not, e.g. the batch fed to the first layer, cannot carry
    a gradient into any weight, so its gradient is not asked for: that would
    be a backward op the training itself never runs (a whole extra matmul or
    convolution for the first layer).
    """
    if not hasattr(t, "op"):
        return True  # an eager tensor or a variable: be conservative
    stack, seen = [t.op], set()
    while stack:
        op = stack.pop()
        if op.name in seen or op.type.startswith(_ITERATOR_OPS):
            continue
        seen.add(op.name)
        if any(i.dtype == tf.resource for i in op.inputs):
            return True
        stack.extend(i.op for i in op.inputs)
    return False


def _own_copy(value: Any) -> Any:
    """A float tensor computed from variables as a fresh identity (Keras mask
    kept); anything else as is."""
    if (
        not isinstance(value, tf.Tensor)
        or not value.dtype.is_floating
        or not _reads_variables(value)
    ):
        return value
    copy = tf.identity(value)
    mask = getattr(value, "_keras_mask", None)
    if mask is not None:
        copy._keras_mask = mask
    return copy


def _own_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict, list[tf.Tensor]]:
    """Gives a layer its own copy of its first input, to be watched.

    A tensor feeding several layers has one gradient, the sum over all of
    them; through its own identity copy each layer's input gradient holds
    only that layer's share, so a NaN made in one consumer's backward pass is
    not blamed on another. The identity changes no value. An input that is
    not computed from any variable gets no copy and is not watched.
    """
    copies: list[tf.Tensor] = []  # the copies made here, in structure order

    def own(value: Any) -> Any:
        copy = _own_copy(value)
        if copy is not value:
            copies.append(copy)
        return copy

    if args:
        args = (tf.nest.map_structure(own, args[0]),) + tuple(args[1:])
    elif "inputs" in kwargs:
        kwargs = {**kwargs, "inputs": tf.nest.map_structure(own, kwargs["inputs"])}
    return args, kwargs, copies


def keras_kinds(name: str) -> tuple[type, ...]:
    """Keras 3's ``keras.<name>`` (``Model``, ``layers.InputLayer``), and
    tf_keras' too when a program has imported it (a tf_keras model under
    ``fit``); tf_keras is never imported here."""
    found = []
    for module in (keras, sys.modules.get("tf_keras")):
        item = module
        for part in name.split("."):
            item = getattr(item, part, None) if item is not None else None
        if isinstance(item, type):
            found.append(item)
    return tuple(found)


def variable_path(v) -> str:
    """A variable's path (``dense/kernel``): Keras 3's ``path``, else its
    TensorFlow name without the output index (a tf_keras variable)."""
    path = getattr(v, "path", None)
    return path if isinstance(path, str) else v.name.split(":")[0]


def layer_paths(model: keras.Model) -> dict[int, str]:
    """Maps ``id(layer)`` to a path such as ``backbone/block2_conv``.

    The top model's own name is left out; nested models and layers add one
    component each. A layer reachable by several paths keeps the first.
    """
    paths: dict[int, str] = {}

    def visit(layer: keras.layers.Layer, prefix: str) -> None:
        for child in layer._flatten_layers(include_self=False, recursive=False):
            if id(child) in paths or isinstance(child, keras_kinds("layers.InputLayer")):
                continue
            path = f"{prefix}{child.name}"
            paths[id(child)] = path
            visit(child, path + "/")

    visit(model, "")
    return paths


def watched_layers(model: keras.Model) -> list[tuple[keras.layers.Layer, str]]:
    """Every layer whose output is watched, with its path.

    Models nested inside the model are not watched themselves (their output is
    their last layer's output); every other layer is, composite layers
    included, because a composite layer may do math of its own after its
    sublayers (it then completes, and is recorded, after them).
    """
    paths = layer_paths(model)
    layers = []
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if isinstance(layer, keras_kinds("Model") + keras_kinds("layers.InputLayer")):
            continue
        if id(layer) in paths:
            layers.append((layer, paths[id(layer)]))
    return layers


class LayerTaps:
    """Installs and removes the call wrappers; records per traced replica."""

    def __init__(self, model: keras.Model) -> None:
        self.model = model
        self._layers = watched_layers(model)
        self._local = threading.local()
        self._installed: list[keras.layers.Layer] = []
        self._original_losses: tuple | None = None
        self._loss_taps_decided = False

    @property
    def layers(self) -> list[tuple[keras.layers.Layer, str]]:
        """Every watched layer with its path, in model order."""
        return list(self._layers)

    @property
    def installed(self) -> bool:
        """Whether the call wrappers are in place."""
        return bool(self._installed)

    def variable_owners(self) -> dict[int, str]:
        """Maps ``id(variable)`` to the path of the watched layer that owns it."""
        owners: dict[int, str] = {}
        for layer, path in self._layers:
            own = getattr(layer, "_trainable_variables", None)
            if own is None:  # a tf_keras layer
                own = getattr(layer, "_trainable_weights", [])
            for v in own:
                owners.setdefault(id(v), path)
        return owners

    @property
    def active(self) -> StepTrace | None:
        return getattr(self._local, "trace", None)

    def install(self) -> None:
        for layer, path in self._layers:
            if "call" in layer.__dict__:
                continue  # already wrapped by someone else; leave it alone
            original = layer.call
            object.__setattr__(layer, "call", self._wrap(original, path))
            self._installed.append(layer)

    def uninstall(self) -> None:
        for layer in self._installed:
            layer.__dict__.pop("call", None)
        self._installed = []
        if self._original_losses is not None:
            compile_loss, flat = self._original_losses
            compile_loss._flat_losses = flat
            self._original_losses = None
        self._loss_taps_decided = False

    def _wrap(self, original, path: str):
        taps = self

        def call(*args, **kwargs):
            trace = taps.active
            # Calls traced into an inner graph (an RNN cell inside a while
            # loop, a nested tf.function) cannot be used from the step graph.
            if trace is None or tf.compat.v1.get_default_graph() is not trace.graph:
                return original(*args, **kwargs)
            args, kwargs, inputs = _own_inputs(args, kwargs)
            for t in inputs:
                trace.tape.watch(t)
            outputs = original(*args, **kwargs)
            taps._record(trace, path, inputs, outputs)
            return outputs

        return call

    def _record(self, trace: StepTrace, path: str, inputs: list, outputs) -> None:
        outs = _float_tensors(outputs)
        if not outs:
            if path not in trace.not_float:
                trace.not_float.append(path)
            return
        count = trace.call_counts.get(path, 0) + 1
        trace.call_counts[path] = count
        name = path if count == 1 else f"{path}#{count}"
        for t in outs:
            trace.tape.watch(t)
        trace.calls.append(LayerCall(name, inputs, outs))

    def install_loss_taps(self, y_true, y_pred) -> None:
        """Wraps each compiled loss so its value is recorded per output.

        Decided once, at the first trace (the compiled loss is built then), so
        every trace of the step has the same entries.
        """
        if self._loss_taps_decided:
            return
        self._loss_taps_decided = True
        compile_loss = getattr(self.model, "_compile_loss", None)
        if compile_loss is None:
            return
        if not compile_loss.built and y_true is not None:
            try:
                compile_loss.build(y_true, y_pred)
            except Exception:  # noqa: BLE001 - Keras builds it itself later
                return
        flat = getattr(compile_loss, "_flat_losses", None)
        if not flat:
            return
        taps = self
        wrapped = []
        # Named by the model's outputs (the loss's own name, e.g.
        # "binary_crossentropy", says nothing about which output it scores).
        outputs = io_names.output_names(self.model, len(tf.nest.flatten(y_pred)))
        for index, item in enumerate(flat):
            name = item.name or f"output_{index}"
            if name not in outputs and len(outputs) == len(flat):
                name = outputs[index]

            def loss_fn(y_true, y_pred, sample_weight=None, _fn=item.loss, _name=name):
                value = _fn(y_true, y_pred, sample_weight)
                trace = taps.active
                if trace is not None and tf.compat.v1.get_default_graph() is trace.graph:
                    trace.losses.append((_name, value))
                return value

            wrapped.append(item._replace(loss=loss_fn))
        self._original_losses = (compile_loss, flat)
        compile_loss._flat_losses = wrapped

    def recording(self, tape: tf.GradientTape) -> _Recording:
        """Context manager: record the layer calls and losses of this replica."""
        return _Recording(self, tape)


class _Recording:
    def __init__(self, taps: LayerTaps, tape: tf.GradientTape) -> None:
        self.taps = taps
        self.trace = StepTrace(tape=tape, graph=tf.compat.v1.get_default_graph())

    def __enter__(self) -> StepTrace:
        self.taps._local.trace = self.trace
        return self.trace

    def __exit__(self, *exc) -> None:
        self.taps._local.trace = None
