"""tf_keras (Keras 2) models under NanWatch: the instrumented train step.

``NanWatch`` is a Keras 3 callback; ``fit`` of a ``tf_keras`` model (with
``TF_USE_LEGACY_KERAS=1``, ``tf.keras`` is ``tf_keras``) calls it too. For such
a model the callback uses this module in place of
:mod:`~tb_nanwatch.record.in_step.train_step`: the same recorder, taps and record, in
a copy of tf_keras' own ``train_step`` with the recorder's calls. Nothing here
imports ``tf_keras``: a model is a tf_keras one only when the package is
already imported (:func:`is_legacy_model`).

What does not work under tf_keras, said once per callback
(:data:`NOT_UNDER_TF_KERAS`): each output's own loss entry (the total is
recorded), the remedy trials and the rewind points (they need a Keras 3
model), the replay that names the op.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import tensorflow as tf

from tb_nanwatch.record.in_step.phase_stats import StepInputs
from tb_nanwatch.record.in_step.recorder import StepRecorder
from tb_nanwatch.record.in_step.unseen_variables import seen_creations

NOT_UNDER_TF_KERAS = (
    "each output's own loss (the total loss is recorded), the rewind points and remedy "
    "trials (they need a Keras 3 model) and the replay that names the op"
)


def _tf_keras():
    return sys.modules.get("tf_keras")


def is_legacy_model(model) -> bool:
    """Whether ``model`` is a ``tf_keras`` model (never imports tf_keras)."""
    module = _tf_keras()
    return module is not None and isinstance(model, module.Model)


def is_compiled(model) -> bool:
    return bool(getattr(model, "_is_compiled", False)) and model.optimizer is not None


def overrides_train_step(model) -> bool:
    """Whether ``model``'s class has its own ``train_step`` (not instrumentable)."""
    return type(model).train_step is not _tf_keras().Model.train_step


def steps_per_execution(model) -> int:
    value = getattr(model, "_steps_per_execution", None)
    return int(value.numpy()) if value is not None else 1


def instrument(model, recorder: StepRecorder, compiled: Callable | None = None):
    """Makes ``model``'s train function run the recorded train step; returns it
    (``compiled``: an earlier return for the same recorder, reused)."""
    object.__setattr__(model, "train_step", lambda data: recorded_train_step(recorder, data))
    if compiled is None:
        compiled = model.make_train_function(force=True)
    model.train_function = compiled
    return compiled


def restore(model) -> None:
    """Gives ``model`` back its own train step and train function."""
    if model is not None and "train_step" in model.__dict__:
        del model.__dict__["train_step"]
        model.make_train_function(force=True)


def _is_loss_scaler(optimizer) -> bool:
    return hasattr(optimizer, "get_scaled_loss") and hasattr(optimizer, "get_unscaled_gradients")


def recorded_train_step(recorder: StepRecorder, data):
    """tf_keras' ``Model.train_step``, with the recorder's calls."""
    model = recorder.model
    optimizer = model.optimizer
    x, y, sample_weight = _tf_keras().utils.unpack_x_y_sample_weight(data)
    scaler = _is_loss_scaler(optimizer)
    with seen_creations() as created:
        with tf.GradientTape() as tape:
            with recorder.taps.recording(tape) as trace:
                y_pred = model(x, training=True)
                loss = model.compute_loss(x, y, y_pred, sample_weight)
            scaled = optimizer.get_scaled_loss(loss) if scaler else loss
        validate = getattr(model, "_validate_target_and_loss", None)  # tf_keras' own check
        if validate is not None:
            validate(y, loss)
        weights = list(model.trainable_variables)
        all_grads = tape.gradient(scaled, weights + recorder.watched_tensors(trace))
    inputs = StepInputs(
        trace, x, y, y_pred, loss, weights, all_grads, optimizer, data, model, bool(created)
    )
    pending = recorder.guarded(recorder.before_update, inputs)
    grads = pending.weight_gradients if pending is not None else all_grads[: len(weights)]
    if scaler:
        grads = optimizer.get_unscaled_gradients(grads)
    optimizer.apply_gradients(zip(grads, weights, strict=True))
    if pending is not None:
        recorder.guarded(recorder.after_update, pending, weights)
    return model.compute_metrics(x, y, y_pred, sample_weight)
