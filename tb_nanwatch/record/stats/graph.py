"""The statistics of a step run by TensorFlow's graph executor (or eagerly).

* Exact NaN and Inf counts are lazy (:class:`~tb_nanwatch.record.stats.lazy_counts.LazyCount`):
  the builder checks every trigger at once and computes the exact counts,
  in one rarely taken conditional (:meth:`GraphStats.rare_cond`), only when
  one of them is non-finite; otherwise every count is exactly 0. The vector
  is bit-for-bit what eager counts would give.
* That branch is a handful of ops whatever the number of tensors
  (:meth:`GraphStats.exact_counts`): each source is flattened, the sources of
  one dtype are concatenated, and the counts of every source come from one
  cumulative sum, read at the sources' boundaries.
* The tensors it counts are *held* (:meth:`GraphStats.held_if_non_finite`):
  on a healthy step the branch sees them empty, and the step frees each one
  as soon as it is done with it.
* An activation's trigger is its ``min + max`` where this device's min/max
  propagate NaN (probed when the backend is made), else its sum; a
  gradient's is its sum of squares.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.ops import gen_array_ops

from tb_nanwatch.record.stats import lazy_counts
from tb_nanwatch.record.stats.backend import DeviceFacts, StatsBackend
from tb_nanwatch.record.stats.lazy_counts import LazyCount


class GraphStats(StatsBackend):
    """The statistics backend of a graph (or eager) step."""

    def __init__(self, facts: DeviceFacts | None = None) -> None:
        super().__init__(facts)
        self._held: dict = {}  # tensor ref -> {id(trigger): held tensor}
        self._finite: dict = {}  # trigger ref -> is_finite(trigger)
        self._slice_sizes: dict = {}  # trigger ref -> {rank: Slice size}

    @property
    def minmax_propagates_nan(self) -> bool:
        return self.facts.minmax_propagates_nan

    def rare_cond(self, pred: tf.Tensor, true_fn, false_fn):
        """``tf.cond`` kept as a functional ``If`` op.

        TensorFlow lowers a ``tf.cond`` to Switch/Merge nodes, and the
        executor then walks every node of the branch *not* taken, each step,
        to mark it dead: for the exact NaN/Inf counts that is hundreds of
        nodes a step for nothing. As an ``If`` only the branch taken runs
        (one function call).
        """
        out = tf.cond(pred, true_fn, false_fn)
        if not tf.executing_eagerly():
            op = tf.nest.flatten(out)[0].op
            while op.type not in ("If", "StatelessIf") and op.inputs:
                op = op.inputs[0].op
            if op.type in ("If", "StatelessIf"):
                op._set_attr("_lower_using_switch_merge", attr_value_pb2.AttrValue(b=False))
        return out

    def rare_assign(self, pred: tf.Tensor, assign, carry: list[tf.Tensor] = ()) -> list:
        """Runs ``assign`` when ``pred``, in a :meth:`rare_cond`; returns ``carry``."""

        def assigned() -> tf.Tensor:
            assign()
            return tf.constant(True)

        self.rare_cond(pred, assigned, lambda: tf.constant(False))
        return list(carry)

    def lazy_count_values(self, counts: list[LazyCount], phases: list[str], maybe_nonfinite):
        """The exact counts in one :meth:`rare_cond` on every check so far.

        The eager counts (a loss's) are cheap scalars: checking them too
        only sends a step with a NaN loss to the exact branch."""

        def exact() -> tf.Tensor:
            return self.exact_counts(counts)

        def clean() -> tf.Tensor:
            return tf.zeros([len(counts)], tf.float32)

        return self.rare_cond(maybe_nonfinite(), exact, clean)

    def transient_counts_of(
        self, tensors: list[tf.Tensor], trigger_value: tf.Tensor, hold_triggers=None
    ) -> dict:
        """Each tensor held (:meth:`held_if_non_finite`, on its entry in
        ``hold_triggers``, by default ``trigger_value``) and counted in the
        end-of-step branch."""
        hold_triggers = (
            hold_triggers if hold_triggers is not None else [trigger_value] * len(tensors)
        )
        held = [self.held_if_non_finite(t, h) for t, h in zip(tensors, hold_triggers, strict=True)]
        return lazy_counts.counts_of(held, trigger_value)

    def held_if_non_finite(self, t: tf.Tensor, trigger_value: tf.Tensor) -> tf.Tensor:
        """``t`` itself when ``trigger_value`` is non-finite, else an empty tensor.

        The exact counts run in one conditional at the end of the step. Had
        it taken ``t`` as an input, ``t``'s buffer would live until then:
        every watched activation and gradient at once, where the step alone
        frees each as soon as the backward pass is done with it (more peak
        memory), and the step's own ops that write into their input's buffer
        when they are its last user (``ReluGrad`` into the incoming gradient,
        the optimizer's ``Sub`` into a weight's gradient) would each allocate
        a fresh one. A ``Slice`` sized by the tensor's own trigger, run as
        soon as the trigger is known, is the whole tensor (the same buffer, no
        copy) on a step where it may be non-finite and an empty one
        otherwise. One op a tensor, and one ``Select`` per trigger. Eagerly
        and for a tensor smaller than ``HOLD_MIN_ELEMENTS`` (holding it costs
        less than the ops that would let it go), ``t`` is returned.
        """
        if tf.executing_eagerly() or not lazy_counts.worth_letting_go(t):
            return t
        # The same tensor is often watched twice on the same trigger (a layer's
        # input gradient is the previous layer's output gradient): hold it once.
        held_by_trigger = self._held.setdefault(t.ref(), {})
        if id(trigger_value) in held_by_trigger:
            return held_by_trigger[id(trigger_value)]
        if t.shape.rank is None:
            t = tf.reshape(t, self.graph_constant(np.array([-1], np.int32)))
        rank = t.shape.rank
        begin = self.graph_constant(np.zeros([rank], np.int32))
        held = tf.raw_ops.Slice(input=t, begin=begin, size=self._slice_size(trigger_value, rank))
        held_by_trigger[id(trigger_value)] = held
        return held

    def _slice_size(self, trigger_value: tf.Tensor, rank: int) -> tf.Tensor:
        """The ``size`` of a Slice of a rank-``rank`` tensor that is all of it
        (all ``-1``) when ``trigger_value`` is non-finite, else nothing (all 0)."""
        by_rank = self._slice_sizes.setdefault(trigger_value.ref(), {})
        if rank not in by_rank:
            key = trigger_value.ref()
            if key not in self._finite:
                self._finite[key] = self.is_finite(trigger_value)
            # Select (not SelectV2): a scalar condition just forwards one input.
            by_rank[rank] = tf.raw_ops.Select(
                condition=self._finite[key],
                x=self.graph_constant(np.zeros([rank], np.int32)),
                y=self.graph_constant(np.full([rank], -1, np.int32)),
            )
        return by_rank[rank]

    def exact_counts(self, counts: list[LazyCount]) -> tf.Tensor:
        """Every count of ``counts`` as one float32 vector, in order, in a few
        ops for all of them (see the module docstring)."""
        sources: dict[int, tf.Tensor] = {}
        for c in counts:
            for t in c.sources:
                if t.dtype.is_floating:
                    sources.setdefault(id(t), t)
        order = {key: i for i, key in enumerate(sources)}
        per_source = self._per_source_counts(list(sources.values()))  # [2, n]: nan, inf rows
        flat = tf.reshape(per_source, [-1])
        kinds = {"nan": 0, "inf": len(order)}
        picks, owners = [], []
        for index, c in enumerate(counts):
            for t in c.sources:
                if id(t) in order:
                    picks.append(kinds[c.kind] + order[id(t)])
                    owners.append(index)
        if not picks:
            return tf.zeros([len(counts)], tf.float32)
        picked = tf.gather(flat, tf.constant(picks, tf.int32))
        return tf.math.unsorted_segment_sum(picked, tf.constant(owners, tf.int32), len(counts))

    def _per_source_counts(self, sources: list[tf.Tensor]) -> tf.Tensor:
        """[2, len(sources)] float32: the NaN and the Inf count of each source."""
        if not sources:
            return tf.zeros([2, 0], tf.float32)
        by_dtype: dict[tf.DType, list[int]] = {}
        for i, t in enumerate(sources):
            by_dtype.setdefault(t.dtype.base_dtype, []).append(i)
        flat_shape = tf.constant([-1], tf.int32)
        parts, positions = [], []
        for indices in by_dtype.values():
            members = [sources[i] for i in indices]
            parts.append(self._group_counts(members, flat_shape))
            positions.extend(indices)
        counts = tf.concat(parts, 1) if len(parts) > 1 else parts[0]
        if positions == sorted(positions):
            return counts
        inverse = [positions.index(i) for i in range(len(sources))]
        return tf.gather(counts, tf.constant(inverse, tf.int32), axis=1)

    def _group_counts(self, tensors: list[tf.Tensor], flat_shape: tf.Tensor) -> tf.Tensor:
        """[2, len(tensors)] for tensors of one dtype: one cumulative sum over
        their concatenation, read at each tensor's end and start."""
        flats = [gen_array_ops.reshape(t, flat_shape) for t in tensors]
        values = gen_array_ops.concat_v2(flats, axis=0) if len(flats) > 1 else flats[0]
        flags = tf.stack([tf.math.is_nan(values), tf.math.is_inf(values)])
        running = tf.pad(tf.cumsum(tf.cast(flags, tf.int32), axis=1), [[0, 0], [1, 0]])
        sizes = self._sizes(flats)
        ends = tf.cumsum(sizes)
        at_end = tf.gather(running, ends, axis=1)
        at_start = tf.gather(running, ends - sizes, axis=1)
        return tf.cast(at_end - at_start, tf.float32)

    def _sizes(self, flats: list[tf.Tensor]) -> tf.Tensor:
        """int32 [len(flats)]: each flat tensor's size; one op for all the static
        ones (a held tensor's size is known only when the branch runs: it is
        empty on a step where it is finite)."""
        static = [f.shape.num_elements() for f in flats]
        dynamic = [i for i, n in enumerate(static) if n is None]
        known = self.graph_constant(np.array([n for n in static if n is not None], np.int32))
        if not dynamic:
            return known
        measured = tf.stack([gen_array_ops.size(flats[i], out_type=tf.int32) for i in dynamic])
        if len(dynamic) == len(flats):
            return measured
        order = [i for i, n in enumerate(static) if n is not None] + dynamic
        inverse = np.argsort(np.array(order)).astype(np.int32)
        return tf.gather(tf.concat([known, measured], 0), self.graph_constant(inverse))
