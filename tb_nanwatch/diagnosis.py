"""Finds where a non-finite value was born, and when a run started to explode.

The one home of the incident rule: which watched tensor is non-finite
(:func:`is_nonfinite`), which tensor of a step is the origin
(:func:`find_origin`), and, step by step, whether the run has its incident or
its explosion onset (:class:`RunDiagnosis`). Pure Python and NumPy: used by
the journal while training and by the readers (views, hints, report).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import math

import numpy as np

from tb_nanwatch.schema import Entry, Schema


def is_nonfinite(nan_count: float, inf_count: float) -> bool:
    """The rule for one watched tensor: non-finite exactly when its NaN or Inf
    element count is non-zero (a NaN count is non-zero too).

    The counts alone decide: a norm that overflows float32 over finite
    elements, or a min/max of an empty tensor, is no NaN/Inf of the tensor.
    The compiled step (``recorder``), the journal, the heatmap, the step table
    and the hints all apply this rule, through the functions of this module.
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
    Returns ``{"phase", "layer", "tensor", "kind"}`` or None if all finite.
    """
    entries, nan_index, inf_index = _diagnosed_index(schema)
    if not entries:
        return None
    vector = np.asarray(vector)
    # is_nonfinite, vectorized (this runs every training step).
    nonfinite = (vector[nan_index] != 0) | (vector[inf_index] != 0)
    if not nonfinite.any():
        return None
    entry = entries[int(nonfinite.argmax())]
    return {
        "phase": entry.phase,
        # The loss belongs to no layer; the tensor text names the output.
        "layer": None if entry.phase == "loss" else entry.layer,
        "tensor": entry.tensor,
        "kind": nonfinite_kind(vector[entry.index("nan")], vector[entry.index("inf")]),
    }


_INDEX_ATTR = "_diagnosis_index"


def _diagnosed_index(schema: Schema) -> tuple[list[Entry], np.ndarray, np.ndarray]:
    """The diagnosed entries of ``schema`` and the vector positions of their
    nan and inf counts, cached on the schema (rebuilt if it grew)."""
    key = (len(schema.entries), schema.size)
    cached = getattr(schema, _INDEX_ATTR, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    entries = schema.diagnosed()
    nan_index = np.array(schema.indices(entries, "nan"), np.intp)
    inf_index = np.array(schema.indices(entries, "inf"), np.intp)
    index = (entries, nan_index, inf_index)
    try:
        setattr(schema, _INDEX_ATTR, (key, index))
    except AttributeError:
        pass
    return index


# -- the per-step verdict -----------------------------------------------------

# The kind of an incident whose NaN/Inf was not recorded, see UNRECORDED_ORIGIN.
UNKNOWN_KIND = "nonfinite"

# Human text of each incident kind (the frontend's format.js keeps its own).
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
class IncidentRules:
    """When a step is an incident (the watcher's options, defaults in
    :class:`~tb_nanwatch.journal.JournalSettings`)."""

    # A streak of this many steps skipped by the loss scaler is an incident,
    # dated at its first step (0: skips alone never are).
    max_consecutive_skips: int
    # A skipped step whose loss scale fell below this floor is an incident:
    # float16 cannot hold even the unscaled gradients.
    min_loss_scale: float
    # See ExplosionDetector.
    explosion_factor: float


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
    ``min_loss_scale`` or the skips reach ``max_consecutive_skips`` in a row.
    Only the first incident of a run is reported.
    """

    def __init__(self, schema: Schema, rules: IncidentRules) -> None:
        self.schema = schema
        self.rules = rules
        self.explosion = ExplosionDetector(factor=self.rules.explosion_factor)
        self.incident: dict | None = None
        self._streak: tuple[StepPlace, np.ndarray] | None = None
        self._header = {f: schema.header_index(f) for f in schema.header().fields}
        logits = schema.find(kind="logits")
        self._logit_min = np.array(schema.indices(logits, "min"), np.intp)
        self._logit_max = np.array(schema.indices(logits, "max"), np.intp)

    def header(self, vector: np.ndarray, field: str) -> float:
        """A header field (``"loss"``, ``"loss_scale"``, ...) of ``vector``."""
        return float(vector[self._header[field]])

    def signals(self, vector: np.ndarray) -> StepSignals:
        """The step's loss, gradient norm and logit extremes (NaN: no logits)."""
        if len(self._logit_min):
            low = float(np.min(vector[self._logit_min]))
            high = float(np.max(vector[self._logit_max]))
        else:
            low = high = math.nan
        return StepSignals(self.header(vector, "loss"), self.header(vector, "grad_norm"), low, high)

    def judge(self, place: StepPlace, vector: np.ndarray) -> Verdict:
        """The verdict of the next step; ``vector`` is its statistics."""
        origin = find_origin(self.schema, vector)
        skipped = bool(self.header(vector, "skipped"))
        signals = self.signals(vector)
        incident = None
        if self.incident is None:
            incident = self._incident_rule(place, vector, origin, skipped)
            self.incident = incident
        logits = max(abs(signals.logit_min), abs(signals.logit_max))
        explosion = self.explosion.update(
            place.step,
            {
                "loss": signals.loss,
                "grad_norm": signals.grad_norm,
                "logits": None if math.isnan(signals.logit_min) else logits,
            },
        )
        return Verdict(origin, skipped, incident, explosion, signals)

    def _incident_rule(
        self, place: StepPlace, vector: np.ndarray, origin: dict | None, skipped: bool
    ) -> dict | None:
        if not skipped:
            self._streak = None
            return None if origin is None else self._incident(place, vector, origin)
        if self._streak is None:
            self._streak = (place, vector.copy())
        scale = self.header(vector, "loss_scale")
        floor = self.rules.min_loss_scale
        if 0 < scale < floor:
            note = f"loss scale fell to {scale:g}, below the floor {floor:g}"
            return self._incident(place, vector, origin, note)
        first, first_vector = self._streak
        streak = place.step - first.step + 1
        limit = self.rules.max_consecutive_skips
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
            "iterations": int(self.header(vector, "iterations")),
            "loss": self.header(vector, "loss"),
        }
        if note:
            incident["note"] = note
        incident.update(place.extra or {})
        return incident


