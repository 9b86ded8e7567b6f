"""The copy of the model a remedy trial trains, with the remedy applied.

A :class:`Replica` is a clone of the trained model (``keras.models.clone_model``,
recursively, so nested models are copied too) holding the recorded weights,
with a fresh optimizer built from the recorded optimizer's config (never the
user's optimizer object) and its recorded state, and the run's loss (a
compiled model's own loss, or a custom loop's ``loss_fn``). A :class:`Variant`
says what the remedy changes: the learning rate, the optimizer's config, the
layers' dtype policy, the loss reading logits or clipped predictions, the
batches. The trained model is never touched: only its config and weights are
read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tb_nanwatch.record.after_incident.bundle import match_arrays

_CROSSENTROPY = {
    "binary_crossentropy": keras.losses.BinaryCrossentropy,
    "bce": keras.losses.BinaryCrossentropy,
    "categorical_crossentropy": keras.losses.CategoricalCrossentropy,
    "sparse_categorical_crossentropy": keras.losses.SparseCategoricalCrossentropy,
}
_PROBABILITY_ACTIVATIONS = ("sigmoid", "softmax")


class TrialSkipped(Exception):
    """A trial that cannot run; its message is the ``not_tried`` reason."""


@dataclasses.dataclass(frozen=True)
class Variant:
    """What one trial changes; the defaults re-run the steps as recorded.

    ``rate``: the learning rate of each trial step from the recorded one
    (``rate(step, recorded) -> rate``). ``optimizer``: changes to the
    optimizer's config (``{"clipnorm": 1.0}``). ``clip_predictions``: the
    range the loss sees the predictions clipped to (None: not clipped).
    ``transform``: the batch a step trains on from the recorded one (None:
    the step is left out).
    """

    setting: str = "as recorded"
    rate: Callable[[int, float], float] | None = None
    optimizer: tuple[tuple[str, Any], ...] = ()
    float32: bool = False
    from_logits: bool = False
    clip_predictions: tuple[float, float] | None = None
    transform: Callable[[list], list | None] | None = None


@dataclasses.dataclass
class Start:
    """Where a trial starts.

    ``weights``: recorded arrays by the trained model's variable paths: every
    variable (``every_variable``, a rewind point) or the trainable ones (a
    bundle). ``optimizer_state``: the optimizer's variables by path ({} when
    not recorded: a fresh state). ``optimizer_config``: the optimizer's Keras
    serialization.
    """

    weights: dict[str, np.ndarray]
    every_variable: bool
    optimizer_state: dict[str, np.ndarray]
    optimizer_config: dict


@dataclasses.dataclass(frozen=True)
class StepResult:
    """One trial step: its loss, gradient norm, largest |output| and whether
    the loss and every weight stayed finite."""

    loss: float
    grad_norm: float
    logits: float
    finite: bool


class Replica:
    """A trainable copy of ``model`` for one :class:`Variant`; see the module docstring."""

    def __init__(
        self, model: keras.Model, loss_fn: Callable | None, start: Start, variant: Variant
    ) -> None:
        self.model = clone(model, variant)
        self.model.set_weights(model.get_weights())  # what no record holds (BN statistics)
        sources = model.weights if start.every_variable else model.trainable_weights
        targets = self.model.weights if start.every_variable else self.model.trainable_weights
        for variable, value in match_arrays(start.weights, [v.path for v in sources], targets):
            variable.assign(value)
        self.optimizer = build_optimizer(start.optimizer_config, variant)
        self.optimizer.build(self.model.trainable_variables)
        restore_optimizer(self.optimizer, start.optimizer_state)
        self.loss = trial_loss(model, self.model, loss_fn, variant)
        self._step = tf.function(self._train_step, reduce_retracing=True)

    @property
    def rate(self) -> float:
        """The optimizer's learning rate now (a schedule's value at its iteration)."""
        return float(_inner(self.optimizer).learning_rate)

    def set_rate(self, rate: float) -> None:
        _inner(self.optimizer).learning_rate.assign(rate)

    def run(self, batch: list) -> StepResult:
        """One training step on ``batch`` (``[x, y, sample_weight]``, y and
        sample_weight optional)."""
        x, y, sample_weight = (list(batch) + [None, None])[:3]
        loss, norm, logits, finite = self._step(x, y, sample_weight)
        return StepResult(float(loss), float(norm), float(logits), bool(finite))

    def _train_step(self, x, y, sample_weight):
        variables = self.model.trainable_variables
        with tf.GradientTape() as tape:
            y_pred = self.model(x, training=True)
            loss = tf.cast(self.loss(x, y, y_pred, sample_weight), tf.float32)
            scaled = self.optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, variables)
        pairs = [(g, v) for g, v in zip(grads, variables, strict=True) if g is not None]
        self.optimizer.apply_gradients(pairs)
        norm = tf.linalg.global_norm([tf.cast(g, tf.float32) for g, _ in pairs])
        scale = getattr(self.optimizer, "dynamic_scale", None)
        if scale is not None:
            norm = norm / tf.cast(scale, tf.float32)
        outputs = [tf.cast(t, tf.float32) for t in tf.nest.flatten(y_pred) if t.dtype.is_floating]
        logits = tf.reduce_max([tf.reduce_max(tf.abs(t)) for t in outputs])
        weights = [v for v in self.model.weights if keras.backend.is_float_dtype(v.dtype)]
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(v)) for v in weights])
        return loss, norm, logits, tf.logical_and(finite, tf.math.is_finite(loss))


def _inner(optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
    """The optimizer that holds the learning rate (a LossScaleOptimizer's inner one)."""
    return getattr(optimizer, "inner_optimizer", optimizer)


# -- the copy of the model -----------------------------------------------------------


def clone(model: keras.Model, variant: Variant) -> keras.Model:
    """A copy of ``model``'s structure: in float32 for ``variant.float32``,
    without a final sigmoid/softmax for ``variant.from_logits``."""
    if not (variant.float32 or variant.from_logits):
        try:
            return keras.models.clone_model(model)
        except Exception as error:  # noqa: BLE001 - e.g. a subclassed model without get_config
            raise TrialSkipped(f"the model cannot be copied ({short(error)})") from None
    finals = {id(layer) for layer in final_layers(model)} if variant.from_logits else set()

    def copy(layer: keras.layers.Layer) -> keras.layers.Layer:
        config = layer.get_config()
        if variant.float32 and "dtype" in config:
            config["dtype"] = "float32"
        if id(layer) in finals and config.get("activation") in _PROBABILITY_ACTIVATIONS:
            config["activation"] = "linear"
        return layer.__class__.from_config(config)

    try:
        return keras.models.clone_model(model, clone_function=copy, recursive=True)
    except Exception as error:  # noqa: BLE001
        raise TrialSkipped(f"the model cannot be copied ({short(error)})") from None


def final_layers(model: keras.Model) -> list[keras.layers.Layer]:
    """The layers that make ``model``'s outputs, through nested models."""
    outputs = getattr(model, "outputs", None) or []
    layers = [t._keras_history.operation for t in outputs if hasattr(t, "_keras_history")]
    if not layers and getattr(model, "layers", None):
        layers = [model.layers[-1]]
    found = []
    for layer in layers:
        is_model = isinstance(layer, keras.Model) and layer is not model
        found += final_layers(layer) if is_model else [layer]
    return found


def short(error: Exception) -> str:
    """An error in one short line (a trial's ``why``)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    # A tf.function's error: "in user code:", the frames, then the error itself.
    line = lines[-1] if lines and lines[0] == "in user code:" else (lines or [""])[0]
    name = type(error).__name__
    return (line if line.startswith(f"{name}: ") else f"{name}: {line}")[:200]


# -- the optimizer -----------------------------------------------------------------


def build_optimizer(config: dict, variant: Variant) -> keras.optimizers.Optimizer:
    """A fresh optimizer from ``config`` with ``variant``'s changes; a constant
    learning rate (a trial sets the rate of each step itself)."""
    config = dict(config)
    if variant.float32 and config.get("class_name") == "LossScaleOptimizer":
        config = dict(config["config"]["inner_optimizer"])
    body = dict(config.get("config", {}))
    if config.get("class_name") == "LossScaleOptimizer":
        inner = dict(body["inner_optimizer"])
        inner["config"] = _changed(dict(inner["config"]), variant)
        body["inner_optimizer"] = inner
    else:
        body = _changed(body, variant)
    return keras.optimizers.deserialize({**config, "config": body})


def _changed(body: dict, variant: Variant) -> dict:
    if isinstance(body.get("learning_rate"), dict):
        body["learning_rate"] = 0.0  # the trial sets each step's rate
    for key, value in variant.optimizer:
        if key not in body:
            raise TrialSkipped(f"the optimizer has no {key}")
        body[key] = value
    return body


def restore_optimizer(optimizer: keras.optimizers.Optimizer, state: dict[str, np.ndarray]) -> None:
    """The recorded optimizer variables into ``optimizer``'s, matched by path,
    else by position: all of them, or the group under one optimizer name (a
    LossScaleOptimizer's inner one), into all of the fresh optimizer's
    variables or all but its learning rate (a schedule has no variable)."""
    if not state:
        return
    variables = list(optimizer.variables)
    rate = getattr(_inner(optimizer), "_learning_rate", None)
    without_rate = [v for v in variables if v is not rate]
    groups: dict[str, dict[str, np.ndarray]] = {}
    for path, value in state.items():
        groups.setdefault(path.split("/")[0], {})[path] = value
    for candidate in [state, *groups.values()]:
        for targets in (variables, without_rate):
            try:
                pairs = match_arrays(candidate, list(candidate), targets)
            except ValueError:
                continue
            for variable, value in pairs:
                variable.assign(value)
            return
    raise TrialSkipped("the recorded optimizer state does not fit a fresh optimizer")


# -- the loss ----------------------------------------------------------------------

LossOf = Callable[[Any, Any, Any, Any], Any]  # (x, y, y_pred, sample_weight) -> loss


def trial_loss(
    model: keras.Model, replica: keras.Model, loss_fn: Callable | None, variant: Variant
) -> LossOf:
    """The run's loss for the replica, with the variant's loss changes."""
    bounds = variant.clip_predictions
    clip = (lambda y_pred: _clip(y_pred, *bounds)) if bounds else (lambda y_pred: y_pred)
    if loss_fn is not None:
        fn = logits_loss(loss_fn) if variant.from_logits else loss_fn

        def custom(x, y, y_pred, sample_weight):
            extra = () if sample_weight is None else (sample_weight,)
            return fn(y, clip(y_pred), *extra)

        return custom
    loss = getattr(model, "loss", None)
    if loss is None:
        raise TrialSkipped("no loss to train with (a compiled loss or loss_fn)")
    if variant.from_logits:
        loss = tf.nest.map_structure(logits_loss, loss)
    weights = model.get_compile_config().get("loss_weights") if model.compiled else None
    replica.compile(optimizer="sgd", loss=loss, loss_weights=weights)

    def compiled(x, y, y_pred, sample_weight):
        return replica.compute_loss(
            x=x, y=y, y_pred=clip(y_pred), sample_weight=sample_weight, training=True
        )

    return compiled


def _clip(y_pred, low: float, high: float):
    return tf.nest.map_structure(lambda t: tf.clip_by_value(t, low, high), y_pred)


def logits_loss(loss: Any) -> Any:
    """The crossentropy ``loss`` reading logits, or TrialSkipped."""
    if isinstance(loss, str) and loss in _CROSSENTROPY:
        return _CROSSENTROPY[loss](from_logits=True)
    if isinstance(loss, keras.losses.Loss) and isinstance(getattr(loss, "from_logits", None), bool):
        return type(loss).from_config({**loss.get_config(), "from_logits": True})
    name = loss if isinstance(loss, str) else getattr(loss, "__name__", type(loss).__name__)
    raise TrialSkipped(f"the loss {name} has no from_logits to set")
