"""The names a person reads for a model's inputs, targets and outputs.

A Keras functional model's input tensors are named ``keras_tensor_N`` and an
unnamed ``Input`` layer ``input_layer_N``: neither says anything. An input is
named by its ``Input`` layer's name when the user gave one (``features``), by
the keys of dict inputs, else ``input`` (one) or ``input_<i>`` (several).
Outputs are named by the model's output names (its output layers; a
``Sequential`` has none: its last layer's name), else ``output`` /
``output_<i>``; the targets of several outputs after them
(``target/<output name>``), one target is ``target``.
"""

from __future__ import annotations

import re

# What Keras calls an Input layer or a symbolic tensor the user did not name.
_AUTOMATIC = re.compile(r"^(input_layer|keras_tensor|input)(_\d+)?$")


def _fallback(prefix: str, count: int) -> list[str]:
    return [prefix] if count == 1 else [f"{prefix}_{i}" for i in range(count)]


def _operation_name(tensor) -> str:
    history = getattr(tensor, "_keras_history", None)
    name = getattr(getattr(history, "operation", None), "name", None)
    return str(name or getattr(tensor, "name", "") or "").split(":")[0]


def input_names(model) -> list[str]:
    """One readable name per model input (in ``model.inputs`` order)."""
    try:
        tensors = list(getattr(model, "inputs", None) or [])
    except (AttributeError, ValueError):  # a model that was never called
        tensors = []
    names = [_operation_name(t) for t in tensors]
    fallback = _fallback("input", len(names))
    return [
        default if not name or _AUTOMATIC.match(name) else name
        for name, default in zip(names, fallback, strict=True)
    ]


def output_names(model, count: int) -> list[str]:
    """``count`` readable output names: the model's own when it has as many."""
    names = list(getattr(model, "output_names", None) or [])
    if len(names) != count:
        try:
            names = [_operation_name(t) for t in getattr(model, "outputs", None) or []]
        except (AttributeError, ValueError):
            names = []
    if len(names) != count or not all(names) or len(set(names)) != count:
        return _fallback("output", count)
    return [str(n) for n in names]
