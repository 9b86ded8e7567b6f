"""NaN and Inf counts that cost nothing on a healthy step: the count types.

An exact count needs a full pass over its tensor (``is_nan``, a cast, a sum)
and, at trace time, three ops per tensor and kind. A healthy step needs
neither: every count is 0 there. So a count is a :class:`LazyCount`, a
promise rather than ops: its source tensors and a *trigger*, one float32
scalar the entry computes anyway that is non-finite whenever a source holds a
NaN or an Inf. :meth:`~tb_nanwatch.record.in_step.step_vector.StatsBuilder.vector` has
the step's statistics backend (:mod:`tb_nanwatch.record.stats`) compute every
lazy count at once, only on a step where a trigger is non-finite.

Under XLA the statistics take most counts in their own pass instead: a
:class:`TakenCount` each (see ``XlaStats.counted_in_pass``).
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

# 64 KiB of float32: a tensor this large is let go of early (see
# GraphStats.held_if_non_finite) and, under XLA, counted in a chunk of its own.
HOLD_MIN_ELEMENTS = 16384
KINDS = ("nan", "inf")
INF_UNIT = 2**32
# An entry of this many elements or more could overflow its packed NaN count.
PACKED_MAX_ELEMENTS = INF_UNIT
# See XlaStats.counts_in_chunks: about this many conditionals at most for XLA
# to compile; as few entries a conditional (kept alive until the last one is
# read) as that allows.
XLA_MAX_CONDITIONALS = 48


@dataclasses.dataclass(frozen=True, eq=False)
class LazyCount:
    """The NaN (``kind="nan"``) or Inf count of ``sources``, computed only
    when ``trigger`` is non-finite (and known to be 0 otherwise)."""

    kind: str
    sources: tuple
    trigger: tf.Tensor
    # Whether a source is an activation or gradient large enough that the
    # step would otherwise free it before its end (see transient_counts_of).
    transient: bool = False


@dataclasses.dataclass(frozen=True, eq=False)
class TakenCount:
    """The NaN (``kind="nan"``) or Inf count of one or more tensors, taken
    already: ``value``, an int32 scalar (see ``XlaStats.counted_in_pass``).
    The statistics builder casts all of a step's at once."""

    kind: str
    value: tf.Tensor


def counts_of(sources, trigger_value: tf.Tensor, transient: bool = False) -> dict[str, LazyCount]:
    """``{"nan": ..., "inf": ...}``: the lazy counts of ``sources`` on ``trigger_value``."""
    return {kind: LazyCount(kind, tuple(sources), trigger_value, transient) for kind in KINDS}


def taken_counts_of(nan: tf.Tensor, inf: tf.Tensor) -> dict[str, TakenCount]:
    """``{"nan": ..., "inf": ...}`` of two int32 counts."""
    return {"nan": TakenCount("nan", nan), "inf": TakenCount("inf", inf)}


def worth_letting_go(t: tf.Tensor) -> bool:
    """Whether ``t`` is large enough (or of unknown size) that keeping it to
    the end of the step costs more than the ops that let go of it."""
    size = t.shape.num_elements()
    return size is None or size >= HOLD_MIN_ELEMENTS


def scalar_total(values: list[tf.Tensor]) -> tf.Tensor:
    """The sum of one or more scalars of one dtype, never as an ``AddN`` of more
    than two inputs.

    For each such ``AddN`` in a graph, Grappler's memory optimizer simulates
    the whole step's memory use, and it rewrites those whose inputs are live
    at the simulated peak into a temporary variable with one ``AssignAdd`` per
    input, simulating again after each rewrite. With one ``AddN`` over a
    ResNet50's gradient norms that took 1.4 s of a first step instead of 0.6.
    ``Pack`` + ``Sum`` is the same sum in two ops.
    """
    if len(values) == 1:
        return values[0]
    if len(values) == 2:
        return values[0] + values[1]
    return tf.reduce_sum(tf.stack(values))


def signature(tensors: list) -> tuple:
    """The dtypes and (static) shapes of ``tensors``: what a traced function is specialized to."""
    return tuple(
        (t.dtype.name, tuple(t.shape.as_list()) if t.shape.rank is not None else None)
        for t in tensors
    )


def unique(tensors: list) -> list:
    """``tensors`` without repeats (by identity), in order."""
    seen, out = set(), []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out
