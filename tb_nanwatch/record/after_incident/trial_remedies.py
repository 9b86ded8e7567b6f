"""A remedy's change as a trial: the re-runs (:class:`Variant`) that try it.

The change is the remedy's catalogue entry's (``Remedy.trial``, a kind of
:mod:`tb_nanwatch.evidence.changes`); this module reads the kind, never the
remedy's id, so a new remedy that makes a known kind of change needs nothing
here:

* :class:`~tb_nanwatch.evidence.changes.OptimizerSettings`: the fresh
  optimizer's config changed (``clipnorm=1.0``, ``epsilon=1e-4``);
* :class:`~tb_nanwatch.evidence.changes.ScaleRate`: one re-run per factor, the
  rate of every step divided by it (run in turn by
  :mod:`tb_nanwatch.record.after_incident.trials`: the first that works is reported);
* :class:`~tb_nanwatch.evidence.changes.HoldRate`,
  :class:`~tb_nanwatch.evidence.changes.WarmUp`: the rate of each step;
* :class:`~tb_nanwatch.evidence.changes.DataTransform`: the batches, from
  statistics of the recorded ones: ``normalise_inputs`` puts a
  ``keras.layers.Normalization`` adapted on the recorded inputs (per feature:
  mean and variance over the rows) in front of the model,
  ``standardise_targets`` standardises each target with its recorded mean and
  standard deviation, ``drop_nonfinite_rows`` leaves out every row holding NaN/Inf;
* :class:`~tb_nanwatch.evidence.changes.Float32Policy`,
  :class:`~tb_nanwatch.evidence.changes.Float32Layer` (the one named layer),
  :class:`~tb_nanwatch.evidence.changes.FromLogits`,
  :class:`~tb_nanwatch.evidence.changes.ClipPredictions`,
  :class:`~tb_nanwatch.evidence.changes.OutputActivation` (the loss sees the
  activation of the outputs): the replica's model and loss (:mod:`tb_nanwatch.record.after_incident.trial_replica`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf

from tb_nanwatch.evidence import changes, remedies
from tb_nanwatch.record.after_incident.trial_replica import TrialSkipped, Variant


@dataclasses.dataclass(frozen=True)
class Recorded:
    """What a remedy's trial reads of the run: the recorded batches (each
    ``[x, y, sample_weight]``, y and sample_weight optional), the rate of the
    steps before the jump (None: not known) and the warm-up length."""

    batches: list[list]
    rate_before: float | None
    warmup_steps: int
    layer: str | None = None  # the layer that overflowed (the verdict's, else the incident's)
    # The activation raw outputs lack for the run's loss (remedies.expected_activation).
    output_activation: str = "softmax"


def change_of(remedy: str) -> changes.Change | None:
    """The change ``remedy``'s trial makes (its catalogue entry's); None for
    advice and for an id the catalogue does not know."""
    entry = remedies.CATALOGUE.get(remedy)
    return None if entry is None else entry.trial


def is_advice(remedy: str) -> bool:
    """A catalogued remedy without a trial (it is not listed among the trials)."""
    return remedy in remedies.CATALOGUE and change_of(remedy) is None


def can_try(change: object) -> bool:
    """Whether this module reads ``change``'s kind."""
    return type(change) in _VARIANTS


def variants(remedy: str, recorded: Recorded) -> list[Variant]:
    """The re-runs that try ``remedy``, in the order to run them (several:
    the first that works is the answer); TrialSkipped when it cannot apply."""
    change = change_of(remedy)
    if change is None or not can_try(change):
        raise TrialSkipped(f"{remedy} has no trial (advice)")
    return _VARIANTS[type(change)](change, recorded)


def partner(remedy: str) -> str | None:
    """The remedy tried together with ``remedy`` when it alone does not help
    (a data transform's partner), else None."""
    change = change_of(remedy)
    return change.partner if isinstance(change, changes.DataTransform) else None


