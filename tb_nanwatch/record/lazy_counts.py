"""NaN and Inf counts that cost nothing on a healthy step.

An exact count needs a full pass over its tensor (``is_nan``, a cast, a sum)
and, at trace time, three ops per tensor and kind. A healthy step needs
neither: every count is 0 there. So a count is a :class:`LazyCount`, a
promise rather than ops: its source tensors and a *trigger*, one float32
scalar the entry computes anyway that is non-finite whenever a source holds a
NaN or an Inf. :meth:`~tb_nanwatch.record.step_stats.StatsBuilder.vector` checks
every trigger at once and computes all the counts, with :func:`exact_counts`,
in one rarely taken ``tf.cond`` branch.

:func:`exact_counts` builds that branch from a handful of ops whatever the
number of tensors (outside XLA): each source is flattened, the sources of one
dtype are concatenated, and the counts of every source come from one
cumulative sum, read at the sources' boundaries. On the rare step that takes
the branch only the held sources (see :func:`held_if_non_finite`) are
non-empty, so the concatenation copies just the tensors that went non-finite.

Under XLA the statistics take most counts in their own pass instead (see
``step_stats.counted_in_pass``): a :class:`TakenCount` each. A tensor they
cannot take that way is counted lazily, and since XLA cannot let go of a
conditional's operand early, large activations and gradients a few entries
at a time, each chunk in a conditional of its own (:func:`counts_in_chunks`).
"""

from __future__ import annotations

import dataclasses
import weakref

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import control_flow_util, gen_array_ops

# 64 KiB of float32; see held_if_non_finite.
HOLD_MIN_ELEMENTS = 16384
_TRIGGER_ATTR = "_nanwatch_trigger"
_FINITE_ATTR = "_nanwatch_trigger_is_finite"
_HELD_ATTR = "_nanwatch_held"
_SLICE_SIZE_ATTR = "_nanwatch_slice_size"
_GRAPH_CONSTANTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Functions traced once per process (see traced_once), by signature and
# whether XLA compiles them.
_PACKED_TOTAL_FUNCTIONS: dict = {}  # one tensor's packed NaN/Inf total
_CHUNK_FUNCTIONS: dict = {}  # the count conditional of one chunk (counts_in_chunks)
KINDS = ("nan", "inf")
_INF_UNIT = 2**32
# An entry of this many elements or more could overflow its packed NaN count.
PACKED_MAX_ELEMENTS = _INF_UNIT
# See counts_in_chunks: about this many conditionals at most for XLA to
# compile; as few entries a conditional (kept alive until the last one is
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

    def exact(self) -> tf.Tensor:
        """The count built as plain ops, now (float32 scalar)."""
        return exact_total(self.kind, self.sources)


def in_xla() -> bool:
    """Whether the graph being built is compiled by XLA."""
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


# tf2xla lowers IsNan, IsInf and IsFinite through an MLIR pipeline of their
# own, one op at a time: ~4 ms each of the first step on this CPU, against
# ~1 ms for a comparison, which it lowers directly. A step watched by NanWatch
# has hundreds of them, so under XLA they are written as comparisons (XLA
# itself defines IsNan as x != x).


def is_nan(t: tf.Tensor) -> tf.Tensor:
    """``tf.math.is_nan``, as ``t != t`` under XLA."""
    return tf.math.not_equal(t, t) if in_xla() else tf.math.is_nan(t)


def is_inf(t: tf.Tensor) -> tf.Tensor:
    """``tf.math.is_inf``, as ``t == +inf or t == -inf`` under XLA."""
    if not in_xla():
        return tf.math.is_inf(t)
    inf, minus_inf = _infinities(t.dtype)
    return tf.math.logical_or(tf.math.equal(t, inf), tf.math.equal(t, minus_inf))


def is_finite(t: tf.Tensor) -> tf.Tensor:
    """``tf.math.is_finite``, as ``-inf < t < +inf`` under XLA (a NaN compares false)."""
    if not in_xla():
        return tf.math.is_finite(t)
    inf, minus_inf = _infinities(t.dtype)
    return tf.math.logical_and(tf.math.less(t, inf), tf.math.greater(t, minus_inf))


def all_finite(values: list[tf.Tensor]) -> tf.Tensor:
    """A scalar bool: whether every one of ``values`` (scalars of one dtype) is finite."""
    stacked = values[0] if len(values) == 1 else tf.stack(values)
    return tf.reduce_all(is_finite(stacked))


