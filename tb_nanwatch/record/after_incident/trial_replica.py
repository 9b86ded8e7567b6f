"""The run a remedy trial trains: the user's own model and optimizer, with the remedy applied.

A :class:`Replica` trains **the user's model object itself** (every layer's
state as trained: an adapted ``keras.layers.Normalization``, BatchNorm's
moving statistics, custom layers, the ``SeedGenerator`` states that drive
dropout and noise), with **the user's loss** (a compiled model's own
``compute_loss``, or a custom loop's ``loss_fn``) and **the user's optimizer
object** (its own class, a custom learning-rate schedule included), from the
trial's :class:`Start` (the rewind point's or the bundle's state). A
:class:`Variant` says what the remedy changes: the learning rate (each step's,
through a rate variable swapped in for a schedule), optimizer settings
(``clipnorm``, ``epsilon``: set on the optimizer and undone by
:meth:`Replica.close`), the loss seeing the outputs clipped or through an
activation, the batches.

Two changes cannot run on the user's objects and use a copy of the model
(``keras.models.clone_model`` with the trained values and a fresh optimizer
from the recorded config), which the trial's setting says ("on a copy of the
model"): the float32 dtype policy and the loss reading logits (the final
sigmoid/softmax removed).

:class:`TrainedState` copies every variable of the model (``model.variables``,
seed states included, and its metrics' variables) and of the optimizer, and
the optimizer's learning-rate object and settings, before the trials (to a
temporary file when above ``rewind_memory_mb``); the trials restore it after
every trial and at the end, so the user's model and optimizer hold exactly
their trained state afterwards.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tb_nanwatch.record.after_incident.bundle import match_arrays
from tb_nanwatch.record.after_incident.rewind_file import write_arrays

_CROSSENTROPY = {
    "binary_crossentropy": keras.losses.BinaryCrossentropy,
    "bce": keras.losses.BinaryCrossentropy,
    "categorical_crossentropy": keras.losses.CategoricalCrossentropy,
    "sparse_categorical_crossentropy": keras.losses.SparseCategoricalCrossentropy,
}
_PROBABILITY_ACTIVATIONS = ("sigmoid", "softmax")
# The optimizer settings a trial may change (and TrainedState restores).
_SETTINGS = ("clipnorm", "clipvalue", "global_clipnorm", "epsilon")
COPY_NOTE = "on a copy of the model"


class TrialSkipped(Exception):
    """A trial that cannot run; its message is the ``not_tried`` reason."""


@dataclasses.dataclass(frozen=True)
class Variant:
    """What one trial changes; the defaults re-run the steps as recorded.

    ``rate``: the learning rate of each trial step from the recorded one
    (``rate(step, recorded) -> rate``). ``optimizer``: optimizer settings
    (``{"clipnorm": 1.0}``). ``clip_predictions``: the range the loss sees the
    predictions clipped to (None: not clipped). ``transform``: the batch a step
    trains on from the recorded one (None: the step is left out).
    ``output_activation``: the activation the loss sees the outputs through
    (``"softmax"``, ``"sigmoid"``; None: the outputs as they are).
    """

    setting: str = "as recorded"
    rate: Callable[[int, float], float] | None = None
    optimizer: tuple[tuple[str, Any], ...] = ()
    float32: bool = False
    from_logits: bool = False
    clip_predictions: tuple[float, float] | None = None
    transform: Callable[[list], list | None] | None = None
    output_activation: str | None = None
    # Layers (recorded paths, or names) the copy runs in float32, the rest in
    # the model's own policy.
    float32_layers: tuple[str, ...] = ()
    # Each trainable weight at the start times (1 +- start_noise), a fixed
    # pattern of signs: a rounding-level nudge that measures how far rounding
    # alone carries the re-run (the fidelity check's probe). 0: none.
    start_noise: float = 0.0

    @property
    def needs_copy(self) -> bool:
        """Whether the change cannot run on the user's model (a copy does)."""
        return self.float32 or self.from_logits or bool(self.float32_layers)


