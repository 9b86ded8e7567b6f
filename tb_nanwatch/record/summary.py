"""Scalars-dashboard summaries of finiteness, for your own ``tf.summary`` code.

Public API (``tb_nanwatch.summary``). Unlike a TensorBoard plugin's usual
``summary.py``, which writes the plugin's own data, this module writes
ordinary scalars for TensorBoard's Scalars dashboard; the NaN Watch tab's
data is recorded by :class:`~tb_nanwatch.record.callback.NanWatch` and
:class:`~tb_nanwatch.record.custom_loop.StepWatcher`, not by these.

Each function computes its statistics with plain TensorFlow ops (float32, no
``check_numerics``, no ``py_function``), writes them as ordinary scalar
summaries to the default summary writer (they appear in TensorBoard's
Scalars dashboard under ``<name>/...``) and returns them, so they can also
steer your own logic::

    writer = tf.summary.create_file_writer("logs/run/custom")
    with writer.as_default(step=step):
        ok = tb_nanwatch.summary.finite_check("encoder/out", h)
        tb_nanwatch.summary.logit_extremes("logits", logits)
        tb_nanwatch.summary.grad_norms("grads", grads, model.trainable_variables)

Like every ``tf.summary`` op they write only inside ``writer.as_default()``
(and, with ``step=None``, need ``tf.summary.experimental.set_step`` or
``as_default(step=...)``). They run inside ``tf.function``; summary ops
cannot be compiled by XLA, so keep them out of a ``jit_compile=True``
function (return the tensors and write them outside).
"""

from __future__ import annotations

import tensorflow as tf

from tb_nanwatch.record.stats import backend, choose
from tb_nanwatch.record.stats.lazy_counts import scalar_total

__all__ = ["finite_check", "logit_extremes", "grad_norms"]


def _flat(values) -> list[tf.Tensor]:
    out = []
    for t in tf.nest.flatten(values):
        if t is None:
            continue
        if isinstance(t, tf.IndexedSlices):
            t = t.values
        out.append(tf.convert_to_tensor(t))
    return out


@tf.autograph.experimental.do_not_convert
def finite_check(name: str, tensor, step=None) -> tf.Tensor:
    """Writes ``<name>/nan_count`` and ``<name>/inf_count``; returns a scalar
    bool tensor, True when every element of ``tensor`` (a tensor or a nested
    structure of tensors) is finite."""
    tensors = [t for t in _flat(tensor) if t.dtype.is_floating]
    stats = choose.for_current_graph()
    zero = tf.constant(0.0)
    nan = stats.exact_total("nan", tensors) if tensors else zero
    inf = stats.exact_total("inf", tensors) if tensors else zero
    tf.summary.scalar(f"{name}/nan_count", nan, step=step)
    tf.summary.scalar(f"{name}/inf_count", inf, step=step)
    return tf.equal(nan + inf, 0.0)


@tf.autograph.experimental.do_not_convert
def logit_extremes(name: str, logits, step=None) -> tuple[tf.Tensor, tf.Tensor]:
    """Writes ``<name>/min``, ``<name>/max`` and ``<name>/abs_max`` of
    ``logits`` (a NaN anywhere makes them NaN, which is the point); returns
    ``(min, max)`` as float32 scalars."""
    tensors = [tf.cast(t, tf.float32) for t in _flat(logits)]
    if not tensors:
        raise ValueError("logit_extremes needs at least one tensor")
    stats = choose.for_current_graph()
    low, high = backend.overall_extremes([stats.low_high(t) for t in tensors])
    # reduce_min/max skip NaN on some kernels: make a NaN visible.
    poisoned = stats.exact_total("nan", tensors) > 0
    nan = tf.constant(float("nan"))
    low = tf.where(poisoned, nan, low)
    high = tf.where(poisoned, nan, high)
    tf.summary.scalar(f"{name}/min", low, step=step)
    tf.summary.scalar(f"{name}/max", high, step=step)
    tf.summary.scalar(f"{name}/abs_max", tf.maximum(tf.abs(low), tf.abs(high)), step=step)
    return low, high


@tf.autograph.experimental.do_not_convert
def grad_norms(name: str, grads, variables=None, step=None, per_variable: bool = True) -> tf.Tensor:
    """Writes the global gradient norm ``<name>/global_norm``, the number of
    non-finite gradient elements ``<name>/nonfinite_count`` and, with
    ``per_variable``, ``<name>/<variable path>`` for each gradient; returns
    the global norm (float32; NaN/Inf when a gradient is). ``None``
    gradients count as zero; ``variables`` (same order) only name them."""
    grads = list(grads)
    if variables is not None:
        variables = list(variables)
        if len(variables) != len(grads):
            raise ValueError(
                f"grad_norms got {len(grads)} gradients but {len(variables)} variables"
            )
    stats = choose.for_current_graph()
    squares, nonfinite_counts = [], []
    for i, g in enumerate(grads):
        if g is None:
            continue
        if isinstance(g, tf.IndexedSlices):
            g = g.values
        sq = stats.sum_squares(g)
        squares.append(sq)
        nonfinite_counts.append(stats.exact_count("nan", g) + stats.exact_count("inf", g))
        if per_variable:
            label = _variable_name(variables[i]) if variables is not None else f"grad_{i}"
            tf.summary.scalar(f"{name}/{label}", tf.sqrt(sq), step=step)
    zero = tf.constant(0.0)
    norm = tf.sqrt(scalar_total(squares)) if squares else zero
    tf.summary.scalar(f"{name}/global_norm", norm, step=step)
    tf.summary.scalar(
        f"{name}/nonfinite_count",
        scalar_total(nonfinite_counts) if nonfinite_counts else zero,
        step=step,
    )
    return norm


def _variable_name(variable) -> str:
    name = getattr(variable, "path", None) or getattr(variable, "name", "variable")
    return str(name).split(":")[0]