def _infinities(dtype: tf.DType) -> tuple[tf.Tensor, tf.Tensor]:
    return tuple(graph_constant(np.array(v, dtype.as_numpy_dtype)) for v in (np.inf, -np.inf))


def exact_count(kind: str, t: tf.Tensor) -> tf.Tensor:
    """Number of NaN (``kind="nan"``) or +-Inf elements of ``t``, float32."""
    if not t.dtype.is_floating:
        return tf.constant(0.0)
    flags = is_nan(t) if kind == "nan" else is_inf(t)
    return tf.reduce_sum(tf.cast(flags, tf.float32))


def exact_total(kind: str, sources) -> tf.Tensor:
    """The NaN (``kind="nan"``) or Inf count of all of ``sources``, float32."""
    return scalar_total([exact_count(kind, t) for t in sources])


def trigger(t: tf.Tensor) -> tf.Tensor:
    """A float32 scalar that is non-finite whenever ``t`` holds a NaN or Inf
    (its sum; cached on the tensor)."""
    if not t.dtype.is_floating:
        return tf.constant(0.0)
    return _cached(t, _TRIGGER_ATTR, lambda: tf.reduce_sum(tf.cast(t, tf.float32)))


def counts_of(sources, trigger_value: tf.Tensor, transient: bool = False) -> dict[str, LazyCount]:
    """``{"nan": ..., "inf": ...}``: the lazy counts of ``sources`` on ``trigger_value``."""
    return {kind: LazyCount(kind, tuple(sources), trigger_value, transient) for kind in KINDS}


def _cached_is_finite(trigger_value: tf.Tensor) -> tf.Tensor:
    return _cached(trigger_value, _FINITE_ATTR, lambda: is_finite(trigger_value))


def transient_counts_of(
    tensors: list[tf.Tensor], trigger_value: tf.Tensor, hold_triggers: list | None = None
) -> dict:
    """``{"nan": ..., "inf": ...}`` of tensors the step frees before its end
    (activations, gradients), on ``trigger_value``.

    Outside XLA each tensor is held (:func:`held_if_non_finite`, on its entry
    in ``hold_triggers``, by default ``trigger_value``) and counted in the
    end-of-step branch. XLA cannot let go of a conditional's operand before
    that conditional runs, and the end-of-step one kept every watched tensor
    alive to the end of the step (ResNet50: 1520 MB above resident against
    plain XLA's 257): under XLA the counts are marked ``transient`` and
    :func:`counts_in_chunks` counts them a few entries at a time instead.
    """
    if in_xla():
        transient = any(_worth_letting_go(t) for t in tensors)
        return counts_of(tensors, trigger_value, transient=transient)
    hold_triggers = hold_triggers if hold_triggers is not None else [trigger_value] * len(tensors)
    held = [held_if_non_finite(t, h) for t, h in zip(tensors, hold_triggers, strict=True)]
    return counts_of(held, trigger_value)