@dataclasses.dataclass
class Start:
    """Where a trial starts.

    ``weights``: recorded arrays by the trained model's variable paths (a
    repeated path numbered ``<path>#1``, ...): every variable (``every_variable``,
    a rewind point: ``model.variables``, seed states included, or in an older
    point ``model.weights``) or the trainable ones (a bundle).
    ``optimizer_state``: the optimizer's variables by path ({} when not
    recorded: a fresh state). ``optimizer_config``: the optimizer's Keras
    serialization, for a copy (None: from the optimizer object).
    """

    weights: dict[str, np.ndarray]
    every_variable: bool
    optimizer_state: dict[str, np.ndarray]
    optimizer_config: dict | None = None


@dataclasses.dataclass(frozen=True)
class StepResult:
    """One trial step: its loss, gradient norm, largest |output| and whether
    the loss and every weight stayed finite."""

    loss: float
    grad_norm: float
    logits: float
    finite: bool


class Replica:
    """One trial's run for one :class:`Variant`; see the module docstring.

    ``optimizer``: the user's optimizer object (None or a dict, its Keras
    serialization: a fresh one from it, when the object is not at hand).
    :meth:`close` undoes what the trial set on the user's optimizer; the
    variables are the caller's to restore (:class:`TrainedState`).
    """

    def __init__(
        self,
        model: keras.Model,
        loss_fn: Callable | None,
        start: Start,
        variant: Variant,
        optimizer: Any = None,
    ) -> None:
        self._undo: list[Callable[[], None]] = []
        self.copied = variant.needs_copy
        config = start.optimizer_config
        if isinstance(optimizer, dict):
            config, optimizer = config or optimizer, None
        if self.copied or optimizer is None:
            if config is None and optimizer is not None:
                config = optimizer_config(optimizer)
            if config is None:
                raise TrialSkipped("the optimizer is not known (record it with the bundle)")
            self.model = clone(model, variant) if self.copied else model
            if self.copied:
                self.model.set_weights(model.get_weights())  # what no record holds
            assign_start(model, self.model, start)
            self.optimizer = build_optimizer(config, variant)
            self.optimizer.build(self.model.trainable_variables)
            restore_optimizer(self.optimizer, start.optimizer_state)
        else:
            self.model = model
            assign_start(model, model, start)
            self.optimizer = optimizer
            if not getattr(optimizer, "built", True):
                optimizer.build(model.trainable_variables)
            if start.optimizer_state:
                restore_optimizer(optimizer, start.optimizer_state)
            else:
                fresh_state(optimizer, model)
            self._set_settings(variant)
        if variant.start_noise:
            nudge(self.model.trainable_variables, variant.start_noise)
        self.loss = trial_loss(model, self.model, loss_fn, variant)
        inner = inner_optimizer(self.optimizer)
        self.initial_rate = float(np.asarray(inner.learning_rate))
        self._rate = self._rate_variable(inner)
        # Compiled as the user's step is (XLA when fit's is), for the same numbers.
        self._jit = getattr(model, "jit_compile", False) is True and not self.copied
        self._step = tf.function(self._train_step, reduce_retracing=True, jit_compile=self._jit)
        self._ran = False
        self._xla_failed = ""  # why XLA could not compile the trial's step

    def _set_settings(self, variant: Variant) -> None:
        """The variant's optimizer settings on the user's optimizer (undone by close)."""
        inner = inner_optimizer(self.optimizer)
        for key, value in variant.optimizer:
            if not hasattr(inner, key):
                raise TrialSkipped(f"the optimizer has no {key}")
            old = getattr(inner, key)
            self._undo.append(lambda key=key, old=old: setattr(inner, key, old))
            setattr(inner, key, value)

    def _rate_variable(self, inner: keras.optimizers.Optimizer) -> Any:
        """The variable the trial sets each step's rate on: the optimizer's own,
        else (a schedule) one swapped in until :meth:`close`."""
        original = getattr(inner, "_learning_rate", None)
        if isinstance(original, keras.Variable):
            return original
        rate = keras.Variable(self.initial_rate, dtype="float32", trainable=False)
        # Past the optimizer's tracker: the variable must not join its variables.
        object.__setattr__(inner, "_learning_rate", rate)
        self._undo.append(lambda: object.__setattr__(inner, "_learning_rate", original))
        return rate

    def close(self) -> None:
        """Undoes what the trial set on the optimizer (settings, the rate)."""
        while self._undo:
            self._undo.pop()()

    @property
    def ran(self) -> bool:
        """Whether a step of this trial ran."""
        return self._ran

    @property
    def compiled(self) -> str:
        """How the trial's step ran: ``"xla"``, ``"graph"``, or ``"graph (...)"``
        saying why XLA, the user's compilation, was not used."""
        if self._jit:
            return "xla"
        if self._xla_failed:
            return f"graph (XLA could not compile the trial's step: {self._xla_failed})"
        return "graph"

    @property
    def rate(self) -> float:
        """The optimizer's learning rate at the start (a schedule's value at its iteration)."""
        return self.initial_rate

    def set_rate(self, rate: float) -> None:
        self._rate.assign(rate)

    def run(self, batch: list) -> StepResult:
        """One training step on ``batch`` (``[x, y, sample_weight]``, y and
        sample_weight optional)."""
        x, y, sample_weight = (list(batch) + [None, None])[:3]
        try:
            loss, norm, logits, finite = self._step(x, y, sample_weight)
        except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError) as error:
            if not self._jit or self._ran:
                raise
            # XLA cannot compile this step (it fails before it runs): without XLA.
            self._jit, self._xla_failed = False, short(error)
            self._step = tf.function(self._train_step, reduce_retracing=True)
            loss, norm, logits, finite = self._step(x, y, sample_weight)
        self._ran = True
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
        # The logits a sigmoid/softmax output was computed from, as the recorder
        # reads them: the probabilities never pass an explosion line.
        outputs = [
            tf.cast(getattr(t, "_keras_logits", t), tf.float32)
            for t in tf.nest.flatten(y_pred)
            if t.dtype.is_floating
        ]
        logits = tf.reduce_max([tf.reduce_max(tf.abs(t)) for t in outputs])
        weights = [v for v in self.model.weights if keras.backend.is_float_dtype(v.dtype)]
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(v)) for v in weights])
        return loss, norm, logits, tf.logical_and(finite, tf.math.is_finite(loss))


