"""One record as the rules read it, and the helpers the rules share.

:class:`Case` wraps a :class:`~tb_nanwatch.evidence.recorded.Record` (and the
offending batch when at hand); every rule test is a function
``Case -> Finding | None``. Pure Python and NumPy.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from tb_nanwatch.evidence import diagnosis
from tb_nanwatch.evidence.recorded import Record, Series
from tb_nanwatch.evidence.schema import Entry

# A final sigmoid/softmax whose |logit| is above this outputs exactly 0 or 1 in float32.
SATURATED_LOGIT = 15.0
MAX_LISTED = 10
MAGNITUDE_KINDS = ("input", "activation", "logits")


@dataclasses.dataclass(frozen=True)
class Finding:
    """What a rule saw: its sentence and the numbers that support it."""

    text: str
    evidence: dict


@dataclasses.dataclass
class Case:
    """One record as the rules read it (built once per diagnosis)."""

    rec: Record
    batch: object = None

    @property
    def incident(self) -> dict:
        return self.rec.incident or {}

    @property
    def step(self) -> int | None:
        return self.rec.step

    @property
    def vector(self) -> np.ndarray | None:
        return None if self.step is None else self.rec.vector(self.step)

    def origin_entry(self) -> Entry | None:
        """The schema entry of the incident's origin tensor (the non-finite
        one when the step's vector is at hand)."""
        matches = [
            e
            for e in self.rec.schema.diagnosed()
            if e.phase == self.incident.get("phase") and e.tensor == self.incident.get("tensor")
        ]
        vector = self.vector
        if vector is not None:
            bad = [e for e in matches if diagnosis.entry_nonfinite(vector, e)]
            matches = bad or matches
        return matches[0] if matches else None

    def header(self, field: str, step: int) -> float | None:
        """A step header field: from the flight window, else the series."""
        vector = self.rec.vector(step)
        if vector is not None:
            return float(vector[self.rec.schema.header_index(field)])
        if self.rec.series is not None:
            return self.rec.series.value(field, step)
        return None

    def text(self) -> str:
        """The incident in words: kind, step, phase and where."""
        kind = diagnosis.KIND_TEXT.get(str(self.incident.get("kind")), "NaN or Inf")
        where = self.incident.get("layer") or self.incident.get("tensor")
        return f"{kind} at step {self.step} in the {self.incident.get('phase')} phase ({where})"

    def mixed_precision(self) -> bool:
        """A float16 Keras policy (or, not recorded, a loss scale at the step)."""
        policy = self.rec.summary.get("dtype_policy")
        if isinstance(policy, str):
            return "float16" in policy and "bfloat16" not in policy
        scale = self.header("loss_scale", self.step) if self.step is not None else None
        return scale is not None and scale > 0

    def outputs_probabilities(self) -> bool:
        """A model output ends in a sigmoid/softmax (its logits were recorded before it)."""
        return any(e.before_final_activation for e in self.rec.schema.find(kind="logits"))


def clean_evidence(evidence: dict) -> dict:
    """``evidence`` without the unknown (None) items, NumPy scalars as Python numbers."""
    clean = {}
    for name, value in evidence.items():
        if isinstance(value, (np.floating, np.integer)):
            value = value.item()
        if value is not None:
            clean[name] = value
    return clean


def text_or_none(value: object) -> str | None:
    return value if isinstance(value, str) else None


def max_abs(vector: np.ndarray, entry: Entry) -> float:
    """The largest |x| of ``entry`` in ``vector`` (from its min and max)."""
    low, high = vector[entry.index("min")], vector[entry.index("max")]
    return float(max(abs(low), abs(high)))


def count(vector: np.ndarray, entry: Entry) -> int | float:
    """The NaN + Inf element count of ``entry`` in ``vector``."""
    total = float(vector[entry.index("nan")]) + float(vector[entry.index("inf")])
    return int(total) if math.isfinite(total) else total


def abs_logits(series: Series) -> np.ndarray | None:
    """The largest |logit| of each series step (NaN where either bound is)."""
    if "logit_min" not in series.columns or "logit_max" not in series.columns:
        return None
    low = np.abs(series.columns["logit_min"].astype(np.float64))
    high = np.abs(series.columns["logit_max"].astype(np.float64))
    return np.maximum(low, high)  # NaN propagates


def signal(series: Series, name: str) -> np.ndarray | None:
    """A series signal as magnitudes: ``logits`` (largest |logit|) or a column."""
    if name == "logits":
        return abs_logits(series)
    if name in series.columns:
        return np.abs(series.columns[name].astype(np.float64))
    return None


def is_target(entry: Entry) -> bool:
    """A target entry ("target", or "target for output <name>"; older runs:
    "target <name>"): not a layer's input."""
    return is_target_tensor(entry.tensor)


def is_target_tensor(tensor: object) -> bool:
    return isinstance(tensor, str) and (tensor == "target" or tensor.startswith("target "))


def weights_at_start(case: Case) -> dict | None:
    """The run summary's ``weights_at_start`` when well formed, else None."""
    checked = case.rec.summary.get("weights_at_start")
    if not isinstance(checked, dict) or not isinstance(checked.get("nonfinite", []), list):
        return None
    return checked


def weights_before(case: Case, layer: str | None) -> str | None:
    """How the layer's weights are known finite before the step, or None."""
    checked = weights_at_start(case)
    if checked is not None and not checked.get("nonfinite"):
        return "all weights checked finite when training began"
    recorded = case.rec.schema.find(phase="update", kind="weights")
    owned = [e for e in recorded if e.layer == layer]
    if not recorded:
        return None
    if not owned:
        return "the layer has no weights"
    previous = case.rec.vector(case.step - 1) if case.step else None
    if previous is not None and not any(diagnosis.entry_nonfinite(previous, e) for e in owned):
        return f"finite after the update of step {case.step - 1}"
    return None


def predecessors(case: Case, origin: Entry) -> list[Entry]:
    """The recorded model inputs and layer outputs before ``origin`` (in
    execution order; targets feed the loss, not the layers)."""
    before = []
    for entry in case.rec.schema.diagnosed():
        if entry is origin or entry.offset >= origin.offset:
            break
        if entry.kind in MAGNITUDE_KINDS and not is_target(entry):
            before.append(entry)
    return before


def largest_layer(case: Case) -> tuple[str | None, float | None]:
    """The forward tensor with the largest finite max |x| at the incident step."""
    vector = case.vector
    if vector is None:
        return None, None
    best, name = -1.0, None
    for entry in case.rec.schema.diagnosed():
        if entry.kind in MAGNITUDE_KINDS and not diagnosis.entry_nonfinite(vector, entry):
            magnitude = max_abs(vector, entry)
            if math.isfinite(magnitude) and magnitude > best:
                best, name = magnitude, entry.layer or entry.tensor
    return name, (best if name is not None else None)
