"""Each remedy as a trial: what it changes in the re-run (a :class:`Variant`).

The data remedies read statistics of the recorded batches: ``normalize_inputs``
puts a ``keras.layers.Normalization`` adapted on the recorded inputs (per
feature: mean and variance over the rows) in front of the model,
``scale_targets`` standardises each target with its recorded mean and
standard deviation, ``drop_bad_rows`` leaves out every row holding NaN/Inf.
The optimizer remedies change the fresh optimizer's config (``clipnorm=1.0``,
``epsilon=1e-4``), the schedule remedies the rate of each step. ``lower_lr``
is a search over several factors, run by :mod:`tb_nanwatch.record.after_incident.trials`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf

from tb_nanwatch.record.after_incident.trial_replica import (
    CLIP_HIGH,
    CLIP_LOW,
    TrialSkipped,
    Variant,
)

CLIPNORM = 1.0
EPSILON = 1e-4
# lower_lr tries these factors in turn and reports the first that works.
LOWER_LR_FACTORS = (10, 100, 1000)


@dataclasses.dataclass(frozen=True)
class Recorded:
    """What a remedy's trial reads of the run: the recorded batches (each
    ``[x, y, sample_weight]``, y and sample_weight optional), the rate of the
    steps before the jump (None: not known) and the warm-up length."""

    batches: list[list]
    rate_before: float | None
    warmup_steps: int


def variant(remedy: str, recorded: Recorded) -> Variant:
    """The re-run that tries ``remedy``; TrialSkipped when it cannot apply."""
    fixed = _FIXED.get(remedy)
    if fixed is not None:
        return fixed
    build = _BUILT.get(remedy)
    if build is None:
        raise TrialSkipped(f"{remedy} has no trial (advice)")
    return build(recorded)


# The data remedies that may need each other (inputs and targets both unscaled).
DATA_PARTNERS = {"normalize_inputs": "scale_targets", "scale_targets": "normalize_inputs"}


def together(first: Variant, second: Variant) -> Variant:
    """Two data remedies at once: ``first``'s transform, then ``second``'s."""

    def transform(batch: list) -> list | None:
        batch = first.transform(batch) if first.transform else batch
        if batch is None or second.transform is None:
            return batch
        return second.transform(batch)

    return Variant(f"{first.setting} + {second.setting}", transform=transform)


def lower_lr(factor: int) -> Variant:
    """The rate of every step divided by ``factor``."""
    return Variant(f"lr x{1 / factor:g}", rate=lambda step, rate: rate / factor)


_FIXED = {
    "clip_gradients": Variant(
        f"clipnorm={CLIPNORM}", optimizer=(("clipnorm", CLIPNORM), ("global_clipnorm", None))
    ),
    "raise_epsilon": Variant(f"epsilon={EPSILON:g}", optimizer=(("epsilon", EPSILON),)),
    "float32_policy": Variant("float32 policy", float32=True),
    "from_logits": Variant("from_logits=True, final sigmoid/softmax removed", from_logits=True),
    "clip_predictions": Variant(
        f"predictions clipped to [{CLIP_LOW:g}, {CLIP_HIGH:.7g}]", clip_predictions=True
    ),
}


def _fix_schedule(recorded: Recorded) -> Variant:
    held = recorded.rate_before
    if held is None:
        raise TrialSkipped("the rate before the jump is not known")
    return Variant(f"lr held at {held:.3g}", rate=lambda step, rate: held)


def _warmup(recorded: Recorded) -> Variant:
    steps = max(recorded.warmup_steps, 2)
    return Variant(
        f"linear lr warm-up ({steps} steps)",
        rate=lambda step, rate: rate * min(1.0, (step + 1) / steps),
    )


def _drop_bad_rows(recorded: Recorded) -> Variant:
    def transform(batch: list) -> list | None:
        keep = _finite_rows(batch)
        if keep is None or keep.all():
            return batch
        if not keep.any():
            return None
        return tf.nest.map_structure(lambda a: _rows(a, keep, len(keep)), batch)

    return Variant("rows holding NaN/Inf dropped", transform=transform)


def _normalize_inputs(recorded: Recorded) -> Variant:
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


def _scale_targets(recorded: Recorded) -> Variant:
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


_BUILT: dict[str, Callable[[Recorded], Variant]] = {
    "fix_schedule": _fix_schedule,
    "lr_warmup": _warmup,
    "drop_bad_rows": _drop_bad_rows,
    "normalize_inputs": _normalize_inputs,
    "scale_targets": _scale_targets,
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
