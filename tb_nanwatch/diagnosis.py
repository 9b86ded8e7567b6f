"""Finds where a non-finite value was born, and when a run started to explode.

Pure Python and NumPy: used by the recorder while training and by readers.
"""

from __future__ import annotations

import bisect
import collections
import math

import numpy as np

from tb_nanwatch.schema import PHASES, Schema


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


def find_origin(schema: Schema, vector: np.ndarray) -> dict | None:
    """The first non-finite tensor of one step, in diagnosis order.

    Entries are laid out input -> forward (execution order) -> loss ->
    backward (reverse execution order) -> update, so the first entry with a
    non-zero NaN or Inf count is the one whose predecessors are all finite.
    Returns ``{"phase", "layer", "tensor", "kind"}`` or None if all finite.
    """
    entries, nan_index, inf_index = _diagnosed_index(schema)
    if not entries:
        return None
    vector = np.asarray(vector)
    # One vectorized pass (this runs every training step): a count is
    # "non-zero" exactly as in nonfinite_kind (a NaN count is non-zero too).
    bad = (vector[nan_index] != 0) | (vector[inf_index] != 0)
    if not bad.any():
        return None
    entry = entries[int(bad.argmax())]
    kind = nonfinite_kind(vector[entry.offset], vector[entry.offset + 1])
    return {
        "phase": entry.phase,
        # The loss belongs to no layer; the tensor text names the output.
        "layer": None if entry.phase == "loss" else entry.layer,
        "tensor": entry.tensor,
        "kind": kind,
    }


_INDEX_ATTR = "_diagnosis_index"


def _diagnosed_index(schema: Schema) -> tuple[list, np.ndarray, np.ndarray]:
    """The diagnosed entries of ``schema`` and the vector offsets of their
    nan and inf counts, cached on the schema (rebuilt if it grew)."""
    key = (len(schema.entries), schema.size)
    cached = getattr(schema, _INDEX_ATTR, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    entries = [e for e in schema.entries if e.phase in PHASES]
    nan_index = np.array([e.offset for e in entries], np.intp)
    index = (entries, nan_index, nan_index + 1)
    try:
        setattr(schema, _INDEX_ATTR, (key, index))
    except AttributeError:
        pass
    return index


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
