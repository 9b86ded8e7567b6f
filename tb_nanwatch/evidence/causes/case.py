"""One record as the rules read it, and the helpers the rules share.

:class:`Case` wraps a :class:`~tb_nanwatch.evidence.recorded.Record` (and the
offending batch when at hand); every rule test is a function
``Case -> Finding | None``. Pure Python and NumPy.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from tb_nanwatch.evidence import diagnosis, remedies
from tb_nanwatch.evidence.recorded import Record, Series
from tb_nanwatch.evidence.remedies import DataScale
from tb_nanwatch.evidence.schema import Entry, Schema

# A final sigmoid/softmax whose |logit| is above this outputs exactly 0 or 1 in float32.
SATURATED_LOGIT = 15.0
MAX_LISTED = 10
# A learning rate that rises this many times from one step to the next jumped.
RATE_JUMP = 10.0
MAGNITUDE_KINDS = ("input", "activation", "logits")
# Input names that say nothing: such an input is "the model input".
GENERIC_INPUT_NAMES = ("input", "inputs")
MODEL_INPUT = "model input "


@dataclasses.dataclass(frozen=True)
class Finding:
    """What a rule saw: its sentence and the numbers that support it."""

    text: str
    evidence: dict
    title: str | None = None  # a sign's title when it differs from its rule's


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
        if self.incident.get("phase") == "input":
            where = tensor_words(self.incident.get("tensor"))
        return f"{kind} at step {self.step} in the {self.incident.get('phase')} phase ({where})"

    def output_word(self) -> str:
        """ "logits" or "outputs": see :func:`output_word`."""
        return output_word(self.rec.summary, self.rec.schema)

    def data_scales(self) -> tuple[DataScale, ...]:
        """The range of each model input and target over the flight window's
        steps up to the incident (finite steps only); integer id inputs
        (recorded ``input_dtypes``) left out."""
        flight = self.rec.flight
        if flight is None or not flight.matrix.shape[0]:
            return ()
        last = self.step if self.step is not None else flight.steps[-1]
        vectors = [flight.vector(s) for s in flight.steps if s <= last]
        scales = []
        for entry in self.rec.schema.find(phase="input", kind="input"):
            if not is_target(entry) and _id_input(self.rec.summary, entry.layer):
                continue
            finite = [v for v in vectors if not diagnosis.entry_nonfinite(v, entry)]
            if not finite:
                continue
            low = min(float(v[entry.index("min")]) for v in finite)
            high = max(float(v[entry.index("max")]) for v in finite)
            if math.isfinite(low) and math.isfinite(high):
                words = tensor_words(entry.tensor)
                scale = DataScale(str(entry.layer), words, low, high, is_target(entry))
                scales.append(dataclasses.replace(scale, not_scale=self._not_scale(scale)))
        return tuple(scales)

    def _not_scale(self, scale: DataScale) -> str | None:
        """Why a recorded range is no evidence of the data's scale, or None."""
        summary = self.rec.summary
        if scale.target:
            labels = remedies.classification_loss(summary) or self.outputs_probabilities()
            return "class ids" if labels and scale.integral else None
        return "normalised by the model" if remedies.normalizes_inputs(summary) else None

    def first_loss(self) -> tuple[int | None, float | None]:
        """(the first recorded step, its loss): from the series, else the flight window."""
        series = self.rec.series
        if series is not None and len(series) and "loss" in series.columns:
            return int(series.steps[0]), float(series.columns["loss"][0])
        flight = self.rec.flight
        if flight is not None and flight.matrix.shape[0]:
            return flight.first_step, self.header("loss", flight.first_step)
        return None, None

    def rate_jump(self) -> dict | None:
        """The last upward learning-rate jump of :data:`RATE_JUMP` x or more
        from one recorded step to the next, up to the incident (or the
        explosion onset): ``{"step", "from", "to"}``, or None."""
        end = self.step
        if end is None and isinstance((self.rec.explosion or {}).get("step"), int):
            end = self.rec.explosion["step"]
        steps, rates = [], []
        series = self.rec.series
        if series is not None and len(series) and "lr" in series.columns:
            steps, rates = series.steps.tolist(), series.columns["lr"].tolist()
        elif self.rec.flight is not None and self.rec.flight.matrix.shape[0]:
            steps = list(self.rec.flight.steps)
            rates = [self.header("lr", s) for s in steps]
        if end is not None:
            kept = [(s, r) for s, r in zip(steps, rates, strict=True) if s <= end]
            steps, rates = [s for s, _ in kept], [r for _, r in kept]
        jumps = [
            j
            for j in diagnosis.lr_jumps(steps, [math.nan if r is None else r for r in rates])
            if j["to"] >= RATE_JUMP * j["from"]
        ]
        return jumps[-1] if jumps else None

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


def output_word(summary: dict, schema: Schema) -> str:
    """ "logits" where the model outputs feed a sigmoid/softmax (their logits
    were recorded before it) or a from-logits loss, else "outputs" (a
    regression's outputs are no logits)."""
    reads_logits = summary.get("loss_from_logits") is True
    before_activation = any(e.before_final_activation for e in schema.find(kind="logits"))
    return "logits" if reads_logits or before_activation else "outputs"


def _id_input(summary: dict, name: str | None) -> bool:
    """Whether the model input ``name`` was recorded as an integer (ids, not values)."""
    dtypes = summary.get("input_dtypes")
    dtype = dtypes.get(name) if isinstance(dtypes, dict) else None
    return isinstance(dtype, str) and ("int" in dtype or dtype == "bool")


def tensor_words(tensor: object) -> str:
    """A recorded tensor as the texts name it: a model input by its name in
    quotes (``model input 'price'``), or ``the model input`` when its name
    says nothing; never "model input input"."""
    text = str(tensor)
    if text.startswith(MODEL_INPUT):
        name = text[len(MODEL_INPUT) :]
        return "the model input" if name in GENERIC_INPUT_NAMES else f"{MODEL_INPUT}'{name}'"
    if text == "target" or text.startswith("target for output "):
        return f"the {text}"
    return text


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


def largest_tensor(case: Case) -> tuple[Entry | None, float | None]:
    """The forward tensor (a model input or a layer's output) with the largest
    finite max |x| at the incident step."""
    vector = case.vector
    if vector is None:
        return None, None
    best, found = -1.0, None
    for entry in case.rec.schema.diagnosed():
        if entry.kind in MAGNITUDE_KINDS and not diagnosis.entry_nonfinite(vector, entry):
            magnitude = max_abs(vector, entry)
            if math.isfinite(magnitude) and magnitude > best:
                best, found = magnitude, entry
    return found, (best if found is not None else None)


def largest_layer(case: Case) -> tuple[str | None, float | None]:
    """:func:`largest_tensor` by name: the layer's, or the model input's words."""
    entry, largest = largest_tensor(case)
    return (entry_name(entry) if entry is not None else None), largest


def entry_name(entry: Entry) -> str:
    """A forward entry's name in the texts: its layer, or a model input's words."""
    if entry.kind == "input" or not entry.layer:
        return tensor_words(entry.tensor)
    return entry.layer


def output_words(entry: Entry) -> str:
    """What the texts say for the values of a forward entry: ``dense_2's
    output``, ``the model input``."""
    if entry.kind == "input" or not entry.layer:
        return tensor_words(entry.tensor)
    return f"{entry.layer}'s output"
