"""Finds where a non-finite value was born, and when a run started to explode.

The one home of the incident rule: which watched tensor is non-finite
(:func:`is_nonfinite`), which tensor of a step is the origin
(:func:`find_origin`), and, step by step, whether the run has its incident or
its explosion onset (:class:`RunDiagnosis`). Pure Python and NumPy: used by
the journal while training and by the readers (views, the cause engine, report).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Iterable, Sequence

import numpy as np

from tb_nanwatch.evidence.options import WatchOptions
from tb_nanwatch.evidence.schema import Entry, Schema


def is_nonfinite(nan_count: float, inf_count: float) -> bool:
    """The rule for one watched tensor: non-finite exactly when its NaN or Inf
    element count is non-zero (a NaN count is non-zero too).

    The counts alone decide: a norm that overflows float32 over finite
    elements, or a min/max of an empty tensor, is no NaN/Inf of the tensor.
    The compiled step (``recorder``), the journal, the heatmap, the step table
    and the cause engine all apply this rule, through the functions of this module.
    """
    return not (nan_count == 0 and inf_count == 0)


def nonfinite_kind(nan_count: float, inf_count: float) -> str | None:
    """``"nan"``, ``"inf"``, ``"nan+inf"`` or None from two element counts."""
    has_nan = not (nan_count == 0)  # a NaN count is itself non-zero
    has_inf = not (inf_count == 0)
    if has_nan and has_inf:
        return "nan+inf"
    if has_nan:
        return "nan"
    if has_inf:
        return "inf"
    return None


def entry_nonfinite(vector: np.ndarray, entry: Entry) -> bool:
    """Whether ``entry`` is non-finite in ``vector`` (see :func:`is_nonfinite`)."""
    return is_nonfinite(vector[entry.index("nan")], vector[entry.index("inf")])


def find_origin(schema: Schema, vector: np.ndarray) -> dict | None:
    """The first non-finite tensor of one step, in diagnosis order.

    Entries are laid out input -> forward (execution order) -> loss ->
    backward (reverse execution order) -> update, so the first non-finite
    entry is the one whose predecessors are all finite.
    Returns ``{"phase", "layer", "tensor", "kind"}`` (and ``"micro_batch"`` in a step
    with gradient accumulation) or None if all finite.
    """
    index = schema.diagnosed_index()
    if not index.entries:
        return None
    vector = np.asarray(vector)
    # is_nonfinite, vectorized (this runs every training step).
    nonfinite = (vector[index.nan] != 0) | (vector[index.inf] != 0)
    if not nonfinite.any():
        return None
    entry = index.entries[int(nonfinite.argmax())]
    origin = {
        "phase": entry.phase,
        # The loss belongs to no layer; the tensor text names the output.
        "layer": None if entry.phase == "loss" else entry.layer,
        "tensor": entry.tensor,
        "kind": nonfinite_kind(vector[entry.index("nan")], vector[entry.index("inf")]),
    }
    if entry.micro_batch is not None:
        origin["micro_batch"] = entry.micro_batch
    return origin


# -- steps a recovering watcher undoes ----------------------------------------


def undone_entries(schema: Schema, whole_step: bool) -> list[Entry]:
    """The entries whose NaN/Inf makes ``on_nonfinite="skip"``/``"rewind"``
    undo a step: those before the update (input..backward), or, with
    ``whole_step`` (``pre_step_weights="every_step"``: the weights are copied
    before every step), the update's too. The compiled step applies the same
    rule (``record/in_step/step_undo.py``), so the host knows which steps it undid."""
    return [e for e in schema.diagnosed() if whole_step or e.phase != "update"]


class UndoneSteps:
    """The host's copy of the compiled step's undo rule: a step is undone when
    one of :func:`undone_entries` holds a NaN/Inf and the loss scaler did not
    skip the step (its skipped steps are its own, and never incidents)."""

    def __init__(self, schema: Schema, whole_step: bool) -> None:
        entries = undone_entries(schema, whole_step)
        counts = schema.indices(entries, "nan") + schema.indices(entries, "inf")
        self._counts = np.array(counts, np.intp)
        index = schema.diagnosed_index()
        self._all_counts = np.concatenate([index.nan, index.inf]).astype(np.intp)
        self._skipped = schema.header_index("skipped")

    def undone(self, vector: np.ndarray) -> bool:
        """Whether the compiled step undid the step of ``vector``."""
        return self.verdict(vector) == "undone"

    def verdict(self, vector: np.ndarray) -> str | None:
        """``"undone"``; ``"kept"`` for a non-finite step the compiled step
        could not undo (an update-phase NaN/Inf without a copy of every step);
        None for a finite step or one the loss scaler skipped."""
        vector = np.asarray(vector)
        if vector[self._skipped] > 0 or not np.count_nonzero(vector[self._all_counts]):
            return None  # (a NaN count is non-zero)
        return "undone" if np.count_nonzero(vector[self._counts]) else "kept"


# -- the per-step verdict -----------------------------------------------------

# The kind of an incident whose NaN/Inf was not recorded, see UNRECORDED_ORIGIN.
UNKNOWN_KIND = "nonfinite"

# Human text of each incident kind (served to the frontend by evidence/vocabulary.py).
KIND_TEXT = {"nan": "NaN", "inf": "Inf", "nan+inf": "NaN and Inf", UNKNOWN_KIND: "NaN or Inf"}

# What an incident says when the loss scaler skipped steps while every recorded
# tensor was finite: the scaled gradients it found non-finite are not among
# the recorded tensors, so there is no origin tensor and no known NaN/Inf kind.
UNRECORDED_ORIGIN = {
    "phase": "backward",
    "layer": None,
    "tensor": "the loss scaler's scaled gradients (not recorded; every recorded tensor was finite)",
    "kind": UNKNOWN_KIND,
}


@dataclasses.dataclass(frozen=True)
class StepPlace:
    """Where a step is in training: what an incident reports besides its origin."""

    step: int
    epoch: int
    batch: int
    # Added to the incident as is (e.g. which replica went non-finite first).
    extra: dict | None = None


@dataclasses.dataclass(frozen=True)
class StepSignals:
    """The step's scalars the explosion rule watches (also the series' columns)."""

    loss: float
    grad_norm: float
    logit_min: float
    logit_max: float


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The diagnosis of one step.

    ``origin``: the step's first non-finite tensor (see :func:`find_origin`),
    or None. ``skipped``: the loss scaler skipped the step. ``incident``: the
    run's first incident when this step declared it (it may be dated at an
    earlier step: the first of a skip streak), else None. ``explosion``: the
    explosion onset when this step confirmed it, else None.
    """

    origin: dict | None
    skipped: bool
    incident: dict | None
    explosion: dict | None
    signals: StepSignals

    @property
    def nonfinite(self) -> bool:
        return self.origin is not None