class ExplosionDetector:
    """Flags the onset of a blow-up that never produces a NaN or Inf.

    The rule, applied separately to three signals (``loss``: |total loss|,
    ``grad_norm``: the global gradient norm, ``logits``: the largest |logit|):

    1. Keep the median of the last ``window`` finite values. The *reference
       level* is the lowest such median seen so far, but never below
       ``floor_ratio`` x the first median (the level at the start of training),
       so a loss that trains down to 1e-6 does not make a later 1e-3 look like
       an explosion.
    2. The signal *explodes* when it stays above ``factor`` x the reference for
       ``patience`` consecutive steps.
    3. The *onset* is the first step of the final unbroken stretch, before
       confirmation, in which the signal was above ``rise`` x the reference:
       where the climb became visible, not where it crossed the alarm line.

    The first signal (earliest onset) to explode is reported, once per run.
    """

    SIGNALS = ("loss", "grad_norm", "logits")

    def __init__(
        self,
        factor: float = 1e3,
        window: int = 25,
        patience: int = 3,
        floor_ratio: float = 0.1,
        rise: float = 10.0,
        history: int = 4096,
    ) -> None:
        if factor <= rise or rise <= 1:
            raise ValueError("explosion factor must exceed rise, and rise must exceed 1")
        self.factor = factor
        self.window = window
        self.patience = patience
        self.floor_ratio = floor_ratio
        self.rise = rise
        self._tracks = {name: _SignalTrack(window, history) for name in self.SIGNALS}
        self.onset: dict | None = None

    def update(self, step: int, signals: dict[str, float]) -> dict | None:
        """Feeds one step; returns ``{"step", "signal"}`` the first time it fires."""
        if self.onset is not None:
            return None
        found = []
        for name, track in self._tracks.items():
            value = signals.get(name)
            if value is None or not math.isfinite(value):
                continue
            onset_step = track.update(step, abs(value), self)
            if onset_step is not None:
                found.append((onset_step, self.SIGNALS.index(name), name))
        if found:
            onset_step, _, name = min(found)
            self.onset = {"step": int(onset_step), "signal": name}
            return self.onset
        return None


class _RunningMedian:
    """The median of the last ``window`` values, O(window) per update.

    Same value as ``statistics.median`` of those values (kept sorted with
    ``bisect`` instead of sorted again at every step).
    """

    def __init__(self, window: int) -> None:
        self.maxlen = window
        self._order: collections.deque[float] = collections.deque()
        self._sorted: list[float] = []

    def __len__(self) -> int:
        return len(self._order)

    def append(self, value: float) -> None:
        if len(self._order) == self.maxlen:
            old = self._order.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._order.append(value)
        bisect.insort(self._sorted, value)

    def median(self) -> float:
        s, n = self._sorted, len(self._sorted)
        if n % 2:
            return s[n // 2]
        return (s[n // 2 - 1] + s[n // 2]) / 2


class _SignalTrack:
    def __init__(self, window: int, history: int) -> None:
        self.recent = _RunningMedian(window)
        self.history: collections.deque[tuple[int, float]] = collections.deque(maxlen=history)
        self.initial: float | None = None
        self.lowest = math.inf
        self.above = 0

    def update(self, step: int, value: float, rule: ExplosionDetector) -> int | None:
        self.history.append((step, value))
        reference = None
        if len(self.recent) == self.recent.maxlen:
            median = self.recent.median()
            if self.initial is None:
                self.initial = median
            self.lowest = min(self.lowest, median)
            reference = max(self.lowest, rule.floor_ratio * self.initial)
        self.recent.append(value)
        if reference is None or reference <= 0:
            return None
        if value > rule.factor * reference:
            self.above += 1
        else:
            self.above = 0
        if self.above < rule.patience:
            return None
        onset = step
        for past_step, past_value in reversed(self.history):
            if past_value <= rule.rise * reference:
                break
            onset = past_step
        return onset