def nudge(variables: list, relative: float) -> None:
    """Each float variable times (1 +- ``relative``), the signs a fixed
    pseudo-random pattern (the same at every call)."""
    signs = np.random.RandomState(0)
    for variable in variables:
        if not keras.backend.is_float_dtype(variable.dtype):
            continue
        value = np.asarray(variable.numpy())
        pattern = signs.choice([-1.0, 1.0], size=value.shape).astype(value.dtype)
        variable.assign(value * (1 + relative * pattern))


def inner_optimizer(optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
    """The optimizer that holds the learning rate (a LossScaleOptimizer's inner one)."""
    return getattr(optimizer, "inner_optimizer", optimizer)


# -- the user's state: kept before the trials, restored after each -------------------


def model_variables(model: Any) -> list:
    """Every variable of ``model``: ``model.variables`` (Keras 3: the weights
    and the SeedGenerator states that drive dropout and noise), else its weights."""
    found = getattr(model, "variables", None)
    found = found() if callable(found) else found
    return list(found if found is not None else model.weights)


def optimizer_variables(optimizer: Any) -> list:
    """Its variables (a property in Keras 3, a method in older optimizers)."""
    if optimizer is None or isinstance(optimizer, dict):
        return []
    found = getattr(optimizer, "variables", [])
    return list(found() if callable(found) else found)


def keyed(variables: list) -> list[tuple[str, Any]]:
    """Each variable with its key: its path, a repeated path numbered
    ``<path>#1``, ... (as the rewind points' snapshots key them)."""
    out, seen = [], set()
    for v in variables:
        path = getattr(v, "path", None)
        name = path if isinstance(path, str) else v.name.split(":")[0]
        key, n = name, 1
        while key in seen:
            key, n = f"{name}#{n}", n + 1
        seen.add(key)
        out.append((key, v))
    return out


class TrainedState:
    """The trained state of the user's model and optimizer: every variable
    (the model's, its metrics', the optimizer's), the optimizer's
    learning-rate object and settings. :meth:`restore` puts it back.

    Up to ``max_bytes`` of variables (the trials pass ``rewind_memory_mb``;
    None: no limit) the values are held on the host. Above it they are
    written once, one variable at a time, to a file in a private temporary
    folder and read back one variable at a time at each :meth:`restore`:
    never a second full host copy of a large model. :meth:`close` removes
    the file.
    """

    def __init__(self, model: Any, optimizer: Any, max_bytes: int | None = None) -> None:
        variables = [*model_variables(model), *getattr(model, "metrics_variables", [])]
        variables += optimizer_variables(optimizer)
        seen: set[int] = set()
        self.variables = [v for v in variables if not (id(v) in seen or seen.add(id(v)))]
        self.values: list[np.ndarray] | None = None
        self.file: str | None = None
        size = sum(
            math.prod(int(d) for d in v.shape) * tf.as_dtype(v.dtype).size for v in self.variables
        )
        if max_bytes is None or size <= max_bytes:
            self.values = [np.array(v.numpy(), copy=True) for v in self.variables]
        else:
            folder = tempfile.mkdtemp(prefix="nanwatch-trained-")
            self.file = os.path.join(folder, "trained.npz")
            with open(self.file, "xb") as f:
                write_arrays(f, ((str(i), v.numpy()) for i, v in enumerate(self.variables)))
        holders = [] if optimizer is None or isinstance(optimizer, dict) else [optimizer]
        if holders and inner_optimizer(optimizer) is not optimizer:
            holders.append(inner_optimizer(optimizer))
        self.attributes = [
            (holder, name, getattr(holder, name))
            for holder in holders
            for name in ("_learning_rate", *_SETTINGS)
            if hasattr(holder, name)
        ]

    def restore(self) -> None:
        for holder, name, value in self.attributes:
            if getattr(holder, name) is not value:
                object.__setattr__(holder, name, value)
        if self.values is not None:
            for variable, value in zip(self.variables, self.values, strict=True):
                variable.assign(value)
            return
        with np.load(self.file, allow_pickle=False) as npz:
            for i, variable in enumerate(self.variables):
                variable.assign(npz[str(i)])

    def close(self) -> None:
        """Removes the file of a large state (never raises)."""
        if self.file is not None:
            shutil.rmtree(os.path.dirname(self.file), ignore_errors=True)
            self.file = None


def assign_start(source: keras.Model, target: keras.Model, start: Start) -> None:
    """``start``'s recorded arrays into ``target`` (``source`` itself, or its
    copy), matched by the keys ``source``'s variables have, else by position
    (a model rebuilt elsewhere names its variables differently): every
    variable, else (an older rewind point) the weights, or the trainable ones
    (a bundle)."""
    if start.every_variable:
        candidates = [(model_variables(source), model_variables(target))]
        candidates.append((list(source.weights), list(target.weights)))
    else:
        candidates = [(list(source.trainable_weights), list(target.trainable_weights))]
    errors = []
    for sources, targets in candidates:
        if len(sources) != len(targets):
            errors.append(f"{len(targets)} variables for {len(sources)}")
            continue
        try:
            pairs = match_arrays(start.weights, [key for key, _ in keyed(sources)], targets)
        except ValueError as error:
            errors.append(str(error))
            continue
        for variable, value in pairs:
            variable.assign(value)
        return
    raise TrialSkipped(f"the recorded weights do not fit the model ({errors[-1]})")


def fresh_state(optimizer: Any, model: keras.Model) -> None:
    """The user's optimizer's variables as a fresh optimizer of its config has
    them (a rewind point from before the first step recorded none); the
    learning-rate variables keep theirs."""
    rates = {
        id(getattr(o, "_learning_rate", None)) for o in (optimizer, inner_optimizer(optimizer))
    }
    targets = [v for v in optimizer_variables(optimizer) if id(v) not in rates]
    try:
        fresh = build_optimizer(optimizer_config(optimizer), Variant())
        fresh.build(model.trainable_variables)
        fresh_rates = {
            id(getattr(o, "_learning_rate", None)) for o in (fresh, inner_optimizer(fresh))
        }
        values = [v.numpy() for v in optimizer_variables(fresh) if id(v) not in fresh_rates]
        shapes = [tuple(v.shape) for v in targets] == [np.shape(a) for a in values]
    except Exception:  # noqa: BLE001 - an optimizer Keras cannot rebuild: zeros
        values, shapes = [], False
    if not shapes:
        values = [np.zeros(tuple(v.shape), v.dtype) for v in targets]
    for variable, value in zip(targets, values, strict=True):
        variable.assign(value)


def optimizer_config(optimizer: Any) -> dict:
    """The optimizer's Keras serialization; TrialSkipped when it has none."""
    try:
        return keras.optimizers.serialize(optimizer)
    except Exception as error:  # noqa: BLE001
        raise TrialSkipped(f"the optimizer cannot be copied ({short(error)})") from None


# -- the copy of the model -----------------------------------------------------------


def clone(model: keras.Model, variant: Variant) -> keras.Model:
    """A copy of ``model``'s structure: in float32 for ``variant.float32``,
    without a final sigmoid/softmax for ``variant.from_logits``."""
    if not (variant.float32 or variant.from_logits or variant.float32_layers):
        try:
            return keras.models.clone_model(model)
        except Exception as error:  # noqa: BLE001 - e.g. a subclassed model without get_config
            raise TrialSkipped(f"the model cannot be copied ({short(error)})") from None
    finals = {id(layer) for layer in final_layers(model)} if variant.from_logits else set()
    named = variant.float32_layers
    layers = model._flatten_layers(include_self=False, recursive=True)
    if named and not any(_named(layer, named) for layer in layers):
        raise TrialSkipped(f"the model has no layer {named[0]} to run in float32")

    def copy(layer: keras.layers.Layer) -> keras.layers.Layer:
        config = layer.get_config()
        if (variant.float32 or _named(layer, variant.float32_layers)) and "dtype" in config:
            config["dtype"] = "float32"
        if id(layer) in finals and config.get("activation") in _PROBABILITY_ACTIVATIONS:
            config["activation"] = "linear"
        return layer.__class__.from_config(config)

    try:
        return keras.models.clone_model(model, clone_function=copy, recursive=True)
    except Exception as error:  # noqa: BLE001
        raise TrialSkipped(f"the model cannot be copied ({short(error)})") from None


def _named(layer: keras.layers.Layer, paths: tuple[str, ...]) -> bool:
    """Whether ``layer`` is one of ``paths`` (a recorded path ends in its name)."""
    name = getattr(layer, "name", None)
    path = getattr(layer, "path", None) or name
    return any(p in (name, path) or p.rsplit("/", 1)[-1] == name for p in paths)


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
    rate = getattr(inner_optimizer(optimizer), "_learning_rate", None)
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
    """The run's loss (the custom loop's ``loss_fn``, else the compiled
    model's own ``compute_loss``) with the variant's loss changes: the outputs
    through ``output_activation``, clipped to ``clip_predictions``, and (on a
    copy) the loss reading logits."""
    seen = _outputs_seen(variant)
    if loss_fn is not None:
        fn = logits_loss(loss_fn) if variant.from_logits else loss_fn

        def custom(x, y, y_pred, sample_weight):
            extra = () if sample_weight is None else (sample_weight,)
            return fn(y, seen(y_pred), *extra)

        return custom
    loss = getattr(model, "loss", None)
    if loss is None and getattr(model, "_compile_loss", None) is None:
        raise TrialSkipped("no loss to train with (a compiled loss or loss_fn)")
    if replica is not model:
        if variant.from_logits:
            loss = tf.nest.map_structure(logits_loss, loss)
        weights = model.get_compile_config().get("loss_weights") if model.compiled else None
        replica.compile(optimizer="sgd", loss=loss, loss_weights=weights)

    def compiled(x, y, y_pred, sample_weight):
        return replica.compute_loss(
            x=x, y=y, y_pred=seen(y_pred), sample_weight=sample_weight, training=True
        )

    return compiled


def model_outputs(model: keras.Model) -> list:
    """The model's symbolic output tensors, flat; [] when it has none (a
    subclassed model that was never called)."""
    try:
        return tf.nest.flatten(getattr(model, "outputs", None) or [])
    except (AttributeError, ValueError):
        return []


def output_units(model: keras.Model) -> list[int | None]:
    """The last dimension of each model output (None: not known)."""
    units = []
    for tensor in model_outputs(model):
        shape = getattr(tensor, "shape", None)
        last = shape[-1] if shape is not None and len(shape) else None
        units.append(int(last) if last is not None else None)
    return units


def _outputs_seen(variant: Variant) -> Callable[[Any], Any]:
    """What the loss sees of the outputs: through the variant's activation, then clipped."""
    activation = None
    if variant.output_activation:
        try:
            activation = keras.activations.get(variant.output_activation)
        except ValueError as error:
            raise TrialSkipped(f"no activation {variant.output_activation!r} ({error})") from None
    bounds = variant.clip_predictions

    def seen(y_pred):
        if activation is not None:
            y_pred = tf.nest.map_structure(activation, y_pred)
        return _clip(y_pred, *bounds) if bounds else y_pred

    return seen


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
