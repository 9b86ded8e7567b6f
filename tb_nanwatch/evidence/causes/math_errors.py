"""Rules on math errors: a layer, the loss or a derivative made the first
NaN/Inf from finite inputs; and ``unknown``, what was seen when no rule fits.

Verdicts ``logits_as_probabilities`` (raw logits fed to a loss that reads
probabilities), ``forward_math``, ``loss_math``, ``backward_math``, ``unknown``; the
card's signs of a saturated output and of a finite forward pass with a
non-finite gradient.
"""

from __future__ import annotations

import math

import numpy as np

from tb_nanwatch.evidence import diagnosis, remedies
from tb_nanwatch.evidence.causes.case import (
    SATURATED_LOGIT,
    Case,
    Finding,
    abs_logits,
    count,
    largest_layer,
    max_abs,
    predecessors,
    tensor_words,
    text_or_none,
    weights_before,
)
from tb_nanwatch.evidence.remedies import fmt
from tb_nanwatch.evidence.schema import Entry

# A layer input is of ordinary size when its max |x| is at most this many times
# its median over the earlier steps of the flight window (never below 1) ...
ORDINARY_GROWTH = 100.0
# ... or, without earlier steps, at most this; and never beyond the ceiling.
ORDINARY_MAX = 1e6
ORDINARY_CEILING = 1e15


def _ordinary(case: Case, entry: Entry, magnitude: float) -> bool:
    if not math.isfinite(magnitude) or magnitude > ORDINARY_CEILING:
        return False
    earlier = []
    for step in case.rec.flight.steps:
        vector = case.rec.flight.vector(step)
        if step < case.step and not diagnosis.entry_nonfinite(vector, entry):
            earlier.append(max_abs(vector, entry))
    earlier = [m for m in earlier if math.isfinite(m)]
    if not earlier:
        return magnitude <= ORDINARY_MAX
    return magnitude <= ORDINARY_GROWTH * max(float(np.median(earlier)), 1.0)


def forward_math(case: Case) -> Finding | None:
    """A layer's inputs were finite and of ordinary size, its output was not."""
    if case.incident.get("phase") != "forward":
        return None
    origin, vector = case.origin_entry(), case.vector
    if origin is None or vector is None:
        return None
    inputs = [(max_abs(vector, e), e) for e in predecessors(case, origin)]
    if not all(_ordinary(case, e, m) for m, e in inputs):
        return None
    layer = case.incident.get("layer")
    weights = weights_before(case, layer)
    if weights is None:
        return None  # the layer's own weights may have been broken already
    # The layer's own input: the tensor recorded just before its output.
    own, own_max = (inputs[-1][1], inputs[-1][0]) if inputs else (None, None)
    own_words = tensor_words(own.tensor) if own is not None else None
    seen = f" ({own_words}, largest |x| {fmt(own_max)})" if own is not None else ""
    return Finding(
        f"{layer} turned a finite input of ordinary size{seen} into {case.text()}: a math "
        "error inside the layer.",
        {
            "layer": layer,
            "tensor": case.incident.get("tensor"),
            "kind": case.incident.get("kind"),
            "step": case.step,
            "nonfinite_values": count(vector, origin),
            "input_tensor": own_words,
            "input_max_abs": own_max,
            "weights_before": weights,
        },
    )


def _max_abs_logit(case: Case) -> float | None:
    vector = case.vector
    values = []
    if vector is not None:
        for entry in case.rec.schema.find(kind="logits"):
            if not diagnosis.entry_nonfinite(vector, entry):
                values.append(max_abs(vector, entry))
    elif case.rec.series is not None:
        logits, index = abs_logits(case.rec.series), case.rec.series.index_of(case.step)
        if logits is not None and index is not None:
            values.append(float(logits[index]))
    values = [v for v in values if math.isfinite(v)]
    return max(values) if values else None


def loss_math(case: Case) -> Finding | None:
    """The predictions were finite, the loss was not."""
    if case.incident.get("phase") != "loss" or diagnosis.from_loss_scaler(case.rec.incident):
        return None
    logit = _max_abs_logit(case)
    logits = case.output_word() == "logits"
    saturated = logits and logit is not None and logit > SATURATED_LOGIT
    from_logits = case.rec.summary.get("loss_from_logits")
    unit = "|logit|" if logits else "the largest |output|"
    detail = (
        f"; the final activation was saturated (|logit| {fmt(logit)})"
        if saturated
        else (f"; {unit} was {fmt(logit)}" if logit is not None else "")
    )
    typical = (
        "typically log(0) of a probability rounded to 0 or 1"
        if case.outputs_probabilities() or from_logits is not None
        else "a log, sqrt or division at 0, or a value too large to square"
    )
    return Finding(
        f"The predictions were finite and the loss was not ({case.text()}): the loss "
        f"function broke, {typical}{detail}.",
        {
            "step": case.step,
            "tensor": case.incident.get("tensor"),
            "kind": case.incident.get("kind"),
            "max_abs_logit" if logits else "max_abs_output": logit,
            "saturated": saturated,
            "saturation_threshold": SATURATED_LOGIT,
            "outputs_probabilities": case.outputs_probabilities(),
            "from_logits": from_logits if isinstance(from_logits, bool) else "not recorded",
        },
    )