def from_loss_scaler(incident: dict | None) -> bool:
    """Whether ``incident`` was declared by a loss-scaler rule (skip streak or
    loss-scale floor) rather than by a non-finite step the scaler kept."""
    return bool(incident and incident.get("note"))


class RunDiagnosis:
    """Judges the steps of one run, in order: the one home of the incident rule.

    A step is an incident when a recorded tensor is non-finite and the loss
    scaler did not skip the step; a skipped step (normal under mixed
    precision) becomes one only when the scale falls below
    ``min_loss_scale`` or the skips reach ``max_consecutive_skips`` in a row
    (both read from ``options``, as is the ``explosion_factor`` of the
    :class:`ExplosionDetector`). Only the first incident of a run is reported.
    """

    def __init__(self, schema: Schema, options: WatchOptions) -> None:
        self.schema = schema
        self.options = options
        self.signal_reader = SignalReader(schema)
        self.explosion = ExplosionDetector(
            self.signal_reader.signals, factor=options.explosion_factor
        )
        self.incident: dict | None = None
        self._streak: tuple[StepPlace, np.ndarray] | None = None
        self._header = {f: schema.header_index(f) for f in schema.header().fields}
        self._lr = LearningRateJumps()
        self._learning = LearningScale(schema)
        # What can make a step an incident: every count, and "skipped".
        index = schema.diagnosed_index()
        self._incident_fields = np.concatenate([index.nan, index.inf, [self._header["skipped"]]])

    def header(self, vector: np.ndarray, field: str) -> float:
        """A header field (``"loss"``, ``"loss_scale"``, ...) of ``vector``."""
        return float(vector[self._header[field]])

    def may_be_incident(self, vector: np.ndarray) -> bool:
        """Whether judging ``vector`` (the next step) may declare the run's
        incident: none is known yet, and a count is non-zero or the loss
        scaler skipped the step. False means :meth:`judge` returns no incident."""
        if self.incident is not None:
            return False
        # One gather, one count (a NaN is non-zero).
        return np.count_nonzero(np.asarray(vector)[self._incident_fields]) > 0

    def judge(self, place: StepPlace, vector: np.ndarray) -> Verdict:
        """The verdict of the next step; ``vector`` is its statistics.

        At the run's incident the explosion detector is finished (a signal
        still above its line explodes then, see :class:`ExplosionDetector`).
        """
        origin = find_origin(self.schema, vector)
        skipped = bool(self.header(vector, "skipped"))
        incident = None
        if self.incident is None:
            incident = self._incident_rule(place, vector, origin, skipped)
            self.incident = incident
        self._lr.update(place.step, self.header(vector, "lr"))
        signals = self.signal_reader.step_signals(vector)
        scale = self._learning.update(vector, signals.loss)
        if scale is not None:
            self.explosion.raise_scale(scale)
        explosion = self.explosion.update(place.step, self.signal_reader.values(vector, signals))
        if incident is not None and explosion is None:
            explosion = self.explosion.finish()
        return Verdict(origin, skipped, incident, self._lr.annotate(explosion), signals)

    def finish(self) -> dict | None:
        """The run ended: the explosion onset if a signal is still above its
        line (see :meth:`ExplosionDetector.finish`), else None."""
        return self._lr.annotate(self.explosion.finish())

    def rewound(self) -> None:
        """The run went back to a rewind point (``on_nonfinite="rewind"``):
        the steps from here on are judged afresh. The explosion detector and
        the learning-rate jumps start over (the exploded values are no
        reference for the rewound run, and a remedy's lower rate is no jump),
        and a loss scaler's skip streak ends. The run's first incident stays."""
        detector = self.explosion
        self.explosion = ExplosionDetector(detector.signals, factor=detector.factor)
        self._lr = LearningRateJumps()
        self._learning = LearningScale(self.schema)
        self._streak = None

    def _incident_rule(
        self, place: StepPlace, vector: np.ndarray, origin: dict | None, skipped: bool
    ) -> dict | None:
        if not skipped:
            self._streak = None
            return None if origin is None else self._incident(place, vector, origin)
        if self._streak is None:
            self._streak = (place, vector.copy())
        scale = self.header(vector, "loss_scale")
        floor = self.options.min_loss_scale
        if 0 < scale < floor:
            note = f"loss scale fell to {scale:g}, below the floor {floor:g}"
            return self._incident(place, vector, origin, note)
        first, first_vector = self._streak
        streak = place.step - first.step + 1
        limit = self.options.max_consecutive_skips
        if limit and streak >= limit:
            note = f"{streak} consecutive steps skipped by the loss scaler"
            first_origin = find_origin(self.schema, first_vector)
            return self._incident(first, first_vector, first_origin, note)
        return None

    def _incident(
        self, place: StepPlace, vector: np.ndarray, origin: dict | None, note: str | None = None
    ) -> dict:
        incident = {
            "step": int(place.step),
            **(origin or UNRECORDED_ORIGIN),
            "epoch": int(place.epoch),
            "batch": int(place.batch),
            "iterations": _count(self.header(vector, "iterations")),
            "loss": self.header(vector, "loss"),
        }
        if note:
            incident["note"] = note
        incident.update(place.extra or {})
        return incident


