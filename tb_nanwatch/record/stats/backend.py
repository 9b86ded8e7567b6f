"""The statistics backend: what differs between a graph step and an XLA step.

A backend is made once for the step being built
(:func:`tb_nanwatch.record.stats.choose.for_current_graph`)
and handed to what builds its statistics (the statistics builder, the phase
statistics, the device record). It holds every cache of that build: graph
constants, functions traced once for a signature, each tensor's results
shared by the entries that read it (a gradient watched twice is reduced
once). :class:`StatsBackend` is the interface and the part both backends
share; :class:`~tb_nanwatch.record.stats.graph.GraphStats` and
:class:`~tb_nanwatch.record.stats.xla.XlaStats` are the two kinds.

Each field is computed per replica as a partial (a sum, a min, a max, a
mean or a sum of squares) as few ops as possible, each one full pass at
most: on a CPU every small op costs microseconds of executor time, and
under XLA each reduction is a kernel to compile (see docs/xla.md).
"""

from __future__ import annotations

import functools
import weakref

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import control_flow_util

from tb_nanwatch.record.stats import lazy_counts
from tb_nanwatch.record.stats.lazy_counts import KINDS, LazyCount, TakenCount, scalar_total


def in_xla() -> bool:
    """Whether the graph being built is compiled by XLA."""
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