def together(first: Variant, second: Variant) -> Variant:
    """Two data remedies at once: ``first``'s transform, then ``second``'s."""

    def transform(batch: list) -> list | None:
        batch = first.transform(batch) if first.transform else batch
        if batch is None or second.transform is None:
            return batch
        return second.transform(batch)

    return Variant(f"{first.setting} + {second.setting}", transform=transform)


# -- each kind of change --------------------------------------------------------------


def _settings(change: changes.OptimizerSettings, recorded: Recorded) -> list[Variant]:
    return [Variant(change.words, optimizer=tuple(change.settings))]


def _scaled(change: changes.ScaleRate, recorded: Recorded) -> list[Variant]:
    """The rate of every step divided by each factor."""
    return [_divided(factor) for factor in change.factors]


def _divided(factor: float) -> Variant:
    return Variant(f"lr x{1 / factor:g}", rate=lambda step, rate: rate / factor)


def _held(change: changes.HoldRate, recorded: Recorded) -> list[Variant]:
    held = recorded.rate_before
    if held is None:
        raise TrialSkipped("the rate before the jump is not known")
    return [Variant(f"lr held at {held:.3g}", rate=lambda step, rate: held)]


def _warmup(change: changes.WarmUp, recorded: Recorded) -> list[Variant]:
    steps = max(recorded.warmup_steps, 2)
    return [
        Variant(
            f"linear lr warm-up ({steps} steps)",
            rate=lambda step, rate: rate * min(1.0, (step + 1) / steps),
        )
    ]


def _float32(change: changes.Float32Policy, recorded: Recorded) -> list[Variant]:
    return [Variant("float32 policy", float32=True)]


def _float32_layer(change: changes.Float32Layer, recorded: Recorded) -> list[Variant]:
    if not recorded.layer:
        raise TrialSkipped("no layer is named for the overflow")
    return [Variant(f"layer {recorded.layer} in float32", float32_layers=(recorded.layer,))]


def _from_logits(change: changes.FromLogits, recorded: Recorded) -> list[Variant]:
    return [Variant("from_logits=True, final sigmoid/softmax removed", from_logits=True)]


def _clip_predictions(change: changes.ClipPredictions, recorded: Recorded) -> list[Variant]:
    return [
        Variant(
            f"predictions clipped to [{change.low:g}, {change.high:.7g}]",
            clip_predictions=(change.low, change.high),
        )
    ]


def _output_activation(change: changes.OutputActivation, recorded: Recorded) -> list[Variant]:
    activation = change.activation or recorded.output_activation
    return [Variant(f"{activation} on the outputs before the loss", output_activation=activation)]


def _transformed(change: changes.DataTransform, recorded: Recorded) -> list[Variant]:
    return [_TRANSFORMS[change.transform](recorded)]


def _drop_nonfinite_rows(recorded: Recorded) -> Variant:
    def transform(batch: list) -> list | None:
        keep = _finite_rows(batch)
        if keep is None or keep.all():
            return batch
        if not keep.any():
            return None
        return tf.nest.map_structure(lambda a: _rows(a, keep, len(keep)), batch)

    return Variant("rows holding NaN/Inf dropped", transform=transform)


def _normalise_inputs(recorded: Recorded) -> Variant:
    layers = _adapted([batch[0] for batch in recorded.batches])
    if not any(layer is not None for layer in layers):
        raise TrialSkipped("no float feature input to normalise")

    def transform(batch: list) -> list:
        leaves = tf.nest.flatten(batch[0])
        done = [a if n is None else np.asarray(n(a)) for a, n in zip(leaves, layers, strict=True)]
        return [tf.nest.pack_sequence_as(batch[0], done), *batch[1:]]

    return Variant(
        "inputs normalised (Normalization adapted on the recorded batches)", transform=transform
    )


