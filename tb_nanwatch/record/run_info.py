"""What a run's summary says of the model, its loss and its optimizer.

Read once, on the host, when training begins (``NanWatch.on_train_begin``,
``StepWatcher``'s constructor): the facts the cause engine and the remedies
judge by (the layers' classes, the model's first layer and output
activations, the loss's name and whether it reads logits, the optimizer's
epsilon and clipping, the weights' finiteness before the first step). Each
reader here is evidence only: one that fails logs a warning and leaves its
fields out, never stopping the watch.
"""

from __future__ import annotations

import logging

import keras
import numpy as np
import tensorflow as tf

from tb_nanwatch.evidence.options import WatchOptions
from tb_nanwatch.evidence.remedies import NORMALIZING_LAYERS, loss_name
from tb_nanwatch.record.after_incident.trial_replica import (
    inner_optimizer,
    model_outputs,
    output_units,
)
from tb_nanwatch.record.in_step import io_names
from tb_nanwatch.record.in_step.recorder import StepRecorder
from tb_nanwatch.record.in_step.taps import variable_path

logger = logging.getLogger("tb_nanwatch")


def base_run_info(recorder: StepRecorder, model, optimizer, options: WatchOptions) -> dict:
    """The run summary fields both front ends write."""
    strategy = recorder.strategy
    return {
        "model": getattr(model, "name", type(model).__name__),
        "framework": f"keras {keras.__version__} / tensorflow {tf.__version__}",
        "layers": recorder.tapped_layers,
        "optimizer": type(optimizer).__name__ if optimizer is not None else None,
        "jit_compile": bool(getattr(model, "jit_compile", False)),
        "steps_per_execution": recorder.steps_per_execution,
        "replicas": strategy.num_replicas_in_sync,
        "strategy": type(strategy).__name__,
        "on_nonfinite": options.on_nonfinite,
        "dtype_policy": getattr(getattr(model, "dtype_policy", None), "name", None),
        "loss_from_logits": loss_from_logits(getattr(model, "loss", None)),
        "loss_name": loss_name(getattr(model, "loss", None)),
        **_weights_at_start(model),
        **_model_facts(model, optimizer),
    }


# Optimizer settings the remedies read (a number, or None: the optimizer has none).
OPTIMIZER_SETTINGS = ("epsilon", "clipnorm", "global_clipnorm", "clipvalue")
MAX_LAYER_CLASSES = 200


def _model_facts(model, optimizer) -> dict:
    """What the remedies read of the model and optimizer: the layers' class
    names and whether one is an attention layer, the optimizer's epsilon and
    clipping, the model inputs' dtypes (integer inputs are ids). {} on failure."""
    try:
        layers = list(model._flatten_layers(include_self=False, recursive=True))
        classes = {type(layer).__name__ for layer in layers}
        attention = any(
            "attention" in base.__name__.lower() for layer in layers for base in type(layer).__mro__
        )
        inner = inner_optimizer(optimizer)
        settings = {name: _setting(inner, name) for name in OPTIMIZER_SETTINGS}
        return {
            "layer_classes": sorted(classes)[:MAX_LAYER_CLASSES],
            "has_attention": attention,
            "optimizer_settings": settings if inner is not None else None,
            "input_dtypes": _input_dtypes(model),
            **model_ends(model),
        }
    except Exception as error:  # noqa: BLE001 - evidence only: never stop the watch for it
        logger.warning("NanWatch could not read the model's layers or optimizer: %r", error)
        return {}


def model_ends(model) -> dict:
    """What the remedies read of the model's ends: ``first_layer_class`` (the
    first layer after the inputs), ``normalizes_inputs`` (it is a
    normalisation), ``output_activations`` (each output layer's final
    activation: ``"softmax"``, ``"sigmoid"``, ``"linear"``, ... None: not known)
    and ``output_units`` (each output's last dimension)."""
    layers = [
        layer
        for layer in getattr(model, "layers", None) or []
        if type(layer).__name__ != "InputLayer"
    ]
    if not layers:
        return {}
    first = type(layers[0]).__name__
    outputs = _output_layers(model) or [layers[-1]]
    return {
        "first_layer_class": first,
        "normalizes_inputs": first in NORMALIZING_LAYERS,
        "output_activations": [_final_activation(layer) for layer in outputs],
        "output_units": output_units(model),
    }


def _output_layers(model) -> list:
    found = []
    for tensor in model_outputs(model):
        history = getattr(tensor, "_keras_history", None)
        layer = getattr(history, "operation", None) or getattr(history, "layer", None)
        if layer is None:
            return []
        found.append(layer)
    return found


def _final_activation(layer) -> str | None:
    """The activation a layer ends in, by name (``"softmax"``), None when not known."""
    name = type(layer).__name__
    if name in ("Softmax", "Sigmoid"):
        return name.lower()
    activation = getattr(layer, "activation", None)
    if activation is None:
        return "linear" if name in ("Dense", "EinsumDense", "Conv1D", "Conv2D") else None
    if isinstance(activation, str):
        return activation
    return getattr(activation, "__name__", None)


def _setting(optimizer, name: str) -> float | None:
    value = getattr(optimizer, name, None)
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):  # a schedule or a tensor that is no number
        return None


def _input_dtypes(model) -> dict[str, str]:
    try:
        tensors = list(getattr(model, "inputs", None) or [])
    except (AttributeError, ValueError):  # a model that was never called
        return {}
    names = io_names.input_names(model)
    return {name: str(getattr(t, "dtype", "")) for name, t in zip(names, tensors, strict=False)}


def _weights_at_start(model) -> dict:
    """``{"weights_at_start": {"checked", "nonfinite"}}``: every float weight
    checked once, on the host, before training (a NaN in a checkpoint or a
    pretrained table is then told apart from one the training made); {} when
    the model has no weights yet (built lazily in the first step)."""
    try:
        variables = [v for v in model.weights if keras.backend.is_float_dtype(v.dtype)]
        nonfinite = [variable_path(v) for v in variables if not np.isfinite(v.numpy()).all()]
    except Exception as error:  # noqa: BLE001 - evidence only: never stop the watch for it
        logger.warning("NanWatch could not check the weights before training: %r", error)
        return {}
    if not variables:
        return {}
    return {"weights_at_start": {"checked": len(variables), "nonfinite": nonfinite}}


def loss_from_logits(loss) -> bool | None:
    """Whether ``loss`` (a compiled loss or a custom loop's ``loss_fn``) reads
    logits: a loss object's ``from_logits``; a crossentropy named by a string
    reads probabilities; None when not known (differing losses, a function)."""
    if isinstance(loss, (list, tuple, dict)):
        values = {loss_from_logits(item) for item in tf.nest.flatten(loss)}
        return values.pop() if len(values) == 1 else None
    if isinstance(loss, str):
        return False if "crossentropy" in loss else None
    from_logits = getattr(loss, "from_logits", None)
    return from_logits if isinstance(from_logits, bool) else None
