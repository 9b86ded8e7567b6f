"""Builds one step's statistics vector with plain TensorFlow ops.

Everything here runs inside the compiled train step (XLA included): no
``py_function``, no ``check_numerics``. Each field is computed per replica as a
partial (a sum, a min, a max, a mean or a sum of squares) and the partials are
reduced across replicas before they are packed, so the vector means the same
with one replica or eight: counts summed, min of mins, max of maxes, norms from
summed squares.
"""

from __future__ import annotations

import tensorflow as tf

from tb_nanwatch.schema import Schema

# How each field reduces across replicas.
_FIELD_OPS = {
    "nan": "sum",
    "inf": "sum",
    "min": "min",
    "max": "max",
    "value": "mean",
    "norm": "sumsq",
}
_HEADER_OPS = {
    "loss": "mean",
    "grad_norm": "sumsq",
    "lr": "max",
    "loss_scale": "max",
    "skipped": "max",
    "iterations": "max",
}
_GROUPS = ("sum", "min", "max", "mean", "sumsq")


def _f32(t) -> tf.Tensor:
    return tf.cast(t, tf.float32)


def count_nan(t: tf.Tensor) -> tf.Tensor:
    if not t.dtype.is_floating:
        return tf.constant(0.0)
    return tf.reduce_sum(_f32(tf.math.is_nan(t)))


def count_inf(t: tf.Tensor) -> tf.Tensor:
    if not t.dtype.is_floating:
        return tf.constant(0.0)
    return tf.reduce_sum(_f32(tf.math.is_inf(t)))


def sum_squares(t) -> tf.Tensor:
    if isinstance(t, tf.IndexedSlices):
        t = t.values
    t = _f32(t)
    return tf.reduce_sum(t * t)


def tensor_fields(tensors: list[tf.Tensor]) -> dict[str, tf.Tensor]:
    """nan/inf counts, min and max over a list of tensors (float32)."""
    tensors = [_f32(t) if t.dtype.is_floating else tf.cast(t, tf.float32) for t in tensors]
    return {
        "nan": tf.add_n([count_nan(t) for t in tensors]),
        "inf": tf.add_n([count_inf(t) for t in tensors]),
        "min": tf.reduce_min(tf.stack([tf.reduce_min(t) for t in tensors])),
        "max": tf.reduce_max(tf.stack([tf.reduce_max(t) for t in tensors])),
    }


def gradient_fields(grads: list) -> dict[str, tf.Tensor]:
    """nan/inf counts and the sum of squares of a list of gradients.

    ``None`` (a tensor the loss does not depend on) counts as a zero gradient.
    """
    grads = [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads if g is not None]
    if not grads:
        zero = tf.constant(0.0)
        return {"nan": zero, "inf": zero, "norm": zero}
    return {
        "nan": tf.add_n([count_nan(g) for g in grads]),
        "inf": tf.add_n([count_inf(g) for g in grads]),
        "norm": tf.add_n([sum_squares(g) for g in grads]),
    }


class StatsBuilder:
    """Collects fields entry by entry; ``vector()`` reduces and packs them."""

    def __init__(self) -> None:
        self.schema = Schema()
        self._partials: dict[str, list[tf.Tensor]] = {g: [] for g in _GROUPS}
        self._layout: list[tuple[str, int]] = []  # vector slot -> (group, index)
        # For each diagnosed entry, the indices of its nan and inf partials in
        # the "sum" group: used for the per-replica view of where it went bad.
        self._bad_slots: list[tuple[int, int]] = []
        self.replica_first_bad: tf.Tensor | None = None

    def add(self, phase: str, kind: str, layer: str | None, tensor: str, fields: dict) -> None:
        entry = self.schema.add(phase, kind, layer, tensor)
        ops = _HEADER_OPS if kind == "header" else _FIELD_OPS
        slots = {}
        for name in entry.fields:
            group = ops[name]
            slots[name] = len(self._partials[group])
            self._layout.append((group, slots[name]))
            self._partials[group].append(_f32(fields[name]))
        if kind != "header":
            self._bad_slots.append((slots["nan"], slots["inf"]))

    def _local_first_bad(self, sums: tf.Tensor) -> tf.Tensor:
        """Ordinal (among diagnosed entries) of this replica's first non-finite
        entry, before any cross-replica reduction; ``len(entries)`` if none."""
        if not self._bad_slots:
            return tf.constant(0.0)
        nan_idx = tf.constant([n for n, _ in self._bad_slots], tf.int32)
        inf_idx = tf.constant([i for _, i in self._bad_slots], tf.int32)
        bad = (tf.gather(sums, nan_idx) + tf.gather(sums, inf_idx)) > 0
        bad = tf.concat([bad, [True]], 0)
        return tf.cast(tf.argmax(tf.cast(bad, tf.int32), output_type=tf.int32), tf.float32)

    def vector(self) -> tf.Tensor:
        """The packed float32 vector, reduced across replicas when needed."""
        stacked = {
            g: tf.stack(v) if v else tf.zeros([0], tf.float32) for g, v in self._partials.items()
        }
        ctx = tf.distribute.get_replica_context()
        replicas = ctx.num_replicas_in_sync if ctx is not None else 1
        local_first_bad = self._local_first_bad(stacked["sum"])
        self.replica_first_bad = tf.reshape(local_first_bad, [1])
        if replicas > 1:
            sums = ctx.all_reduce(
                tf.distribute.ReduceOp.SUM,
                tf.concat([stacked["sum"], stacked["sumsq"], stacked["mean"]], 0),
            )
            n_sum, n_sq = len(self._partials["sum"]), len(self._partials["sumsq"])
            stacked["sum"] = sums[:n_sum]
            stacked["sumsq"] = sums[n_sum : n_sum + n_sq]
            stacked["mean"] = sums[n_sum + n_sq :] / float(replicas)
            # One all_gather carries the extremes and each replica's first
            # non-finite entry (which replica went bad first).
            gathered = ctx.all_gather(
                tf.stack(
                    [tf.concat([-stacked["min"], stacked["max"], [local_first_bad]], 0)]
                ),
                axis=0,
            )
            self.replica_first_bad = gathered[:, -1]
            extremes = tf.reduce_max(gathered[:, :-1], axis=0)
            n_min = len(self._partials["min"])
            stacked["min"] = -extremes[:n_min]
            stacked["max"] = extremes[n_min:]
        stacked["sumsq"] = tf.sqrt(stacked["sumsq"])
        offsets, flat, start = {}, [], 0
        for g in _GROUPS:
            offsets[g] = start
            start += len(self._partials[g])
            flat.append(stacked[g])
        index = [offsets[g] + i for g, i in self._layout]
        return tf.gather(tf.concat(flat, 0), tf.constant(index, tf.int32))