class DeviceFacts:
    """Facts of this process's TensorFlow and devices that a backend may ask,
    each probed eagerly when first asked. The recorder owns one for its run,
    so the steps it builds (one backend each) probe each fact once."""

    @functools.cached_property
    def minmax_propagates_nan(self) -> bool:
        """Whether ``reduce_min``/``reduce_max`` return NaN for a tensor holding one."""
        with tf.init_scope():
            ok = True
            for size in (7, 4099):
                for where in (0, size // 2, size - 1):
                    probe = tf.tensor_scatter_nd_update(
                        tf.range(size, dtype=tf.float32), [[where]], [float("nan")]
                    )
                    low, high = tf.reduce_min(probe), tf.reduce_max(probe)
                    ok = ok and bool(tf.math.is_nan(low)) and bool(tf.math.is_nan(high))
        return ok

    @functools.cached_property
    def host_only(self) -> bool:
        """Whether the process has no GPU and no TPU."""
        with tf.init_scope():
            return not any(tf.config.list_logical_devices(k) for k in ("GPU", "TPU"))


def f32(t) -> tf.Tensor:
    return tf.cast(t, tf.float32)


class StatsBackend:
    """Builds the statistics of one step; holds that build's caches."""

    # Whether the batch stash and the weight copies may start empty and take
    # their shape when first written (XLA cannot give a variable a new shape).
    growable_copies = True
    # Whether reduce_min/reduce_max return NaN for a tensor holding one (then
    # an activation's min + max is its trigger).
    minmax_propagates_nan = False

    def __init__(self, facts: DeviceFacts | None = None) -> None:
        self.facts = facts if facts is not None else DeviceFacts()
        self._constants: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._functions: dict = {}  # see traced_once
        # Each tensor's results shared by the entries that read it, by ref().
        self._half_sum_squares: dict = {}
        self._triggers: dict = {}

    # -- conditionals --------------------------------------------------------------

    def rare_cond(self, pred: tf.Tensor, true_fn, false_fn):
        """``tf.cond`` for a branch that almost never runs."""
        raise NotImplementedError

    def rare_assign(self, pred: tf.Tensor, assign, carry: list[tf.Tensor] = ()) -> list:
        """Runs ``assign`` (variable assignments, nothing returned) when ``pred``.

        Returns ``carry``, tensors that the step uses after the assignments,
        unchanged; their later users wait for ``assign``'s reads."""
        raise NotImplementedError

    # -- elementwise tests -------------------------------------------------------------

    def is_nan(self, t: tf.Tensor) -> tf.Tensor:
        return tf.math.is_nan(t)

    def is_inf(self, t: tf.Tensor) -> tf.Tensor:
        return tf.math.is_inf(t)

    def is_finite(self, t: tf.Tensor) -> tf.Tensor:
        return tf.math.is_finite(t)

    def all_finite(self, values: list[tf.Tensor]) -> tf.Tensor:
        """A scalar bool: whether every one of ``values`` (scalars of one dtype) is finite."""
        stacked = values[0] if len(values) == 1 else tf.stack(values)
        return tf.reduce_all(self.is_finite(stacked))

    # -- exact counts -----------------------------------------------------------------

    def exact_count(self, kind: str, t: tf.Tensor) -> tf.Tensor:
        """Number of NaN (``kind="nan"``) or +-Inf elements of ``t``, float32."""
        if not t.dtype.is_floating:
            return tf.constant(0.0)
        flags = self.is_nan(t) if kind == "nan" else self.is_inf(t)
        return tf.reduce_sum(tf.cast(flags, tf.float32))

    def exact_total(self, kind: str, sources) -> tf.Tensor:
        """The NaN (``kind="nan"``) or Inf count of all of ``sources``, float32."""
        return scalar_total([self.exact_count(kind, t) for t in sources])

    def exact(self, count) -> tf.Tensor:
        """A count field as a float32 tensor: a :class:`LazyCount` built now, a
        :class:`TakenCount` cast, else as is."""
        if isinstance(count, LazyCount):
            return self.exact_total(count.kind, count.sources)
        if isinstance(count, TakenCount):
            return f32(count.value)
        return count

    def exact_nonfinite_count(self, fields: dict) -> tf.Tensor:
        """The exact NaN + Inf count of an entry's fields, built afresh here
        (call it inside a conditional's branch to pay for it only there)."""
        return scalar_total([self.exact(fields[kind]) for kind in KINDS])

    def lazy_count_values(self, counts: list[LazyCount], phases: list[str], maybe_nonfinite):
        """Every count of ``counts`` as one float32 vector, in order (``phases``:
        each one's phase; ``maybe_nonfinite()``: the builder's check of every
        count so far)."""
        raise NotImplementedError

    def any_counted(self, counts: list[tf.Tensor]) -> tf.Tensor:
        """A scalar bool: whether any of ``counts`` (int32 scalars) is not 0."""
        return f32(tf.reduce_max(tf.stack(counts))) > 0

    # -- entries -----------------------------------------------------------------------

    def trigger(self, t: tf.Tensor) -> tf.Tensor:
        """A float32 scalar that is non-finite whenever ``t`` holds a NaN or
        Inf (its sum; made once per tensor)."""
        if not t.dtype.is_floating:
            return tf.constant(0.0)
        key = t.ref()
        if key not in self._triggers:
            self._triggers[key] = tf.reduce_sum(f32(t))
        return self._triggers[key]

    def transient_counts_of(
        self, tensors: list[tf.Tensor], trigger_value: tf.Tensor, hold_triggers=None
    ) -> dict:
        """``{"nan": ..., "inf": ...}`` of tensors the step frees before its
        end (activations, gradients), on ``trigger_value``."""
        raise NotImplementedError

    def low_high(self, t: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """(min, max) of ``t`` as float32 scalars."""
        # min and max are exact in any dtype: reduce first, cast the scalars.
        rank = t.shape.rank
        if rank is None:
            return f32(tf.reduce_min(t)), f32(tf.reduce_max(t))
        axes = self.graph_constant(np.arange(rank, dtype=np.int32))
        return f32(tf.raw_ops.Min(input=t, axis=axes)), f32(tf.raw_ops.Max(input=t, axis=axes))

    def tensor_fields(self, tensors: list[tf.Tensor], taken_extremes: bool = False) -> dict:
        """nan/inf counts, min and max over a list of tensors (float32).

        With ``taken_extremes`` (for the builder) a backend may give one
        tensor's min and max in a form the builder converts later."""
        pairs = [self.low_high(t) for t in tensors]
        low, high = overall_extremes(pairs)
        floating = [t for t in tensors if t.dtype.is_floating]
        if not floating:
            zero = tf.constant(0.0)
            return {"nan": zero, "inf": zero, "min": low, "max": high}
        if len(floating) == len(tensors) and self.minmax_propagates_nan:
            # NaN anywhere makes a tensor's min or max NaN, and an Inf makes it
            # infinite, so min + max is non-finite exactly when a count can be
            # non-zero. Summed per tensor: the min and max of several tensors'
            # pairs may drop a NaN.
            trigger = scalar_total([tensor_low + tensor_high for tensor_low, tensor_high in pairs])
        else:
            trigger = scalar_total([self.trigger(t) for t in floating])
        return {**self.transient_counts_of(floating, trigger), "min": low, "max": high}

    def half_sum_squares(self, t) -> tf.Tensor:
        """sum(t**2) / 2 as float32, made once per tensor (a tensor watched
        twice is reduced once)."""
        if isinstance(t, tf.IndexedSlices):
            t = t.values
        key = t.ref()
        if key not in self._half_sum_squares:
            self._half_sum_squares[key] = self._half_sum_squares_of(t)
        return self._half_sum_squares[key]

    def _half_sum_squares_of(self, t: tf.Tensor) -> tf.Tensor:
        return tf.nn.l2_loss(f32(t))  # one fused op

    def sum_squares(self, t) -> tf.Tensor:
        """Sum of squares of ``t``, float32."""
        return 2.0 * self.half_sum_squares(t)

    def gradient_fields(self, grads: list) -> dict[str, tf.Tensor]:
        """nan/inf counts and the half sum of squares (``norm``) of gradients.

        ``None`` (a tensor the loss does not depend on) counts as a zero gradient.
        """
        grads = dense_gradients(grads)
        if not grads:
            zero = tf.constant(0.0)
            return {"nan": zero, "inf": zero, "norm": zero}
        squares = [self.half_sum_squares(g) for g in grads]
        # The sum of squares is NaN or Inf whenever a gradient holds one: it is
        # the trigger of the lazy counts, at no extra cost.
        norm = scalar_total(squares)
        counts = self.transient_counts_of(grads, norm, hold_triggers=squares)
        return {**counts, "norm": norm}

    def gradient_fields_each(self, grads: list) -> list[dict[str, tf.Tensor]]:
        """:meth:`gradient_fields` of each of ``grads`` alone."""
        return [self.gradient_fields([g]) for g in grads]

    def value_fields(self, t: tf.Tensor) -> dict:
        """Lazy nan/inf counts of ``t`` (a weight read after the update), on its
        sum. Not held: the read shares the variable's buffer, which lives on
        after the step anyway."""
        if not t.dtype.is_floating:
            zero = tf.constant(0.0)
            return {"nan": zero, "inf": zero}
        return lazy_counts.counts_of([t], self.trigger(t))

    def value_fields_each(self, tensors: list[tf.Tensor]) -> list[dict]:
        """:meth:`value_fields` of each of ``tensors``."""
        return [self.value_fields(t) for t in tensors]

    def partial(self, value) -> tf.Tensor:
        """A min, max, mean or sum-of-squares field as the builder keeps it."""
        return f32(value)

    def finish_extremes(self, partials: dict[str, list]) -> None:
        """Turns the min and max ``partials`` into float32 tensors, in place
        (only a backend that defers them has work here)."""

    # -- build helpers -----------------------------------------------------------------

    def graph_constant(self, value: np.ndarray) -> tf.Tensor:
        """``tf.constant(value)``, made once per graph (every small op made at
        trace time costs Python time and a node for the graph optimizer)."""
        graph = tf.compat.v1.get_default_graph()
        key = (value.dtype.name, value.shape, value.tobytes())
        constants = self._constants.setdefault(graph, {})
        if key not in constants:
            constants[key] = tf.constant(value)
        return constants[key]

    def traced_once(self, key: tuple, function, *examples):
        """``function`` traced for the signatures of ``examples`` (tensors, specs
        or lists of them), once per ``key`` in this build."""
        if key not in self._functions:
            specs = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), examples)
            traced = tf.function(function, autograph=False, reduce_retracing=False)
            self._functions[key] = traced.get_concrete_function(*specs)
        return self._functions[key]


def overall_extremes(pairs: list[tuple[tf.Tensor, tf.Tensor]]) -> tuple[tf.Tensor, tf.Tensor]:
    """(min, max) over several tensors' (min, max) pairs."""
    if len(pairs) == 1:
        return pairs[0]
    low = tf.reduce_min(tf.stack([p[0] for p in pairs]))
    high = tf.reduce_max(tf.stack([p[1] for p in pairs]))
    return low, high


def dense_gradients(grads: list) -> list[tf.Tensor]:
    """``grads`` without ``None``, each IndexedSlices as its values."""
    return [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads if g is not None]