def backward_math(case: Case) -> Finding | None:
    """The forward pass and the loss were finite, a derivative was not."""
    if case.incident.get("phase") != "backward" or diagnosis.from_loss_scaler(case.rec.incident):
        return None
    loss = case.header("loss", case.step)
    if loss is None or not math.isfinite(loss):
        return None
    layer = case.incident.get("layer")
    return Finding(
        f"The forward pass and the loss ({fmt(loss)}) were finite, then {case.text()}: "
        f"a derivative inside {layer} is infinite at a finite input (sqrt or log at 0, pow, "
        "a custom gradient).",
        {
            "layer": layer,
            "tensor": case.incident.get("tensor"),
            "kind": case.incident.get("kind"),
            "step": case.step,
            "loss": loss,
        },
    )


def unknown(case: Case) -> Finding:
    """An incident no rule explains: what was seen, and no guess."""
    layer, largest = largest_layer(case)
    return Finding(
        f"{case.text()}; the recorded evidence fits no known cause.",
        {
            "phase": case.incident.get("phase"),
            "layer": case.incident.get("layer"),
            "tensor": case.incident.get("tensor"),
            "kind": case.incident.get("kind"),
            "step": case.step,
            "note": case.incident.get("note"),
            "largest_layer": layer,
            "largest_max_abs": largest,
        },
    )


def saturated_output(case: Case) -> Finding | None:
    """Sign: the loss broke on a saturated final sigmoid/softmax: use from_logits."""
    rec = case.rec
    if rec.phase != "loss" or rec.step is None:
        return None
    entries = [e for e in rec.schema.find(kind="logits") if e.before_final_activation]
    if not entries:
        return None
    best, output = -math.inf, None
    vector = rec.vector(rec.step)
    if vector is not None:
        for entry in entries:
            magnitude = max_abs(vector, entry)
            if math.isfinite(magnitude) and magnitude > best:
                best, output = magnitude, entry.layer
    elif rec.series is not None:
        values = abs_logits(rec.series)
        index = rec.series.index_of(rec.step)
        if values is not None and index is not None and math.isfinite(values[index]):
            best = float(values[index])
            output = entries[0].layer if len(entries) == 1 else None
    if not best > SATURATED_LOGIT:
        return None
    where = f" of output {output}" if output else ""
    return Finding(
        f"At step {rec.step} the logits{where} reached |{fmt(best, 4)}| (above "
        f"{SATURATED_LOGIT:g}): the final sigmoid/softmax outputs exactly 0 or 1 in "
        "float32, and a cross-entropy computed on these probabilities takes log(0). "
        "Remove the final activation and use from_logits=True (or compute the loss "
        "from the logits).",
        {"max_abs_logit": best, "threshold": SATURATED_LOGIT, "output": output, "step": rec.step},
    )


def backward_origin(case: Case) -> Finding | None:
    """Sign: the forward pass and loss were finite; a gradient was not."""
    rec = case.rec
    if rec.phase != "backward" or rec.step is None or not rec.incident.get("layer"):
        return None
    if diagnosis.from_loss_scaler(rec.incident):
        return None  # the loss scaler's rule, not one op's gradient
    loss = None
    output_min = output_max = None
    vector = rec.vector(rec.step)
    if vector is not None:
        for entry in rec.schema.entries:
            if entry.phase not in ("input", "forward", "loss"):
                continue
            if diagnosis.entry_nonfinite(vector, entry):
                return None
            values = rec.schema.values(vector, entry)
            if entry.kind == "loss" and entry.layer is None:
                loss = values["value"]
            if entry.kind == "activation" and entry.layer == rec.incident["layer"]:
                output_min, output_max = values["min"], values["max"]
    elif rec.series is not None:
        loss = rec.series.value("loss", rec.step)
    if loss is None or not math.isfinite(loss):
        return None
    layer = rec.incident["layer"]
    return Finding(
        f"At step {rec.step} the forward pass and the loss ({fmt(loss, 4)}) were finite, "
        f"but the {rec.incident.get('tensor')} was {rec.incident.get('kind', 'NaN')}: "
        f"an op in {layer} has an infinite derivative at a finite input, typically "
        "sqrt, log, pow or a division at 0 (d/dx sqrt(x) is infinite at x = 0). Add "
        "an epsilon (sqrt(x + 1e-12)), clip the input away from 0, or use a safe op.",
        {
            "layer": layer,
            "tensor": str(rec.incident.get("tensor")),
            "step": rec.step,
            "loss": float(loss),
            "output_min": output_min,
            "output_max": output_max,
        },
    )