def _standardise_targets(recorded: Recorded) -> Variant:
    if any(len(batch) < 2 or batch[1] is None for batch in recorded.batches):
        raise TrialSkipped("the batches hold no targets")
    scales = _standardisers([batch[1] for batch in recorded.batches])
    if not any(s is not None for s in scales):
        raise TrialSkipped("the targets are not float values")

    def transform(batch: list) -> list:
        leaves = tf.nest.flatten(batch[1])
        done = [a if s is None else (a - s[0]) / s[1] for a, s in zip(leaves, scales, strict=True)]
        return [batch[0], tf.nest.pack_sequence_as(batch[1], done), *batch[2:]]

    mean, std = next((s[0], s[1]) for s in scales if s is not None)
    return Variant(
        f"targets standardised (mean {np.mean(mean):.3g}, std {np.mean(std):.3g})",
        transform=transform,
    )


# The reader of each kind of change, and of each data transform.
_VARIANTS: dict[type, Callable[..., list[Variant]]] = {
    changes.OptimizerSettings: _settings,
    changes.ScaleRate: _scaled,
    changes.HoldRate: _held,
    changes.WarmUp: _warmup,
    changes.DataTransform: _transformed,
    changes.Float32Policy: _float32,
    changes.Float32Layer: _float32_layer,
    changes.FromLogits: _from_logits,
    changes.ClipPredictions: _clip_predictions,
    changes.OutputActivation: _output_activation,
}
_TRANSFORMS: dict[str, Callable[[Recorded], Variant]] = {
    "normalise_inputs": _normalise_inputs,
    "standardise_targets": _standardise_targets,
    "drop_nonfinite_rows": _drop_nonfinite_rows,
}


# -- statistics of the recorded batches --------------------------------------------


def _is_float(array: object) -> bool:
    return isinstance(array, np.ndarray) and np.issubdtype(array.dtype, np.floating)


def _finite_rows(batch: list) -> np.ndarray | None:
    """Rows whose float values are all finite (None: the batch has no rows)."""
    leaves = [a for a in tf.nest.flatten(batch) if isinstance(a, np.ndarray) and a.ndim]
    if not leaves:
        return None
    rows = len(leaves[0])
    keep = np.ones(rows, bool)
    for array in leaves:
        if _is_float(array) and len(array) == rows:
            keep &= np.isfinite(array.reshape(rows, -1)).all(axis=1)
    return keep


def _rows(array: object, keep: np.ndarray, rows: int) -> object:
    if isinstance(array, np.ndarray) and array.ndim and len(array) == rows:
        return array[keep]
    return array


def _stacked(parts: list) -> list[np.ndarray | None]:
    """Each float leaf's finite rows over all recorded batches (None: not float)."""
    columns = list(zip(*[tf.nest.flatten(p) for p in parts], strict=True))
    stacked = []
    for column in columns:
        if not all(_is_float(a) and a.ndim for a in column):
            stacked.append(None)
            continue
        rows = np.concatenate(column).astype(np.float64)
        finite = np.isfinite(rows.reshape(len(rows), -1)).all(axis=1)
        stacked.append(rows[finite] if finite.any() else None)
    return stacked


def _adapted(inputs: list) -> list:
    """A Normalization layer adapted on each float input (None for the others)."""
    layers = []
    for rows in _stacked(inputs):
        if rows is None:
            layers.append(None)
            continue
        layer = keras.layers.Normalization(axis=-1 if rows.ndim > 1 else None, dtype="float32")
        layer.adapt(rows.astype(np.float32))
        layers.append(layer)
    return layers


def _standardisers(targets: list) -> list[tuple[np.ndarray, np.ndarray] | None]:
    """(mean, std) of each float target over its rows (None for the others)."""
    scales = []
    for rows in _stacked(targets):
        if rows is None:
            scales.append(None)
            continue
        std = rows.std(axis=0)
        std = np.where(std > 0, std, 1.0)
        scales.append((rows.mean(axis=0).astype(np.float32), std.astype(np.float32)))
    return scales