# A loss falls steadily over the last STEADY_STEPS finite steps (at least
# STEADY_MIN_STEPS) when the median of their later half is below that of their
# earlier half and the last value is below the first (one batch's loss is noisy).
STEADY_STEPS = 10
STEADY_MIN_STEPS = 3


def falling_steadily(losses: Sequence[float]) -> bool:
    """Whether a loss series (oldest first) falls steadily (see STEADY_STEPS)."""
    values = [v for v in losses if math.isfinite(v)]
    if len(values) < STEADY_MIN_STEPS or not values[-1] < values[0]:
        return False
    half = len(values) // 2
    return float(np.median(values[-half:])) < float(np.median(values[:half]))


class LearningScale:
    """A regression learning the scale of its targets: while the loss falls
    steadily, the outputs growing toward the targets' recorded range are
    healthy. Each step gives the targets' largest |x| so far when the loss is
    falling steadily (the explosion detector's reference for outputs and
    activations never falls below it), else None."""

    def __init__(self, schema: Schema) -> None:
        targets = [
            e
            for e in schema.find(phase="input", kind="input")
            if isinstance(e.tensor, str)
            and (e.tensor == "target" or e.tensor.startswith("target "))
        ]
        self._bounds = np.array(
            schema.indices(targets, "min") + schema.indices(targets, "max"), np.intp
        )
        self._losses: collections.deque[float] = collections.deque(maxlen=STEADY_STEPS)
        self._scale = 0.0

    def update(self, vector: np.ndarray, loss: float) -> float | None:
        """Feeds one step's statistics vector and loss."""
        if not len(self._bounds):
            return None
        bounds = np.abs(np.asarray(vector)[self._bounds].astype(np.float64))
        bounds = bounds[np.isfinite(bounds)]
        return self.step(loss, float(bounds.max()) if len(bounds) else math.nan)

    def step(self, loss: float, target_abs: float) -> float | None:
        """Feeds one step's loss and its targets' largest |x| (NaN: not known)."""
        self._losses.append(float(loss))
        if math.isfinite(target_abs):
            self._scale = max(self._scale, target_abs)
        if self._scale <= 1.0 or not falling_steadily(self._losses):
            return None
        return self._scale