def counts_in_chunks(counts: list[LazyCount], phases: list[str] | None = None) -> tf.Tensor:
    """Every count of ``counts`` as one float32 vector, in order, for XLA.

    The entries of transient counts, in the order they were added (the
    order the step computes them), are counted a few at a time (one each
    when there are at most ``XLA_MAX_CONDITIONALS``), never two ``phases``
    (one label a count) in one chunk, each chunk in a conditional on its own
    triggers that runs as soon as its last entry is read; the other entries
    (small tensors, weights, alive to the end anyway) in one more. A
    conditional per entry keeps memory lowest but XLA compiles each one on its
    own (ResNet50's ~400 on a CPU: 126 s to the first step against 41 plain);
    one for all kept every tensor alive.
    """
    if not counts:
        return tf.zeros([0], tf.float32)
    phases = phases if phases is not None else [""] * len(counts)
    entries: dict[tuple, list] = {}  # (trigger, sources) -> [counts' indices]
    for i, c in enumerate(counts):
        entries.setdefault((id(c.trigger), tuple(id(t) for t in c.sources)), []).append(i)
    transient = [e for e in entries.values() if counts[e[0]].transient]
    per_chunk = max(1, -(-len(transient) // XLA_MAX_CONDITIONALS))
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
            values.append(_chunk_counts([counts[e[0]] for e in chunk]))
            emitted += chunk
    position = {i: p for p, e in enumerate(emitted) for i in e}
    index = [len(KINDS) * position[i] + KINDS.index(c.kind) for i, c in enumerate(counts)]
    flat = tf.concat(values, 0) if len(values) > 1 else values[0]
    return tf.gather(flat, graph_constant(np.array(index, np.int32)))


def _chunk_counts(entries: list[LazyCount]) -> tf.Tensor:
    """[nan, inf] of each entry, concatenated: zeros unless a trigger is non-finite.

    The conditional is a function traced once per process for each chunk
    signature (the dtypes and shapes of the triggers and sources) and called
    by every chunk of that signature: a model's repeated layers or blocks
    trace their ``tf.cond`` once, and XLA converts it once (MLP: first step
    4.4-4.6 s -> 3.9-4.1 s; bench/RESULTS.md, round 10).
    """
    triggers = [e.trigger for e in entries]
    sources = [t for e in entries for t in e.sources]
    sizes = tuple(len(e.sources) for e in entries)

    def chunk(triggers: list, sources: list) -> tf.Tensor:
        grouped, start = [], 0
        for size in sizes:
            grouped.append(sources[start : start + size])
            start += size
        return _counts_unless_finite(triggers, grouped)

    key = (signature(triggers), signature(sources), sizes, in_xla())
    return traced_once(_CHUNK_FUNCTIONS, key, chunk, triggers, sources)(triggers, sources)


def _counts_unless_finite(triggers: list, entries: list) -> tf.Tensor:
    finite = all_finite(triggers)

    def exact() -> tf.Tensor:
        return _exact_pairs(entries)

    def clean() -> tf.Tensor:
        return tf.zeros([len(KINDS) * len(entries)], tf.float32)

    return tf.cond(finite, clean, exact)


def signature(tensors: list) -> tuple:
    """The dtypes and (static) shapes of ``tensors``: what a traced function is specialized to."""
    return tuple(
        (t.dtype.name, tuple(t.shape.as_list()) if t.shape.rank is not None else None)
        for t in tensors
    )


def traced_once(cache: dict, key: tuple, function, *examples):
    """``function`` traced for the signatures of ``examples`` (tensors, specs
    or lists of them), once per ``key`` in ``cache``."""
    if key not in cache:
        specs = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), examples)
        traced = tf.function(function, autograph=False, reduce_retracing=False)
        cache[key] = traced.get_concrete_function(*specs)
    return cache[key]


def _exact_pairs(entries: list) -> tf.Tensor:
    """[NaN count, Inf count] of each entry's sources, concatenated (float32).

    Each entry is one int64 total, a NaN adding 1 and an Inf ``_INF_UNIT``
    (one reduction a source: XLA compiles each reduction on its own), and the
    totals of all entries are split in two with one bitwise op each. An
    entry too large to pack is counted one kind at a time.
    """
    packed, unpacked = {}, {}
    for i, sources in enumerate(entries):
        if sum(t.shape.num_elements() or _INF_UNIT for t in sources) < PACKED_MAX_ELEMENTS:
            packed[i] = _packed_total(sources)
        else:
            unpacked[i] = tf.stack([exact_total(kind, sources) for kind in KINDS])
    parts, position = [], {}  # position: entry -> where its NaN and Inf counts are in parts
    if packed:
        parts.append(tf.concat(_split_packed(tf.stack(list(packed.values()))), 0))
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
    return tf.gather(values, graph_constant(np.array(index, np.int32)))


def _packed_total(sources) -> tf.Tensor:
    """int64: the NaN count of ``sources`` plus ``_INF_UNIT`` times their Inf count."""
    totals = [_packed_total_function(t)(t) for t in sources if t.dtype.is_floating]
    return scalar_total(totals) if totals else graph_constant(np.array(0, np.int64))


def _packed_total_function(t: tf.Tensor):
    """The packed NaN/Inf total of one tensor of ``t``'s dtype and shape, as a
    function traced once per process: the step calls it (one op) instead of
    building its ops again for every counted tensor (a transformer counts
    ~220, most of a few shapes), and XLA converts it once per shape."""
    key = (signature([t]), in_xla())
    return traced_once(_PACKED_TOTAL_FUNCTIONS, key, _packed_total_of, t)