# Steps of finite loss on raw outputs that _learned_on_raw_outputs needs.
LEARNED_STEPS = 5


def _first_outputs(case: Case) -> tuple[int | None, float | None, float | None]:
    """(the first recorded step, its smallest output, its largest output):
    the flight window's model outputs, else the series' logit range."""
    flight = case.rec.flight
    entries = [e for e in case.rec.schema.find(kind="logits") if not e.before_final_activation]
    if flight is not None and flight.matrix.shape[0] and entries:
        vector = flight.vector(flight.first_step)
        finite = [e for e in entries if not diagnosis.entry_nonfinite(vector, e)]
        if finite:
            low = min(float(vector[e.index("min")]) for e in finite)
            high = max(float(vector[e.index("max")]) for e in finite)
            return flight.first_step, low, high
    series = case.rec.series
    if series is not None and len(series) and {"logit_min", "logit_max"} <= set(series.columns):
        low, high = (float(series.columns[k][0]) for k in ("logit_min", "logit_max"))
        if math.isfinite(low) and math.isfinite(high):
            return int(series.steps[0]), low, high
    return None, None, None


def _learned_on_raw_outputs(case: Case) -> bool:
    """Whether the loss learned while the outputs were no probabilities (below
    0 or above 1): over at least LEARNED_STEPS steps before the incident with
    a finite loss and such outputs, the loss fell below half its first value.
    A loss that takes the log of raw outputs cannot: it is NaN on a negative
    one, or stuck near -log(eps) where it clips; so this loss applies its own
    softmax to logits (a hand-written cross-entropy), and the logits are right."""
    series = case.rec.series
    needed = {"loss", "logit_min", "logit_max"}
    if series is None or not len(series) or not needed <= set(series.columns):
        return False
    before = series.steps < case.step
    loss = series.columns["loss"][before]
    low, high = series.columns["logit_min"][before], series.columns["logit_max"][before]
    seen = loss[np.isfinite(loss) & ((low < 0.0) | (high > 1.0))]
    return len(seen) >= LEARNED_STEPS and float(seen.min()) < 0.5 * float(seen[0])


def _id_targets(case: Case) -> bool:
    """Every recorded target looks like class ids (whole numbers, none negative)."""
    targets = [s for s in case.data_scales() if s.target]
    return bool(targets) and all(s.integral for s in targets)


def logits_as_probabilities(case: Case) -> Finding | None:
    """The loss reads probabilities (``from_logits=False``, or a loss named
    for labels), the outputs end in no sigmoid/softmax, and the first step's
    outputs are no probabilities (negative or above 1): the log of a raw
    logit."""
    summary = case.rec.summary
    from_logits = summary.get("loss_from_logits")
    reads_probabilities = from_logits is False or (
        from_logits is None
        and case.incident.get("phase") == "loss"
        and not remedies.regression_loss(summary)
        and (remedies.classification_loss(summary) or _id_targets(case))
    )
    if not reads_probabilities or case.incident.get("phase") == "input":
        return None
    if case.outputs_probabilities() or remedies.outputs_activated(summary):
        return None
    first_step, low, high = _first_outputs(case)
    if low is None or high is None or (low >= 0.0 and high <= 1.0):
        return None
    named = from_logits is False or remedies.classification_loss(summary)
    if not named and low >= 0.0:
        return None  # a loss known only by its id-like targets: a log of a negative output
    if from_logits is None and _learned_on_raw_outputs(case):
        return None  # a loss of the user's own that learned on these outputs reads logits
    return Finding(
        f"The loss reads probabilities, but the model's outputs are raw logits: they ranged "
        f"{fmt(low)} to {fmt(high)} at step {first_step}, no sigmoid/softmax after them, until "
        f"{case.text()}: the log of a negative or zero 'probability' is NaN or -Inf.",
        {
            "output_min": low,
            "output_max": high,
            "first_step": first_step,
            "from_logits": from_logits if isinstance(from_logits, bool) else "not recorded",
            "loss": text_or_none(summary.get("loss_name")),
            "step": case.step,
        },
    )