class ExplosionDetector:
    """Flags the onset of a blow-up, with or without a NaN/Inf after it.

    The rule, applied separately to each watched signal (``loss``: |total
    loss|, ``grad_norm``: the global gradient norm, ``logits``: the largest
    |logit|, ``activation``: each layer's largest |output|); non-finite values
    are skipped:

    1. The *reference level* of a step is the lowest median so far of the last
       ``reference_steps`` values before it (from step 1 on: the first steps
       are their own reference, so a jump from step 0 to step 1 counts), never
       below ``floor_ratio`` x its lowest median over the first
       ``reference_steps`` steps (a loss trained down to 1e-6 does not make a
       later 1e-3 an explosion), and, for logits and activations, never below
       1 (growth from ~0 to an ordinary size is no explosion), nor, once
       the loss has fallen steadily with targets recorded, below the targets'
       largest |x| (:meth:`raise_scale`: a regression learning targets of
       1e5 grows its outputs toward them, which is no explosion). These
       ``reference_steps`` are the detector's own: not the watcher's
       ``window`` (the flight recorder's length).
    2. A value is *above the line* when it exceeds ``factor`` x the reference.
       The signal explodes when it stays above the line ``patience`` steps in
       a row, or when the run ends or goes non-finite (:meth:`finish`) while
       its last value is above the line: a spike that comes back down never
       counts, a climb cut short by the end of the run always does.
    3. The *onset* is the first step of the unbroken stretch above ``rise`` x
       the reference that ends in the explosion: where the climb became
       visible, not where it crossed the line.

    The first signal (earliest onset) to explode is reported, once per run:
    ``{"step": onset, "signal": name, "factor": value / reference, "value":
    the signal's last value, "reference": its reference level}``, plus
    ``"layer"`` for an activation signal. ``factor`` is the one growth ratio
    of the explosion: what the card and the cause text show.
    """

    def __init__(
        self,
        signals: Sequence[tuple[str, str | None]] = (
            ("loss", None),
            ("grad_norm", None),
            ("logits", None),
        ),
        factor: float = WatchOptions.explosion_factor,
        reference_steps: int = 25,
        patience: int = 3,
        floor_ratio: float = 0.1,
        rise: float = 10.0,
    ) -> None:
        if not factor > rise or not rise > 1:
            raise ValueError("explosion factor must exceed rise, and rise must exceed 1")
        if reference_steps < 1 or patience < 1:
            raise ValueError("reference_steps and patience must be at least 1")
        self.signals = [(str(name), layer) for name, layer in signals]
        self.factor = factor
        self.patience = patience
        self.floor_ratio = floor_ratio
        self.rise = rise
        size = len(self.signals)
        self._unit = np.array([name in UNIT_SIGNALS for name, _ in self.signals])
        # The last reference_steps values of each signal (NaN: none yet).
        self._ring = np.full((reference_steps, size), np.nan)
        self._pos = np.zeros(size, np.intp)
        self._columns = np.arange(size)
        self._count = np.zeros(size, np.intp)
        self._initial = np.full(size, np.nan)
        self._frozen = np.zeros(size, bool)
        self._lowest = np.full(size, np.inf)
        self._above = np.zeros(size, np.int64)
        self._stretch = np.full(size, -1, np.int64)
        self._ratio = np.zeros(size)
        self._value = np.zeros(size)
        # For _steady_update, once every signal's ring is full: the
        # reference's floor (fixed from then on), how many values of a ring
        # must lie below a level before its median can, and the ring's middle.
        self._floor_line: np.ndarray | None = None
        # Each signal's reference never falls below its scale (see raise_scale).
        self._scale = np.zeros(size)
        self._half = -(-reference_steps // 2)
        self._middle = [(reference_steps - 1) // 2, reference_steps // 2]
        self.onset: dict | None = None

    def update(self, step: int, values: Sequence[float]) -> dict | None:
        """Feeds one step (one value per signal, in ``signals`` order);
        returns the onset the first time a signal explodes."""
        values = np.abs(np.asarray(values, np.float64))
        finite = np.isfinite(values)
        if self._floor_line is not None and finite.all():
            steady = self._steady_update(step, values)
            if steady is not False:
                return steady
        reference = self._reference(finite)
        judged = finite & (reference > 0)
        ratio = np.divide(values, reference, out=np.zeros_like(values), where=judged)
        rising = judged & (ratio > self.rise)
        started = rising & (self._stretch < 0)
        self._stretch[started] = step
        self._stretch[judged & ~rising] = -1
        above = judged & (ratio > self.factor)
        self._above[judged] = np.where(above[judged], self._above[judged] + 1, 0)
        self._ratio[judged] = ratio[judged]
        self._value[judged] = values[judged]
        self._push(values, finite)
        if self.onset is None and (self._above >= self.patience).any():
            return self._fire(self._above >= self.patience)
        return None

    def raise_scale(self, scale: float) -> None:
        """The outputs' and activations' reference never falls below ``scale``
        from now on: a regression learning targets of that size is no explosion
        (see :class:`RunDiagnosis`)."""
        if math.isfinite(scale) and scale > 0:
            self._scale = np.where(self._unit, np.fmax(self._scale, scale), self._scale)

    def finish(self) -> dict | None:
        """The run ended or went non-finite: a signal still above the line
        explodes now. Returns the onset if this call set it."""
        if self.onset is None and (self._above > 0).any():
            return self._fire(self._above > 0)
        return None

    def pending(self) -> list[dict]:
        """Every signal whose last value is above the line, earliest onset
        first (what :meth:`finish` would choose from)."""
        found = [self._onset(int(i)) for i in np.flatnonzero(self._above > 0)]
        return sorted(found, key=lambda o: o["step"])

    def _reference(self, finite: np.ndarray) -> np.ndarray:
        """Each signal's reference level before this step (NaN: none yet)."""
        known = self._count > 0
        if known.all() and (self._count == self._ring.shape[0]).all():
            median = np.median(self._ring, axis=0)
        else:
            ring = np.where(known, self._ring, 0.0)
            median = np.where(known, np.nanmedian(ring, axis=0), np.nan)
        # The floor's base: the lowest median while the ring first fills,
        # frozen then (a jump in the first steps cannot raise it).
        warm = known & ~self._frozen
        self._initial = np.where(warm, np.fmin(self._initial, median), self._initial)
        self._frozen |= self._count == self._ring.shape[0]
        self._lowest = np.where(known, np.fmin(self._lowest, median), self._lowest)
        floor_line = self.floor_ratio * self._initial
        floor_line = np.where(self._unit, np.fmax(floor_line, 1.0), floor_line)
        if self._floor_line is None and self._frozen.all():
            self._floor_line = floor_line
        return np.where(known, np.fmax(np.fmax(self._lowest, floor_line), self._scale), np.nan)

    def _steady_update(self, step: int, values: np.ndarray) -> dict | None | bool:
        """:meth:`update` once every ring is full, for a step whose values
        are all finite: the same rule in a few times less time than the
        general path (it runs on every training step; the timing is in
        bench/history/RESULTS-history.md). False when a reference is 0 (the
        general path judges that step).

        A median can only lower ``_lowest`` if half the ring lies below
        it, so medians are taken only for the signals where it does (a
        loss trained down, typically).
        """
        ring, lowest = self._ring, self._lowest
        may_lower = (ring < lowest).sum(axis=0) >= self._half
        if may_lower.any():
            columns = np.flatnonzero(may_lower)
            # np.median of the full rings, without its overhead.
            middle = np.partition(ring[:, columns], self._middle, axis=0)[self._middle]
            lowest[columns] = np.fmin(lowest[columns], (middle[0] + middle[1]) / 2)
        reference = np.fmax(np.fmax(lowest, self._floor_line), self._scale)
        if not (reference > 0).all():
            return False
        ratio = values / reference
        rising = ratio > self.rise
        self._stretch = np.where(rising, np.where(self._stretch < 0, step, self._stretch), -1)
        self._above = np.where(ratio > self.factor, self._above + 1, 0)
        self._ratio = ratio
        self._value = values
        ring[self._pos, self._columns] = values
        self._pos = (self._pos + 1) % ring.shape[0]
        exploded = self._above >= self.patience
        if self.onset is None and exploded.any():
            return self._fire(exploded)
        return None

    def _push(self, values: np.ndarray, finite: np.ndarray) -> None:
        columns = np.flatnonzero(finite)
        self._ring[self._pos[columns], columns] = values[columns]
        self._pos[columns] = (self._pos[columns] + 1) % self._ring.shape[0]
        self._count[columns] = np.minimum(self._count[columns] + 1, self._ring.shape[0])

    def _onset(self, index: int) -> dict:
        name, layer = self.signals[index]
        onset = {"step": int(self._stretch[index]), "signal": name}
        if layer is not None:
            onset["layer"] = layer
        value, ratio = float(self._value[index]), float(self._ratio[index])
        onset["factor"] = ratio
        onset["value"] = value
        onset["reference"] = value / ratio if ratio > 0 else None
        return onset

    def _fire(self, candidates: np.ndarray) -> dict:
        # Earliest onset; on a tie, the first signal in ``signals`` order.
        index = min(np.flatnonzero(candidates), key=lambda i: (self._stretch[i], i))
        self.onset = self._onset(int(index))
        return self.onset


# Signals whose reference level is never below 1 (see ExplosionDetector).
UNIT_SIGNALS = frozenset({"logits", "activation"})

# A learning rate that changes by this factor or more (up or down) from one
# recorded step to the next has jumped.
LR_JUMP_RATIO = 2.0
# Steps before an explosion onset (and the onset itself) searched for a jump:
# the explosion detector's default reference_steps.
LR_LOOKBACK_STEPS = 25
# Jumps a run keeps while training (a cyclic schedule jumps forever).
LR_JUMPS_KEPT = 64


def is_lr_jump(before: float, after: float) -> bool:
    """Whether the learning rate going from ``before`` to ``after`` jumped:
    both known (finite, positive) and apart by ``LR_JUMP_RATIO`` or more."""
    if not (math.isfinite(before) and math.isfinite(after) and before > 0 and after > 0):
        return False
    return max(after / before, before / after) >= LR_JUMP_RATIO


def lr_jumps(steps: Iterable[int], lrs: Iterable[float]) -> list[dict]:
    """The jumps of a learning-rate series: ``{"step", "from", "to"}`` at each
    step whose rate jumped from the last known one before it."""
    found, last = [], math.nan
    for step, lr in zip(steps, lrs, strict=True):
        lr = float(lr)
        if is_lr_jump(last, lr):
            found.append({"step": int(step), "from": last, "to": lr})
        if math.isfinite(lr) and lr > 0:
            last = lr
    return found


def lr_change_before(
    jumps: Iterable[dict], onset: int, lookback: int = LR_LOOKBACK_STEPS
) -> dict | None:
    """The largest learning-rate jump (by its ratio, up or down; the latest of
    equal ones) at most ``lookback`` steps before ``onset`` or at it, else None."""
    near = [j for j in jumps if onset - lookback <= j["step"] <= onset]
    if not near:
        return None
    return dict(max(near, key=lambda j: (abs(math.log(j["to"] / j["from"])), j["step"])))


class LearningRateJumps:
    """The learning-rate jumps of a run, step by step, for its explosion verdict."""

    def __init__(self) -> None:
        self._last = math.nan
        self._jumps: collections.deque[dict] = collections.deque(maxlen=LR_JUMPS_KEPT)

    def update(self, step: int, lr: float) -> None:
        """Feeds the rate of the next step."""
        if lr == self._last:
            return
        if is_lr_jump(self._last, lr):
            self._jumps.append({"step": int(step), "from": self._last, "to": lr})
        if math.isfinite(lr) and lr > 0:
            self._last = lr

    def annotate(self, explosion: dict | None) -> dict | None:
        """``explosion`` with ``"lr_change": {"step", "from", "to"}`` when the
        rate jumped in the steps before its onset (see :func:`lr_change_before`)."""
        if explosion is not None:
            change = lr_change_before(self._jumps, int(explosion["step"]))
            if change is not None:
                explosion["lr_change"] = change
        return explosion


class SignalReader:
    """Reads the explosion detector's signals from a step's stats vector:
    loss, gradient norm, largest |logit|, then each activation's max |x|."""

    def __init__(self, schema: Schema) -> None:
        self._loss = schema.header_index("loss")
        self._grad_norm = schema.header_index("grad_norm")
        logits = schema.find(kind="logits")
        self._logit_min = np.array(schema.indices(logits, "min"), np.intp)
        self._logit_max = np.array(schema.indices(logits, "max"), np.intp)
        activations = schema.find(kind="activation")
        self._act_min = np.array(schema.indices(activations, "min"), np.intp)
        self._act_max = np.array(schema.indices(activations, "max"), np.intp)
        self.signals: list[tuple[str, str | None]] = [("loss", None), ("grad_norm", None)]
        if len(logits):
            self.signals.append(("logits", None))
        self.signals += [("activation", e.layer or e.tensor) for e in activations]

    def logit_range(self, vector: np.ndarray) -> tuple[float, float]:
        """The smallest and largest logit of the step (NaN, NaN: no logits)."""
        if not len(self._logit_min):
            return math.nan, math.nan
        if len(self._logit_min) == 1:
            return float(vector[self._logit_min[0]]), float(vector[self._logit_max[0]])
        return float(np.min(vector[self._logit_min])), float(np.max(vector[self._logit_max]))

    def step_signals(self, vector: np.ndarray) -> StepSignals:
        """The step's loss, gradient norm and logit extremes (NaN: no logits)."""
        low, high = self.logit_range(vector)
        return StepSignals(float(vector[self._loss]), float(vector[self._grad_norm]), low, high)

    def values(self, vector: np.ndarray, signals: StepSignals | None = None) -> np.ndarray:
        """One value per signal, in ``signals`` order (NaN where unknown);
        ``signals``: the vector's :meth:`step_signals`, if already read."""
        vector = np.asarray(vector)
        step = signals if signals is not None else self.step_signals(vector)
        head = [abs(step.loss), abs(step.grad_norm)]
        if len(self._logit_min):
            low, high = step.logit_min, step.logit_max
            head.append(max(abs(low), abs(high)) if not math.isnan(low + high) else math.nan)
        layers = np.maximum(np.abs(vector[self._act_min]), np.abs(vector[self._act_max]))
        return np.concatenate([head, layers], dtype=np.float64)


def _count(value: float) -> int | None:
    """A recorded count, None when it was not recorded (NaN: a TF1 graph without a global step)."""
    return int(value) if math.isfinite(value) else None
