"""The instrumented Keras train step: the only module that touches ``keras.src``.

:func:`instrument` replaces ``model.train_step`` (on the instance) by a copy
of Keras' own TensorFlow-backend step with the recorder's calls in it, and
rebuilds the train function; :func:`restore` undoes both.

The row hand-over: with one step per execution and one replica the step also
returns its statistics row under ``ROW_KEY``; the wrapped train function
takes it out of the outputs and gives it straight to the device record
(:meth:`~tb_nanwatch.record.in_step.device_record.DeviceRecord.hand_over`), so the host
needs no separate read of the device buffer and the row never reaches Keras'
logs or any callback.
"""

from __future__ import annotations

from collections.abc import Callable

import keras
import tensorflow as tf

from tb_nanwatch.record.in_step import step_vector
from tb_nanwatch.record.in_step.device_record import DeviceRecord
from tb_nanwatch.record.in_step.phase_stats import StepInputs
from tb_nanwatch.record.in_step.recorder import StepRecorder
from tb_nanwatch.record.in_step.unseen_variables import built_unseen, seen_creations

# The key under which the instrumented train step also returns the step's row.
ROW_KEY = "_nanwatch_row"


def is_compiled(model: keras.Model) -> bool:
    """Whether ``model`` was compiled with an optimizer (``fit`` can train it)."""
    return bool(getattr(model, "compiled", False)) and model.optimizer is not None


def steps_per_execution(model: keras.Model) -> int:
    return getattr(model, "steps_per_execution", 1) or 1


def overrides_train_step(model: keras.Model) -> bool:
    """Whether ``model``'s class has its own ``train_step`` (not instrumentable)."""
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    return type(model).train_step is not TensorFlowTrainer.train_step


def instrument(model: keras.Model, recorder: StepRecorder, compiled: Callable | None = None):
    """Makes ``model``'s train function run the recorded train step; returns it.

    ``compiled``: what an earlier call returned for the same recorder and
    the model unchanged since, reused as is: a later ``fit`` neither traces
    nor compiles the step again.
    """
    object.__setattr__(model, "train_step", lambda data: recorded_train_step(recorder, data))
    if compiled is None:
        model.make_train_function(force=True)
        compiled = _handing_over(model.train_function, recorder.device)
    model.train_function = compiled
    return compiled


def restore(model: keras.Model | None) -> None:
    """Gives ``model`` back its own train step and train function."""
    if model is not None and "train_step" in model.__dict__:
        del model.__dict__["train_step"]
        model.make_train_function(force=True)


def recorded_train_step(recorder: StepRecorder, data):
    """Keras' ``train_step`` (TensorFlow backend), with the recorder's calls."""
    from keras.src.losses import loss as loss_module
    from keras.src.trainers.data_adapters import data_adapter_utils

    model = recorder.model
    x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
    # Variables created up to the statistics (layers built now, a layer's own
    # state): tf.function will trace this step again (StepRecorder._trace_never_runs).
    with seen_creations() as created:
        with tf.GradientTape() as tape:
            with recorder.taps.recording(tape) as trace:
                if model._call_has_training_arg:
                    y_pred = model(x, training=True)
                else:
                    y_pred = model(x)
                if not created and not tf.executing_eagerly():
                    build_out_of_the_trace(model, y, y_pred)
                recorder.taps.install_loss_taps(y, y_pred)
                loss = model._compute_loss(
                    x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
                )
            # Under a strategy Keras divides each replica's loss by the replicas in
            # sync (for the gradients' sum); the record holds the loss Keras reports.
            reported = loss_module.unscale_loss_for_distribution(loss)
            model._loss_tracker.update_state(
                reported,
                sample_weight=tf.shape(next(i for i in tf.nest.flatten(x) if i is not None))[0],
            )
            scaled_loss = model.optimizer.scale_loss(loss) if model.optimizer is not None else loss
        weights = model.trainable_weights
        if weights:
            all_grads = tape.gradient(scaled_loss, list(weights) + recorder.watched_tensors(trace))
            grads = all_grads[: len(weights)]
        else:
            all_grads, grads = [], []
    inputs = StepInputs(
        trace,
        x,
        y,
        y_pred,
        reported,
        weights,
        all_grads,
        model.optimizer,
        data,
        model,
        bool(created),
    )
    pending = recorder.guarded(recorder.before_update, inputs)
    if pending is not None:
        grads = pending.weight_gradients
    if weights:
        model.optimizer.apply_gradients(zip(grads, weights, strict=False))
    row = None if pending is None else recorder.guarded(recorder.after_update, pending, weights)
    logs = model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
    one_row = recorder.steps_per_execution == 1 and step_vector.replicas_in_sync() == 1
    return {**logs, ROW_KEY: row} if row is not None and one_row else logs


def build_out_of_the_trace(model: keras.Model, y, y_pred) -> None:
    """Builds ``model``'s compiled loss and metrics and its optimizer as its
    first loss, ``compute_metrics`` and update would, but eagerly and hidden
    from the tf.function tracing the step.

    Without a distribution strategy Keras builds them inside the first trace
    of the train step; their variables make tf.function throw that trace away
    and trace the step again. Built here, the first trace is the one that
    runs: one whole trace of the step less before the first step. Nothing
    else changes: the same variables, initial values and names. Called only
    while no variable was created in this trace (unbuilt layers draw their
    initial values in it, as without NanWatch, and the trace is retraced).
    Whatever fails to build here is built in the trace, as without NanWatch.
    """
    from keras.src import backend

    if y is not None:
        for compiled in (
            getattr(model, "_compile_loss", None),
            getattr(model, "_compile_metrics", None),
        ):
            # As CompileLoss.__call__ and CompileMetrics.update_state build them.
            if compiled is not None and not compiled.built:
                if not built_unseen(lambda c=compiled: c.build(y, y_pred)):
                    return
    optimizer = model.optimizer
    weights = list(model.trainable_weights)
    if optimizer is None or optimizer.built or not weights:
        return

    def build_optimizer() -> None:
        with backend.name_scope(optimizer.name, caller=optimizer):  # as BaseOptimizer.apply
            optimizer.build(weights)
        optimizer.built = True

    built_unseen(build_optimizer)


def _handing_over(train_function, device: DeviceRecord):
    """Wraps Keras' train function: the step's row, returned under
    ``ROW_KEY``, goes to the device record and never reaches the logs."""

    def train_function_without_row(iterator):
        logs = train_function(iterator)
        if isinstance(logs, dict) and ROW_KEY in logs:
            logs = dict(logs)
            device.hand_over(logs.pop(ROW_KEY))
        return logs

    return train_function_without_row
