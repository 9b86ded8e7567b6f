"""Undoing a non-finite step inside the compiled step (``on_nonfinite="skip"``
and ``"rewind"``).

The device record already copies the trainable weights and the optimizer's
variables (slots, iterations) before the update of a step that may be
non-finite (:meth:`~tb_nanwatch.record.in_step.device_record.DeviceRecord.copy_pre_step_weights`).
When the watcher recovers, those copies are taken on every such step (not
only up to the first incident), the decision to copy is agreed by every
replica, and after the update :func:`undo_if_nonfinite` assigns them back
when the step's own statistics say it is to be undone (the rule of
:func:`~tb_nanwatch.evidence.diagnosis.undone_entries`). Both happen in rare
branches: a healthy step runs neither, and the host reads nothing more.
"""

from __future__ import annotations

import tensorflow as tf

from tb_nanwatch.evidence import diagnosis
from tb_nanwatch.evidence.schema import Schema


def agreed(suspect: tf.Tensor) -> tf.Tensor:
    """``suspect`` (a scalar bool) true on any replica, on every replica.

    The weights are mirrored: a NaN in one replica's shard reaches every
    replica's weights through the summed gradients, so every replica must
    copy its weights before the update (one scalar all-reduce a step, and
    only with several replicas)."""
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        return suspect
    total = ctx.all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(suspect, tf.float32))
    return total > 0


def undo_flag(schema: Schema, vector: tf.Tensor, whole_step: bool) -> tf.Tensor:
    """Whether the step of ``vector`` (reduced across replicas, so every
    replica agrees) is to be undone: a NaN/Inf in one of the undone entries,
    in a step the loss scaler did not skip."""
    entries = diagnosis.undone_entries(schema, whole_step)
    positions = schema.indices(entries, "nan") + schema.indices(entries, "inf")
    if not positions:
        return tf.constant(False)
    counts = tf.gather(vector, tf.constant(sorted(positions), tf.int32))
    nonfinite = tf.reduce_any(tf.not_equal(counts, 0.0))  # a NaN count too
    skipped = vector[schema.header_index("skipped")] > 0
    return tf.logical_and(nonfinite, tf.logical_not(skipped))


def undo_if_nonfinite(device, schema: Schema, vector: tf.Tensor, stats) -> None:
    """After the update: puts the weights and the optimizer's variables of
    ``device`` (a ``DeviceRecord``) back as they were before the step when
    the step is to be undone and its copies were taken (they always are for
    such a step; the check guards against stale copies)."""
    if not device.watched_optimizer_variables:
        # Undoing the weights alone would keep the step in the optimizer's slots.
        raise RuntimeError("no copy of the optimizer's state: a step cannot be undone")
    whole_step = device.pre_step_weights == "every_step"
    undo = tf.logical_and(undo_flag(schema, vector, whole_step), device.copied_this_step())
    pairs = device.pre_step_pairs()

    def restore() -> None:
        for variable, copy in pairs:
            assign_local(variable, copy.read_value())

    stats.rare_assign(undo, restore)


def assign_local(variable, value: tf.Tensor) -> None:
    """Assigns ``value`` to this replica's own component of ``variable`` (a
    Keras or TensorFlow variable, mirrored or not).

    A mirrored variable cannot be assigned in a replica context without an
    aggregation (and with one it would need a cross-replica call, which a
    conditional cannot hold); every replica writes the same value into its
    own component instead."""
    inner = getattr(variable, "_value", None)
    target = inner if isinstance(inner, tf.Variable) else variable
    local = getattr(target, "_get_on_device_or_primary", None)
    if local is not None and tf.distribute.has_strategy():
        target = local()
    shape = target.shape if target.shape.is_fully_defined() else tf.shape(target)
    target.assign(tf.cast(tf.reshape(value, shape), target.dtype))
