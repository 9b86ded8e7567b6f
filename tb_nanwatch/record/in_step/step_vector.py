"""Collects one step's statistics entry by entry and packs them into its vector.

The values of each entry come from the step's statistics backend
(:mod:`tb_nanwatch.record.stats`), chosen once for the step being built.
Each field is a per-replica partial (a sum, a min, a max, a mean or a sum of
squares); :meth:`StatsBuilder.vector` reduces the partials across replicas
before packing, so the vector means the same with one replica or eight:
counts summed, min of mins, max of maxes, norms from summed squares.
Gradients keep *half* sums of squares; the factor 2 and the square root are
applied once, to the packed vector.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import tensorflow as tf

from tb_nanwatch.evidence.schema import Schema
from tb_nanwatch.record.stats.backend import StatsBackend, f32
from tb_nanwatch.record.stats.lazy_counts import LazyCount, TakenCount, scalar_total, unique

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


def replicas_in_sync() -> int:
    """Replicas in the current replica context (1 outside any strategy)."""
    ctx = tf.distribute.get_replica_context()
    return ctx.num_replicas_in_sync if ctx is not None else 1


class _MicroBatchEntries:
    """What both builders share: the micro-batch the entries added now belong
    to (gradient accumulation: several forward/backward passes in one step);
    None for a step with one pass."""

    micro_batch: int | None = None

    @contextlib.contextmanager
    def entries_of_micro_batch(self, micro_batch: int | None) -> Iterator[None]:
        """Entries added inside belong to ``micro_batch``."""
        self.micro_batch = micro_batch
        try:
            yield
        finally:
            self.micro_batch = None


class SchemaOnlyBuilder(_MicroBatchEntries):
    """Collects the entries of a step and none of their values: for a trace
    that TensorFlow never runs (see ``StepRecorder.before_update``)."""

    records_values = False

    def __init__(self, stats: StatsBackend) -> None:
        self.stats = stats  # the step's statistics backend
        self.schema = Schema()

    def add(self, phase: str, kind: str, layer: str | None, tensor: str, fields) -> None:
        self.schema.add(phase, kind, layer, _labelled(tensor, self.micro_batch), self.micro_batch)

    def replace_header(self, fields: dict) -> None:
        """Nothing to replace: no values are recorded."""


class StatsBuilder(_MicroBatchEntries):
    """Collects fields entry by entry; ``vector()`` reduces and packs them."""

    records_values = True

    def __init__(self, stats: StatsBackend) -> None:
        self.stats = stats  # the step's statistics backend, which builds every value
        self.schema = Schema()
        # The partials of every group but "sum" (see ``_sum_specs``).
        self._partials: dict[str, list[tf.Tensor]] = {g: [] for g in _GROUPS if g != "sum"}
        self._layout: list[tuple[str, int]] = []  # vector slot -> (group, index)
        # For each diagnosed entry, the indices of its nan and inf partials in
        # the "sum" group: used for the per-replica view of where it went non-finite.
        self._count_slots: list[tuple[int, int]] = []
        self.replica_first_nonfinite: tf.Tensor | None = None
        # The "sum" group (NaN/Inf counts), one a slot: a float32 tensor or a
        # LazyCount; ``_sum_vector`` turns them into values.
        self._sum_specs: list = []
        self._sum_phases: list[str] = []  # the phase of each of _sum_specs' entries
        # What maybe_nonfinite() answered, and for how many of _sum_specs.
        self._maybe_nonfinite: tf.Tensor | None = None
        self._checked = 0

    def add(self, phase: str, kind: str, layer: str | None, tensor: str, fields) -> None:
        """Adds an entry; ``fields`` is its dict of values or a function returning it."""
        micro_batch = self.micro_batch
        entry = self.schema.add(phase, kind, layer, _labelled(tensor, micro_batch), micro_batch)
        if callable(fields):
            fields = fields()
        ops = _HEADER_OPS if kind == "header" else _FIELD_OPS
        slots = {}
        for name in entry.fields:
            group = ops[name]
            slots[name] = self._group_size(group)
            self._layout.append((group, slots[name]))
            value = fields[name]
            if group == "sum":
                counted = isinstance(value, (LazyCount, TakenCount))
                self._sum_specs.append(value if counted else f32(value))
                self._sum_phases.append(phase)
            else:
                self._partials[group].append(self.stats.partial(value))
        if kind != "header":
            self._count_slots.append((slots["nan"], slots["inf"]))

    def replace_header(self, fields: dict) -> None:
        """Gives the header (the first entry) new values for ``fields`` (some
        of its field names): a step with several micro-batches knows its loss
        and gradient norm only after the last one."""
        header = self.schema.header()
        for name, (group, index) in zip(header.fields, self._layout, strict=False):
            if name in fields:
                self._partials[group][index] = self.stats.partial(fields[name])

    def _group_size(self, group: str) -> int:
        return len(self._sum_specs) if group == "sum" else len(self._partials[group])

    def _local_first_nonfinite(self, sums: tf.Tensor) -> tf.Tensor:
        """Ordinal (among diagnosed entries) of this replica's first non-finite
        entry, before any cross-replica reduction; ``len(entries)`` if none."""
        if not self._count_slots:
            return tf.constant(0.0)
        nan_idx = tf.constant([n for n, _ in self._count_slots], tf.int32)
        inf_idx = tf.constant([i for _, i in self._count_slots], tf.int32)
        nonfinite = (tf.gather(sums, nan_idx) + tf.gather(sums, inf_idx)) > 0
        nonfinite = tf.concat([nonfinite, [True]], 0)
        return tf.cast(tf.argmax(tf.cast(nonfinite, tf.int32), output_type=tf.int32), tf.float32)

    def maybe_nonfinite(self) -> tf.Tensor:
        """A cheap scalar bool: may any entry added so far be non-finite?

        False guarantees every NaN/Inf count so far is 0; True is almost
        always a real NaN/Inf (or a finite tensor whose sum overflows). A
        later call checks only the entries added since and reuses the earlier
        answer.
        """
        specs = self._sum_specs[self._checked :]
        earlier, self._checked = self._maybe_nonfinite, len(self._sum_specs)
        triggers = unique([s.trigger for s in specs if isinstance(s, LazyCount)])
        checks = [earlier] if earlier is not None else []
        if triggers:
            checks.append(tf.logical_not(self.stats.all_finite(triggers)))
        taken = unique([s.value for s in specs if isinstance(s, TakenCount)])
        if taken:
            checks.append(self.stats.any_counted(taken))
        eager = [s for s in specs if not isinstance(s, (LazyCount, TakenCount))]
        if eager:
            checks.append(scalar_total(eager) > 0)
        if not checks:
            result = tf.constant(False)
        else:
            result = checks[0]
            for check in checks[1:]:
                result = tf.logical_or(result, check)
        self._maybe_nonfinite = result
        return result

    def _sum_vector(self) -> tf.Tensor:
        """The exact "sum" partials (NaN/Inf counts), the lazy ones as the backend computes them."""
        specs = self._sum_specs
        if not specs:
            return tf.zeros([0], tf.float32)
        taken = [i for i, s in enumerate(specs) if isinstance(s, TakenCount)]
        if taken:
            # Cast all at once; from here on they are eager values.
            specs = list(specs)
            values = tf.cast(tf.stack([specs[i].value for i in taken]), tf.float32)
            for i, value in zip(taken, tf.unstack(values), strict=True):
                specs[i] = value
        lazy = [i for i, s in enumerate(specs) if isinstance(s, LazyCount)]
        eager = [i for i, s in enumerate(specs) if not isinstance(s, LazyCount)]
        if not lazy:
            return tf.stack([specs[i] for i in eager])
        lazy_values = self.stats.lazy_count_values(
            [specs[i] for i in lazy], [self._sum_phases[i] for i in lazy], self.maybe_nonfinite
        )
        return _in_slot_order(specs, eager, lazy, lazy_values)

    def vector(self) -> tf.Tensor:
        """The packed float32 vector, reduced across replicas when needed."""
        self.stats.finish_extremes(self._partials)
        sums = self._sum_vector()
        replicas = replicas_in_sync()
        if replicas == 1:
            # One replica: nothing to reduce, and the host needs no
            # per-replica first non-finite entry (it reads the vector itself).
            self.replica_first_nonfinite = self.stats.graph_constant(np.array([-1.0], np.float32))
            extremes = self._partials["min"] + self._partials["max"] + self._partials["mean"]
            stacked = {"extremes": _stack(extremes), "sumsq": _stack(self._partials["sumsq"])}
            return self._in_layout(stacked, sums)
        stacked = {g: _stack(v) for g, v in self._partials.items()}
        ctx = tf.distribute.get_replica_context()
        local_first_nonfinite = self._local_first_nonfinite(sums)
        reduced = ctx.all_reduce(
            tf.distribute.ReduceOp.SUM, tf.concat([sums, stacked["sumsq"], stacked["mean"]], 0)
        )
        n_sum, n_sq = len(self._sum_specs), len(self._partials["sumsq"])
        sums = reduced[:n_sum]
        stacked["sumsq"] = reduced[n_sum : n_sum + n_sq]
        mean = reduced[n_sum + n_sq :] / float(replicas)
        # One all_gather carries the extremes and each replica's first
        # non-finite entry (which replica went non-finite first).
        gathered = ctx.all_gather(
            tf.stack([tf.concat([-stacked["min"], stacked["max"], [local_first_nonfinite]], 0)]),
            axis=0,
        )
        self.replica_first_nonfinite = gathered[:, -1]
        extremes = tf.reduce_max(gathered[:, :-1], axis=0)
        n_min = len(self._partials["min"])
        stacked["extremes"] = tf.concat([-extremes[:n_min], extremes[n_min:], mean], 0)
        return self._in_layout(stacked, sums)

    def _in_layout(self, stacked: dict, sums: tf.Tensor) -> tf.Tensor:
        """The vector in slot order from ``stacked["extremes"]`` (the min, max
        and mean groups one after another), ``stacked["sumsq"]`` (half sums
        of squares) and ``sums``."""
        norms = tf.sqrt(2.0 * stacked["sumsq"])  # the partials are half sums
        offsets, start = {}, 0
        for g in ("min", "max", "mean", "sumsq", "sum"):
            offsets[g] = start
            start += self._group_size(g)
        index = [offsets[g] + i for g, i in self._layout]
        flat = tf.concat([stacked["extremes"], norms, sums], 0)
        return tf.gather(flat, self.stats.graph_constant(np.array(index, np.int32)))


def _labelled(tensor: str, micro_batch: int | None) -> str:
    """The entry's text, with its micro-batch in front when it has one."""
    return tensor if micro_batch is None else f"micro-batch {micro_batch}: {tensor}"


def _stack(values: list) -> tf.Tensor:
    return tf.stack(values) if values else tf.zeros([0], tf.float32)


def _in_slot_order(specs: list, eager: list[int], lazy: list[int], lazy_values) -> tf.Tensor:
    """The eager values and ``lazy_values`` (in ``lazy``'s order) back in slot order."""
    if not eager:
        return lazy_values
    parts = tf.concat([tf.stack([specs[i] for i in eager]), lazy_values], 0)
    where = {i: k for k, i in enumerate(eager + lazy)}
    return tf.gather(parts, tf.constant([where[i] for i in range(len(specs))], tf.int32))
