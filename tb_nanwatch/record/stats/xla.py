"""The statistics of a step XLA compiles.

XLA compiles every conditional's branch before the first step, and each
reduction and each scalar op after one as a kernel of its own; tf2xla lowers
some ops through an MLIR pipeline one at a time. So (see docs/xla.md):

* A tensor's NaN and Inf counts are results of the reduction that takes its
  statistic (:meth:`XlaStats.counted_in_pass`): exact on every step, and no
  conditional to compile. A tensor that cannot be counted so is counted
  lazily, a few entries a conditional (:meth:`XlaStats.counts_in_chunks`).
* An activation's min and max come from one reduction over integer keys
  that sort as the floats do and keep a NaN (XLA's float min and max may
  drop one on a CPU); they stay keys (:class:`TakenExtreme`) until the
  builder converts all of them at once.
* Small tensors of one size and dtype share a reduction
  (:meth:`XlaStats._one_pass_each`), and the one-tensor reductions of one
  signature are lowered once (:meth:`XlaStats._lowered_once`).
* NaN and Inf tests are comparisons, which tf2xla lowers directly.
* A rare assignment is a loop run zero times or once (:meth:`XlaStats.rare_assign`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import gen_functional_ops

from tb_nanwatch.record.stats import lazy_counts
from tb_nanwatch.record.stats.backend import DeviceFacts, StatsBackend, dense_gradients, f32
from tb_nanwatch.record.stats.lazy_counts import KINDS, LazyCount, scalar_total, signature, unique

try:  # XLA's own ops (one reduction with two results); TensorFlow has no public name for them.
    from tensorflow.compiler.tf2xla.python import xla
except ImportError:  # pragma: no cover - a TensorFlow build without them
    xla = None

# The signed integer of each float's width (see XlaStats._low_high_by_keys).
ORDERED_INTS = {
    tf.float16: tf.int16,
    tf.bfloat16: tf.int16,
    tf.float32: tf.int32,
    tf.float64: tf.int64,
}
# The counts taken in a pass are int32.
_IN_PASS_MAX_ELEMENTS = 2**31 - 1
# Tensors of at most this many elements that share a size and a dtype are
# reduced together, up to this many a reduction (see XlaStats._one_pass_each).
_TOGETHER_MAX_ELEMENTS = 16384
_TOGETHER_MAX_TENSORS = 16
# On a CPU, gradients of at least this many elements, a multiple of
# _CPU_ROW, have their sum of squares summed by rows first (see
# XlaStats._half_sum_squares_of); smaller ones keep one L2Loss op, less to
# trace and compile.
_CPU_ROW = 4
_CPU_ROWS_MIN = lazy_counts.HOLD_MIN_ELEMENTS


@dataclasses.dataclass(frozen=True, eq=False)
class TakenExtreme:
    """The least or the greatest key of a tensor (see ``XlaStats._low_high_by_keys``),
    taken already with its NaN count ``nan``. The builder turns all of a
    step's into float32 at once (:meth:`XlaStats.finish_extremes`): XLA
    compiles each scalar op after a reduction as a kernel of its own."""

    key: tf.Tensor
    dtype: tf.DType  # the float type whose bits ``key`` holds
    nan: tf.Tensor  # int32


class XlaStats(StatsBackend):
    """The statistics backend of a step compiled by XLA."""

    growable_copies = False
    # The extremes are taken over keys that keep a NaN (see _low_high_by_keys).
    minmax_propagates_nan = True

    def __init__(self, facts: DeviceFacts | None = None) -> None:
        super().__init__(facts)
        self.host_only = self.facts.host_only
        self._squares_and_counts: dict = {}  # gradient ref -> (half sum sq, nan, inf)

    # -- conditionals --------------------------------------------------------------

    def rare_cond(self, pred: tf.Tensor, true_fn, false_fn):
        """``tf.cond`` (XLA compiles both branches; only the one taken runs)."""
        return tf.cond(pred, true_fn, false_fn)

    def rare_assign(self, pred: tf.Tensor, assign, carry: list[tf.Tensor] = ()) -> list:
        """A loop run zero times or once.

        XLA updates a loop's state in place, so a step that assigns nothing
        writes nothing. A conditional instead copies every variable it might
        assign on every step (its untaken branch passes them through a copy),
        and a weight that the branch reads and the step then updates in place
        is copied too, unless the update waits for the branch: hence
        ``carry`` (the gradients), held by an optimization barrier so that
        XLA cannot forward them around the loop (see docs/xla.md).
        """
        trips = tf.cast(pred, tf.int32)

        def body(i, *kept):
            assign()
            if xla is None:  # no barrier: still right, only copied more
                return (i + 1, *kept)
            return tuple(xla.optimization_barrier(i + 1, *kept))

        out = tf.while_loop(
            lambda i, *_: i < trips, body, (tf.constant(0), *carry), maximum_iterations=1
        )
        return list(out[1:])

    # -- elementwise tests: comparisons, which tf2xla lowers directly (IsNan,
    # IsInf and IsFinite go through an MLIR pipeline one op at a time) ----------------

    def is_nan(self, t: tf.Tensor) -> tf.Tensor:
        """``t != t``."""
        return tf.math.not_equal(t, t)

    def is_inf(self, t: tf.Tensor) -> tf.Tensor:
        """``t == +inf or t == -inf``."""
        inf, minus_inf = self._infinities(t.dtype)
        return tf.math.logical_or(tf.math.equal(t, inf), tf.math.equal(t, minus_inf))

    def is_finite(self, t: tf.Tensor) -> tf.Tensor:
        """``-inf < t < +inf`` (a NaN compares false)."""
        inf, minus_inf = self._infinities(t.dtype)
        return tf.math.logical_and(tf.math.less(t, inf), tf.math.greater(t, minus_inf))

    def _infinities(self, dtype: tf.DType) -> tuple[tf.Tensor, tf.Tensor]:
        return tuple(
            self.graph_constant(np.array(v, dtype.as_numpy_dtype)) for v in (np.inf, -np.inf)
        )

    def nonfinite_flags(self, t: tf.Tensor) -> list[tf.Tensor]:
        """int32, for each element of ``t``: [1 where a NaN, 1 where an Inf]."""
        return [tf.cast(self.is_nan(t), tf.int32), tf.cast(self.is_inf(t), tf.int32)]

    def any_counted(self, counts: list[tf.Tensor]) -> tf.Tensor:
        """Whether any of ``counts`` is not 0, through a square root, which XLA
        does not copy into each of its users (a cheap test over hundreds of
        counts copied into each weight the pre-step copy selects took XLA's
        fusion pass 20 s on a transformer)."""
        return tf.sqrt(f32(tf.reduce_max(tf.stack(counts)))) > 0

    # -- which tensors are counted in their pass --------------------------------------

    def counted_in_pass(self, t: tf.Tensor) -> bool:
        """Whether the NaN and Inf counts of ``t`` are exact results of the
        reduction that takes its statistic (a float tensor of known size): two
        :class:`~tb_nanwatch.record.stats.lazy_counts.TakenCount`.

        Lazy counts cost XLA a conditional for every few tensors, each
        compiled with its branch and its triggers; two more int32 results of
        a reduction made anyway cost the step little (see docs/xla.md).
        """
        size = t.shape.num_elements()
        return (
            xla is not None
            and t.dtype in ORDERED_INTS
            and size is not None
            and size <= _IN_PASS_MAX_ELEMENTS
        )

    def transient_counts_of(
        self, tensors: list[tf.Tensor], trigger_value: tf.Tensor, hold_triggers=None
    ) -> dict:
        """Lazy counts marked ``transient`` when a tensor is large: XLA cannot
        let go of a conditional's operand before that conditional runs, so
        :meth:`counts_in_chunks` counts them a few entries at a time (one
        end-of-step conditional kept every watched tensor alive to the end of
        the step)."""
        transient = any(lazy_counts.worth_letting_go(t) for t in tensors)
        return lazy_counts.counts_of(tensors, trigger_value, transient=transient)

    # -- entries -----------------------------------------------------------------------

    def tensor_fields(self, tensors: list[tf.Tensor], taken_extremes: bool = False) -> dict:
        """Counted in one pass where it can: with ``taken_extremes`` one
        tensor's min and max as :class:`TakenExtreme`."""
        if not (tensors and all(self.counted_in_pass(t) for t in tensors)):
            return super().tensor_fields(tensors, taken_extremes)
        fields = self._fields_in_one_pass(tensors)
        if not taken_extremes and isinstance(fields["min"], TakenExtreme):
            fields["min"], fields["max"] = self.extremes_as_floats([fields["min"], fields["max"]])
        return fields

    def low_high(self, t: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        if t.dtype in ORDERED_INTS:
            return self._low_high_by_keys(t)
        return super().low_high(t)

    def gradient_fields(self, grads: list) -> dict[str, tf.Tensor]:
        dense = dense_gradients(grads)
        if not (dense and all(self.counted_in_pass(g) for g in dense)):
            return super().gradient_fields(grads)
        parts = [self._half_sum_squares_and_counts(g) for g in dense]
        nan, inf = (scalar_total([p[i] for p in parts]) for i in (1, 2))
        return {
            **lazy_counts.taken_counts_of(nan, inf),
            "norm": scalar_total([p[0] for p in parts]),
        }

    def gradient_fields_each(self, grads: list) -> list[dict[str, tf.Tensor]]:
        """The small gradients of one size share a reduction (see :meth:`_one_pass_each`)."""
        fresh = unique(
            [
                g
                for g in dense_gradients(grads)
                if self.counted_in_pass(g) and g.ref() not in self._squares_and_counts
            ]
        )
        for g, results in zip(fresh, self._one_pass_each(fresh, "squares"), strict=True):
            self._squares_and_counts[g.ref()] = tuple(results)
        return [self.gradient_fields([g]) for g in grads]

    def value_fields(self, t: tf.Tensor) -> dict:
        if t.dtype.is_floating and self.counted_in_pass(t):
            return lazy_counts.taken_counts_of(*self._pass_over(t, "counts"))
        return super().value_fields(t)

    def value_fields_each(self, tensors: list[tf.Tensor]) -> list[dict]:
        """The small ones of one size share a reduction (see :meth:`_one_pass_each`)."""
        taken = unique([t for t in tensors if self.counted_in_pass(t)])
        counts = dict(zip(map(id, taken), self._one_pass_each(taken, "counts"), strict=True))
        return [
            lazy_counts.taken_counts_of(*counts[id(t)]) if id(t) in counts else self.value_fields(t)
            for t in tensors
        ]

    def _half_sum_squares_of(self, t: tf.Tensor) -> tf.Tensor:
        """On a CPU, for a large tensor: by rows of ``_CPU_ROW`` elements first.

        XLA's CPU backend splits a large reduction into passes and does not
        fuse the square into them: ``L2Loss`` writes a full-size copy of the
        squares first. Summed by rows of 4 first, the square fuses into that
        short reduction and only a quarter-size vector is written (see
        docs/xla.md)."""
        size = t.shape.num_elements() or 0
        if not (self.host_only and size >= _CPU_ROWS_MIN and size % _CPU_ROW == 0):
            return super()._half_sum_squares_of(t)
        rows = tf.reshape(f32(t), [size // _CPU_ROW, _CPU_ROW])
        return 0.5 * tf.reduce_sum(tf.reduce_sum(rows * rows, axis=1))

    def _half_sum_squares_and_counts(self, t: tf.Tensor) -> tuple:
        """(sum(t**2) / 2 as float32, NaN count, Inf count) of a gradient
        :meth:`counted_in_pass`, from one reduction, made once per tensor."""
        key = t.ref()
        if key not in self._squares_and_counts:
            self._squares_and_counts[key] = tuple(self._pass_over(t, "squares"))
        return self._squares_and_counts[key]

    # -- the builder's part ------------------------------------------------------------

    def lazy_count_values(self, counts: list[LazyCount], phases: list[str], maybe_nonfinite):
        """:meth:`counts_in_chunks`: every count computed in place, as a
        reduction of its own, is a kernel for XLA to compile, and a large
        model's first step pays for each (docs/xla.md)."""
        return self.counts_in_chunks(counts, phases)

    def partial(self, value):
        """A :class:`TakenExtreme` as it is (see :meth:`finish_extremes`), else float32."""
        return value if isinstance(value, TakenExtreme) else f32(value)

    def finish_extremes(self, partials: dict[str, list]) -> None:
        """Every :class:`TakenExtreme` partial as its float32 value, all at once."""
        places = [
            (group, i)
            for group in ("min", "max")
            for i, value in enumerate(partials[group])
            if isinstance(value, TakenExtreme)
        ]
        extremes = [partials[group][i] for group, i in places]
        for (group, i), value in zip(places, self.extremes_as_floats(extremes), strict=True):
            partials[group][i] = value

    def extremes_as_floats(self, extremes: list[TakenExtreme]) -> list[tf.Tensor]:
        """The float32 value of each of ``extremes``, NaN where its tensor holds
        a NaN (as TensorFlow's own min and max): a few vector ops for all."""
        values: list = [None] * len(extremes)
        by_dtype: dict[tf.DType, list[int]] = {}
        for i, extreme in enumerate(extremes):
            by_dtype.setdefault(extreme.dtype, []).append(i)
        for dtype, indices in by_dtype.items():
            keys = tf.stack([extremes[i].key for i in indices])
            nans = tf.stack([extremes[i].nan for i in indices])
            floats = f32(self._from_key(keys, dtype))
            nan = self.graph_constant(np.array(np.nan, np.float32))
            floats = tf.where(nans > 0, nan, floats)
            for i, value in zip(indices, tf.unstack(floats), strict=True):
                values[i] = value
        return values

    # -- extremes over keys ------------------------------------------------------------

    def _low_high_by_keys(self, t: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """min and max of ``t``, both from one pass over integers.

        A float's bits, read as a signed integer with every bit but the sign's
        flipped in negative values, sort as the floats do, and a NaN lands
        beyond the infinity of its sign, so a NaN anywhere reaches the min or
        the max and ``min + max`` is a trigger (XLA's float min and max may
        drop a NaN on a CPU). One reduction takes both (with the counts, see
        :meth:`_extremes_and_counts`) where float min, max and sum took three
        (see docs/xla.md). Both come back NaN when either is, as TensorFlow's
        own min and max.
        """
        if t.shape.rank is None or xla is None:
            keys = self._key(t)
            pair = f32(
                self._from_key(tf.stack([tf.reduce_min(keys), tf.reduce_max(keys)]), t.dtype)
            )
        else:
            pair = self._extremes_and_counts(t)[0]
        nan = tf.reduce_any(self.is_nan(pair))
        pair = tf.where(nan, self.graph_constant(np.full([2], np.nan, np.float32)), pair)
        return tuple(tf.unstack(pair))

    def _key(self, t: tf.Tensor) -> tf.Tensor:
        """``t``'s bits as an integer that sorts as ``t`` does."""
        return self._flip_negatives(tf.bitcast(t, ORDERED_INTS[t.dtype]))

    def _flip_negatives(self, bits: tf.Tensor) -> tf.Tensor:
        """``bits`` with every bit but the sign's flipped where the sign is set."""
        width = np.dtype(bits.dtype.as_numpy_dtype)
        # An arithmetic shift by the width less one: all ones for a negative value.
        shift = self.graph_constant(np.array(width.itemsize * 8 - 1, width))
        largest = self.graph_constant(np.array(np.iinfo(width).max, width))
        return tf.bitwise.bitwise_xor(
            bits, tf.bitwise.bitwise_and(tf.bitwise.right_shift(bits, shift), largest)
        )

    def _from_key(self, key: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
        """The float ``key`` was made from (the flip is its own inverse)."""
        return tf.bitcast(self._flip_negatives(key), dtype)

    def _fields_in_one_pass(self, tensors: list[tf.Tensor]) -> dict:
        """:meth:`tensor_fields` of tensors :meth:`counted_in_pass`: the least and
        greatest key and the counts of each from one reduction; one tensor's
        min and max as :class:`TakenExtreme`."""
        if len(tensors) == 1:
            low, high, nan, inf = self._key_extremes_and_counts(tensors[0])
            dtype = tensors[0].dtype
            return {
                **lazy_counts.taken_counts_of(nan, inf),
                "min": TakenExtreme(low, dtype, nan),
                "max": TakenExtreme(high, dtype, nan),
            }
        pairs, nans, infs = zip(*[self._extremes_and_counts(t) for t in tensors], strict=True)
        stacked = tf.stack(pairs)
        pair = tf.stack([tf.reduce_min(stacked[:, 0]), tf.reduce_max(stacked[:, 1])])
        nan, inf = scalar_total(list(nans)), scalar_total(list(infs))
        # As TensorFlow's own min and max: both NaN when a tensor holds a NaN.
        pair = tf.where(nan > 0, self.graph_constant(np.full([2], np.nan, np.float32)), pair)
        low, high = tf.unstack(pair)
        return {**lazy_counts.taken_counts_of(nan, inf), "min": low, "max": high}

    def _extremes_and_counts(self, t: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """([min, max] as float32, NaN count, Inf count) of ``t``, from one
        reduction over its keys and its NaN and Inf flags (int32 counts)."""
        low, high, nan, inf = self._key_extremes_and_counts(t)
        # As a pair, so that each op after the reduction is made once, not twice.
        return f32(self._from_key(tf.stack([low, high]), t.dtype)), nan, inf

    def _key_extremes_and_counts(self, t: tf.Tensor) -> list[tf.Tensor]:
        """[least key, greatest key, NaN count, Inf count] of ``t``, one reduction."""
        return self._lowered_once("extremes", self._build_key_extremes_and_counts, t)

    def _build_key_extremes_and_counts(self, t: tf.Tensor) -> list[tf.Tensor]:
        keys = self._key(t)
        limits = np.iinfo(keys.dtype.as_numpy_dtype)
        inits = [self.graph_constant(np.array(v, limits.dtype)) for v in (limits.max, limits.min)]
        return self._one_pass(t, [keys, keys], inits, extremes=True)

    # -- one reduction a tensor, or a few tensors --------------------------------------

    def _one_pass(self, t: tf.Tensor, operands: list, inits: list, extremes: bool = False) -> list:
        """One XLA reduction over ``operands`` (of ``t``'s shape: summed, or with
        ``extremes`` a least and a greatest key) and ``t``'s NaN and Inf flags,
        whose int32 counts are its last two results."""
        operands, inits = self._with_counts(t, operands, inits)
        reducer = self._one_pass_reducer(extremes, tuple(o.dtype for o in operands))
        return xla.variadic_reduce(operands, inits, list(range(t.shape.rank)), reducer)

    def _pass_over(self, t: tf.Tensor, what: str) -> list:
        """:meth:`_one_pass` of a gradient's half squares (``"squares"``) or of
        a weight's counts alone (``"counts"``)."""
        return self._lowered_once(what, lambda x: self._one_pass(x, *self._head_of(x, what)), t)

    def _head_of(self, t: tf.Tensor, what: str) -> tuple[list, list]:
        """The operands (and their initial values) before the counts: for
        ``"squares"`` the half squares (times 0.5 in the pass, exact: no scalar
        op after it, each of which XLA compiles as a kernel of its own)."""
        if what == "counts":
            return [], []
        x = f32(t)
        return [x * x * 0.5], [self.graph_constant(np.array(0, np.float32))]

    def _with_counts(self, t: tf.Tensor, operands: list, inits: list) -> tuple[list, list]:
        zero = self.graph_constant(np.array(0, np.int32))
        return [*operands, *self.nonfinite_flags(t)], [*inits, zero, zero]

    def _one_pass_each(self, tensors: list[tf.Tensor], what: str) -> list[list[tf.Tensor]]:
        """:meth:`_pass_over` of each of ``tensors`` (all :meth:`counted_in_pass`).

        Small tensors of one size and dtype share one reduction, each read
        flat as operands of its own (no copy): tf2xla takes milliseconds to
        lower each reduction, and XLA compiles each as a kernel. A large
        tensor's reduction is lowered once per signature (:meth:`_lowered_once`).
        """
        results: dict[int, list[tf.Tensor]] = {}
        groups: dict[tuple, list[tf.Tensor]] = {}
        for t in tensors:
            size = t.shape.num_elements()
            if size <= _TOGETHER_MAX_ELEMENTS:
                groups.setdefault((size, t.dtype), []).append(t)
            else:
                results[id(t)] = self._pass_over(t, what)
        for members in groups.values():
            for start in range(0, len(members), _TOGETHER_MAX_TENSORS):
                chunk = members[start : start + _TOGETHER_MAX_TENSORS]
                for t, result in zip(chunk, self._passes_together(chunk, what), strict=True):
                    results[id(t)] = result
        return [results[id(t)] for t in tensors]

    def _passes_together(self, tensors: list[tf.Tensor], what: str) -> list[list[tf.Tensor]]:
        """:meth:`_pass_over` of each of ``tensors`` (one size, one dtype) from one reduction."""
        if len(tensors) == 1:
            return [self._pass_over(tensors[0], what)]
        # Not through _lowered_once: a group's signature seldom comes again,
        # and a function for each cost more than it saved.
        operands, inits = [], []
        for t in tensors:
            flat = tf.reshape(t, [-1])
            more, more_inits = self._with_counts(flat, *self._head_of(flat, what))
            operands += more
            inits += more_inits
        reducer = self._one_pass_reducer(False, tuple(o.dtype for o in operands))
        results = xla.variadic_reduce(operands, inits, [0], reducer)
        width = len(results) // len(tensors)
        return [list(results[i : i + width]) for i in range(0, len(results), width)]

    def _lowered_once(self, kind: str, build, t: tf.Tensor) -> list[tf.Tensor]:
        """``build(t)``, a list of tensors, from a function made once per
        ``kind`` and signature of ``t``.

        tf2xla lowers every ``XlaVariadicReduceV2`` through an MLIR pipeline
        of its own, and a called function's body again at every call; but it
        compiles a conditional's branch once per branch function and argument
        shapes. So the function is both branches of a conditional on a
        constant: one lowering for all the tensors of a signature, and XLA's
        conditional simplifier then takes the conditional away, so the
        optimized step is the same (see docs/xla.md).
        """
        key = ("lowered", kind, signature([t]))
        function = self.traced_once(key, lambda x: tuple(build(x)), t)
        function.add_to_graph(tf.compat.v1.get_default_graph())  # once a graph: it checks
        return list(
            gen_functional_ops.stateless_if(
                cond=self.graph_constant(np.array(True)),
                input=[t],
                Tout=[out.dtype for out in function.outputs],
                then_branch=function.name,
                else_branch=function.name,
                output_shapes=[out.shape for out in function.outputs],
            )
        )

    def _one_pass_reducer(self, extremes: bool, dtypes: tuple):
        """The reducer of :meth:`_one_pass`, traced once per kind and operand
        dtypes: sums, or with ``extremes`` a least and a greatest value first."""
        specs = [tf.TensorSpec([], d) for d in dtypes]
        n = len(specs)

        def reducer(*args):
            mine, other = args[:n], args[n:]
            sums = [a + b for a, b in zip(mine, other, strict=True)]
            if extremes:
                return (tf.minimum(mine[0], other[0]), tf.maximum(mine[1], other[1]), *sums[2:])
            return tuple(sums)

        return self.traced_once(("reducer", extremes, dtypes), reducer, *specs, *specs)

    # -- counts a tensor's pass cannot take --------------------------------------------

    def counts_in_chunks(self, counts: list[LazyCount], phases: list[str] | None = None):
        """Every count of ``counts`` as one float32 vector, in order.

        The entries of transient counts, in the order they were added (the
        order the step computes them), are counted a few at a time (one each
        when there are at most ``XLA_MAX_CONDITIONALS``), never two ``phases``
        (one label a count) in one chunk, each chunk in a conditional on its
        own triggers that runs as soon as its last entry is read; the other
        entries (small tensors, weights, alive to the end anyway) in one
        more. A conditional per entry keeps memory lowest but XLA compiles
        each one on its own; one for all kept every tensor alive.
        """
        if not counts:
            return tf.zeros([0], tf.float32)
        phases = phases if phases is not None else [""] * len(counts)
        entries: dict[tuple, list] = {}  # (trigger, sources) -> [counts' indices]
        for i, c in enumerate(counts):
            entries.setdefault((id(c.trigger), tuple(id(t) for t in c.sources)), []).append(i)
        transient = [e for e in entries.values() if counts[e[0]].transient]
        per_chunk = max(1, -(-len(transient) // lazy_counts.XLA_MAX_CONDITIONALS))
        chunks: list[list] = [[]]
        for e in transient:
            last = chunks[-1]
            if len(last) == per_chunk or (last and phases[last[0][0]] != phases[e[0]]):
                chunks.append([])
            chunks[-1].append(e)
        chunks.append([e for e in entries.values() if not counts[e[0]].transient])
        values, emitted = [], []  # emitted: the entries in the order of ``values``
        for chunk in chunks:
            if chunk:
                values.append(self._chunk_counts([counts[e[0]] for e in chunk]))
                emitted += chunk
        position = {i: p for p, e in enumerate(emitted) for i in e}
        index = [len(KINDS) * position[i] + KINDS.index(c.kind) for i, c in enumerate(counts)]
        flat = tf.concat(values, 0) if len(values) > 1 else values[0]
        return tf.gather(flat, self.graph_constant(np.array(index, np.int32)))

    def _chunk_counts(self, entries: list[LazyCount]) -> tf.Tensor:
        """[nan, inf] of each entry, concatenated: zeros unless a trigger is non-finite.

        The conditional is a function traced once for each chunk signature
        (the dtypes and shapes of the triggers and sources) and called by
        every chunk of that signature: a model's repeated layers or blocks
        trace their ``tf.cond`` once, and XLA converts it once.
        """
        triggers = [e.trigger for e in entries]
        sources = [t for e in entries for t in e.sources]
        sizes = tuple(len(e.sources) for e in entries)

        def chunk(triggers: list, sources: list) -> tf.Tensor:
            grouped, start = [], 0
            for size in sizes:
                grouped.append(sources[start : start + size])
                start += size
            return self._counts_unless_finite(triggers, grouped)

        key = ("chunk", signature(triggers), signature(sources), sizes)
        return self.traced_once(key, chunk, triggers, sources)(triggers, sources)

    def _counts_unless_finite(self, triggers: list, entries: list) -> tf.Tensor:
        finite = self.all_finite(triggers)

        def exact() -> tf.Tensor:
            return self._exact_pairs(entries)

        def clean() -> tf.Tensor:
            return tf.zeros([len(KINDS) * len(entries)], tf.float32)

        return tf.cond(finite, clean, exact)

    def _exact_pairs(self, entries: list) -> tf.Tensor:
        """[NaN count, Inf count] of each entry's sources, concatenated (float32).

        Each entry is one int64 total, a NaN adding 1 and an Inf ``INF_UNIT``
        (one reduction a source: XLA compiles each reduction on its own), and
        the totals of all entries are split in two with one bitwise op each.
        An entry too large to pack is counted one kind at a time.
        """
        packed, unpacked = {}, {}
        for i, sources in enumerate(entries):
            size = sum(t.shape.num_elements() or lazy_counts.INF_UNIT for t in sources)
            if size < lazy_counts.PACKED_MAX_ELEMENTS:
                packed[i] = self._packed_total(sources)
            else:
                unpacked[i] = tf.stack([self.exact_total(kind, sources) for kind in KINDS])
        parts, position = [], {}  # position: entry -> where its counts are in parts
        if packed:
            parts.append(tf.concat(self._split_packed(tf.stack(list(packed.values()))), 0))
            position = {i: (p, len(packed) + p) for p, i in enumerate(packed)}
        offset = len(KINDS) * len(packed)
        for i, pair in unpacked.items():
            parts.append(pair)
            position[i] = (offset, offset + 1)
            offset += len(KINDS)
        values = tf.concat(parts, 0) if len(parts) > 1 else parts[0]
        # In entry order. The gather also keeps the branch a branch: XLA turns a
        # conditional whose branches hold only ops it deems cheap (elementwise
        # ops, reductions that its tree reduction rewrite leaves alone, reshapes,
        # concatenations) into a select of both, which would count every step.
        index = [p for i in range(len(entries)) for p in position[i]]
        return tf.gather(values, self.graph_constant(np.array(index, np.int32)))

    def _packed_total(self, sources) -> tf.Tensor:
        """int64: the NaN count of ``sources`` plus ``INF_UNIT`` times their Inf
        count. Each tensor's is a function traced once per dtype and shape:
        the step calls it (one op) instead of building its ops again for every
        counted tensor, and XLA converts it once per shape."""
        totals = [
            self.traced_once(("packed", signature([t])), self._packed_total_of, t)(t)
            for t in sources
            if t.dtype.is_floating
        ]
        return scalar_total(totals) if totals else self.graph_constant(np.array(0, np.int64))

    def _packed_total_of(self, t: tf.Tensor) -> tf.Tensor:
        one, unit, zero = (
            self.graph_constant(np.array(v, np.int64)) for v in (1, lazy_counts.INF_UNIT, 0)
        )
        return tf.reduce_sum(tf.where(self.is_nan(t), one, tf.where(self.is_inf(t), unit, zero)))

    def _split_packed(self, totals: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """(NaN counts, Inf counts), float32, of packed totals (int64: each the
        NaN count plus ``2**32`` times the Inf count)."""
        low_bits = self.graph_constant(np.array(lazy_counts.INF_UNIT - 1, np.int64))
        shift = self.graph_constant(np.array(lazy_counts.INF_UNIT.bit_length() - 1, np.int64))
        both = tf.cast(
            tf.stack(
                [tf.bitwise.bitwise_and(totals, low_bits), tf.bitwise.right_shift(totals, shift)]
            ),
            tf.float32,
        )
        return both[0], both[1]