def _packed_total_of(t: tf.Tensor) -> tf.Tensor:
    one, unit, zero = (graph_constant(np.array(v, np.int64)) for v in (1, _INF_UNIT, 0))
    return tf.reduce_sum(tf.where(is_nan(t), one, tf.where(is_inf(t), unit, zero)))


def _split_packed(totals: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """(NaN counts, Inf counts), float32, of packed totals (int64: each the NaN
    count plus ``2**32`` times the Inf count)."""
    low_bits = graph_constant(np.array(_INF_UNIT - 1, np.int64))
    shift = graph_constant(np.array(_INF_UNIT.bit_length() - 1, np.int64))
    both = tf.cast(
        tf.stack([tf.bitwise.bitwise_and(totals, low_bits), tf.bitwise.right_shift(totals, shift)]),
        tf.float32,
    )
    return both[0], both[1]


def nonfinite_flags(t: tf.Tensor) -> list[tf.Tensor]:
    """int32, for each element of ``t``: [1 where a NaN, 1 where an Inf]; summed, its counts."""
    return [tf.cast(is_nan(t), tf.int32), tf.cast(is_inf(t), tf.int32)]


@dataclasses.dataclass(frozen=True, eq=False)
class TakenCount:
    """The NaN (``kind="nan"``) or Inf count of one or more tensors, taken
    already: ``value``, an int32 scalar (see ``step_stats.counted_in_pass``).
    The statistics builder casts all of a step's at once."""

    kind: str
    value: tf.Tensor

    def exact(self) -> tf.Tensor:
        """The count as a float32 scalar."""
        return tf.cast(self.value, tf.float32)


def taken_counts_of(nan: tf.Tensor, inf: tf.Tensor) -> dict[str, TakenCount]:
    """``{"nan": ..., "inf": ...}`` of two int32 counts."""
    return {"nan": TakenCount("nan", nan), "inf": TakenCount("inf", inf)}


def _worth_letting_go(t: tf.Tensor) -> bool:
    """Whether ``t`` is large enough (or of unknown size) that keeping it to
    the end of the step costs more than the ops that let go of it."""
    size = t.shape.num_elements()
    return size is None or size >= HOLD_MIN_ELEMENTS


def held_if_non_finite(t: tf.Tensor, trigger_value: tf.Tensor) -> tf.Tensor:
    """``t`` itself when ``trigger_value`` is non-finite, else an empty tensor.

    The exact counts run in one ``tf.cond`` at the end of the step. Had that
    cond taken ``t`` as an input, ``t``'s buffer would live until then: every
    watched activation and gradient at once, where the step alone frees each
    as soon as the backward pass is done with it (more peak memory), and the
    step's own ops that write into their input's buffer when they are its
    last user (``ReluGrad`` into the incoming gradient, the optimizer's
    ``Sub`` into a weight's gradient) would each allocate a fresh one. A
    ``Slice`` sized by the tensor's own trigger, run as soon as the trigger is
    known, is the whole tensor (the same buffer, no copy) on a step where it
    may be non-finite and an empty one otherwise: on a healthy step the
    buffer is let go of. One op a tensor, and one ``Select`` per trigger
    (a Switch/Merge hold took three ops a tensor). Eagerly, under XLA (which
    plans buffers itself) and for a tensor smaller than ``HOLD_MIN_ELEMENTS``
    (holding it costs less than the ops that would let it go), ``t`` is
    returned.
    """
    if tf.executing_eagerly() or in_xla() or not _worth_letting_go(t):
        return t
    # The same tensor is often watched twice on the same trigger (a layer's
    # input gradient is the previous layer's output gradient): hold it once.
    held_by_trigger = _cache(t, _HELD_ATTR)
    if id(trigger_value) in held_by_trigger:
        return held_by_trigger[id(trigger_value)]
    if t.shape.rank is None:
        t = tf.reshape(t, graph_constant(np.array([-1], np.int32)))
    rank = t.shape.rank
    begin = graph_constant(np.zeros([rank], np.int32))
    held = tf.raw_ops.Slice(input=t, begin=begin, size=_slice_size(trigger_value, rank))
    held_by_trigger[id(trigger_value)] = held
    return held


def _slice_size(trigger_value: tf.Tensor, rank: int) -> tf.Tensor:
    """The ``size`` of a Slice of a rank-``rank`` tensor that is all of it
    (all ``-1``) when ``trigger_value`` is non-finite, else nothing (all 0)."""
    by_rank = _cache(trigger_value, _SLICE_SIZE_ATTR)
    if rank not in by_rank:
        # Select (not SelectV2): a scalar condition just forwards one input.
        by_rank[rank] = tf.raw_ops.Select(
            condition=_cached_is_finite(trigger_value),
            x=graph_constant(np.zeros([rank], np.int32)),
            y=graph_constant(np.full([rank], -1, np.int32)),
        )
    return by_rank[rank]


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


def graph_constant(value: np.ndarray) -> tf.Tensor:
    """``tf.constant(value)``, made once per graph (every small op made at
    trace time costs Python time and a node for the graph optimizer)."""
    graph = tf.compat.v1.get_default_graph()
    key = (value.dtype.name, value.shape, value.tobytes())
    constants = _GRAPH_CONSTANTS.setdefault(graph, {})
    if key not in constants:
        constants[key] = tf.constant(value)
    return constants[key]


def _cache(t: tf.Tensor, attr: str) -> dict:
    """A dict stored on ``t`` (a fresh, unstored one if ``t`` takes no attributes)."""
    return _cached(t, attr, dict)


def _cached(t: tf.Tensor, attr: str, make):
    """``make()``, made once per tensor and kept on it (made afresh each time
    for a tensor that takes no attributes)."""
    value = getattr(t, attr, None)
    if value is None:
        value = make()
        try:
            setattr(t, attr, value)
        except AttributeError:
            pass
    return value


def exact_counts(counts: list[LazyCount]) -> tf.Tensor:
    """Every count of ``counts`` as one float32 vector, in order, in a few ops
    for all of them (see the module docstring). Outside XLA; under XLA the
    counts are :func:`counts_in_chunks`'."""
    sources: dict[int, tf.Tensor] = {}
    for c in counts:
        for t in c.sources:
            if t.dtype.is_floating:
                sources.setdefault(id(t), t)
    order = {key: i for i, key in enumerate(sources)}
    per_source = _per_source_counts(list(sources.values()))  # [2, n]: nan row, inf row
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


def _per_source_counts(sources: list[tf.Tensor]) -> tf.Tensor:
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
        parts.append(_group_counts(members, flat_shape))
        positions.extend(indices)
    counts = tf.concat(parts, 1) if len(parts) > 1 else parts[0]
    if positions == sorted(positions):
        return counts
    inverse = [positions.index(i) for i in range(len(sources))]
    return tf.gather(counts, tf.constant(inverse, tf.int32), axis=1)


def _group_counts(tensors: list[tf.Tensor], flat_shape: tf.Tensor) -> tf.Tensor:
    """[2, len(tensors)] for tensors of one dtype: one cumulative sum over
    their concatenation, read at each tensor's end and start."""
    flats = [gen_array_ops.reshape(t, flat_shape) for t in tensors]
    values = gen_array_ops.concat_v2(flats, axis=0) if len(flats) > 1 else flats[0]
    flags = tf.stack([tf.math.is_nan(values), tf.math.is_inf(values)])
    running = tf.pad(tf.cumsum(tf.cast(flags, tf.int32), axis=1), [[0, 0], [1, 0]])
    sizes = _sizes(flats)
    ends = tf.cumsum(sizes)
    at_end = tf.gather(running, ends, axis=1)
    at_start = tf.gather(running, ends - sizes, axis=1)
    return tf.cast(at_end - at_start, tf.float32)


def _sizes(flats: list[tf.Tensor]) -> tf.Tensor:
    """int32 [len(flats)]: each flat tensor's size; one op for all the static
    ones (a held tensor's size is known only when the branch runs: it is
    empty on a step where it is finite)."""
    static = [f.shape.num_elements() for f in flats]
    dynamic = [i for i, n in enumerate(static) if n is None]
    known = graph_constant(np.array([n for n in static if n is not None], np.int32))
    if not dynamic:
        return known
    measured = tf.stack([gen_array_ops.size(flats[i], out_type=tf.int32) for i in dynamic])
    if len(dynamic) == len(flats):
        return measured
    order = [i for i, n in enumerate(static) if n is not None] + dynamic
    inverse = np.argsort(np.array(order)).astype(np.int32)
    return tf.gather(tf.concat([known, measured], 0), graph_constant(inverse))
