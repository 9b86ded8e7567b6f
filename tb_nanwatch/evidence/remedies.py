"""The remedy catalogue: what to try against a cause, and when it applies.

Each :class:`Remedy` has an id (the tab's vocabulary, :data:`REMEDY_LABELS`),
a short label, a text (a function of the :class:`Facts` of the verdict, so it
can quote the numbers of the run: the learning rate at the step, the variable
that was non-finite) and a test of when it applies, read from recorded facts
(the run summary's ``loss_from_logits``, ``dtype_policy``, ``optimizer``; the
verdict's evidence). A remedy that does not apply is never offered.

The cause engine (:mod:`tb_nanwatch.evidence.causes`) names remedies by id in
its rule table, ranked, each with the condition under which that cause offers
it; this module owns the wording. A new remedy is one :class:`Remedy` entry in
:data:`CATALOGUE`.

Pure Python, no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

# Optimizers without an epsilon in their update (type names as recorded).
NO_EPSILON = frozenset({"SGD", "Lion"})
RESCALE_FLOAT64 = "Rescale float64 data before casting to float32: values beyond 3.4e38 become Inf."


def fmt(value: float | None, digits: int = 3) -> str:
    """A number as the texts quote it (``digits`` significant digits; ``?`` unknown)."""
    return "?" if value is None else f"{value:.{digits}g}"


@dataclasses.dataclass(frozen=True)
class Facts:
    """What a remedy reads: the verdict and the recorded facts of the run."""

    cause: str  # the verdict's cause id
    evidence: Mapping  # the verdict's evidence (unknown items left out)
    summary: Mapping  # the run summary
    mixed_precision: bool = False  # a float16 policy, or a loss scale recorded
    outputs_probabilities: bool = False  # a model output ends in sigmoid/softmax

    @property
    def loss_from_logits(self) -> bool | None:
        """Whether the loss reads logits (None: not recorded or not known)."""
        value = self.summary.get("loss_from_logits")
        return value if isinstance(value, bool) else None

    @property
    def optimizer(self) -> str | None:
        value = self.summary.get("optimizer")
        return value if isinstance(value, str) else None

    def number(self, name: str) -> float | None:
        """An evidence item that is a finite number, else None."""
        value = self.evidence.get(name)
        finite = isinstance(value, (int, float)) and not isinstance(value, bool)
        return float(value) if finite and math.isfinite(value) else None


@dataclasses.dataclass(frozen=True)
class Remedy:
    """One remedy: its id, short label, text and when it applies."""

    id: str
    label: str
    text: Callable[[Facts], str]
    applies: Callable[[Facts], bool] = lambda facts: True


# -- the texts ------------------------------------------------------------------


def _lower_lr(f: Facts) -> str:
    lr, step = f.number("lr"), f.evidence.get("onset_step", f.evidence.get("step"))
    was = f" (it was {fmt(lr)} at step {step})" if lr is not None else ""
    calm = (
        ", or add label smoothing: the logits grew to saturation"
        if f.evidence.get("saturated") is True
        else ""
    )
    return f"Lower the learning rate{was}, e.g. 10x{calm}."


def _fix_schedule(f: Facts) -> str:
    return (
        f"Fix the learning-rate schedule: {fmt(f.number('lr'))} at this step vs "
        f"{fmt(f.number('lr_before'))}."
    )


def _normalize_inputs(f: Facts) -> str:
    if f.cause == "input_data":
        return RESCALE_FLOAT64
    if f.mixed_precision:
        return (
            "Normalise inputs and activations (or lower the learning rate) so values stay well "
            "below 65504."
        )
    return "Check that the inputs are normalised (e.g. zero mean, unit variance)."


def _scale_targets(f: Facts) -> str:
    if f.cause == "input_data":
        return RESCALE_FLOAT64
    return "Check that the targets are scaled (e.g. standardise regression targets)."


def _drop_bad_rows(f: Facts) -> str:
    rows = f.evidence.get("rows")
    first = rows[0].get("rows") if isinstance(rows, list) and rows else None
    start = f", starting with rows {first} of this batch" if first else ""
    return (
        "Find the bad records: tf.debugging.assert_all_finite (or np.isfinite) over the "
        f"dataset{start}; fill or drop missing values in preprocessing and guard its "
        "divisions and logs."
    )


def _fix_weights(f: Facts) -> str:
    variables = f.evidence.get("variables")
    which = f" ({variables[0]} is non-finite before training)" if variables else ""
    return (
        f"Reload the checkpoint or pretrained weights from a clean copy{which}, or replace "
        "the non-finite entries before fit (e.g. np.nan_to_num on an embedding table, or "
        "re-initialise the variable)."
    )


_REPLAY = "tf.debugging.enable_check_numerics() to name the op"


def _fix_code(f: Facts) -> str:
    layer = f.evidence.get("layer")
    if f.cause == "nonfinite_weights":
        return "If no weights were loaded, check the variable's initializer."
    if f.cause == "forward_math":
        return (
            f"Look in {layer} for log or sqrt of a negative or zero, 0/0 or a division by ~0: "
            "add an epsilon (log(x + 1e-7), x / (y + 1e-7)), clamp (tf.maximum(x, 0.)) or use "
            "safe ops (tf.math.divide_no_nan, tf.math.xlogy, tf.nn.log_softmax); mask attention "
            "with a large finite negative (-1e9), not -inf (an all-masked row gives a softmax "
            f"of 0/0); replay the step eagerly under {_REPLAY}."
        )
    if f.cause == "backward_math":
        return (
            f"Add an epsilon inside sqrt/log/pow in {layer} (sqrt(x + 1e-12)) or clip its "
            "input away from 0; check any tf.custom_gradient in the layer."
        )
    if f.cause == "loss_math":
        return (
            "Check the loss function: it reads logits and still broke on finite predictions "
            "(a hand-written term with log, sqrt or a division at 0, or targets out of range)."
        )
    return (
        "Open the step table of the incident and the steps before it (look for values that "
        "grew or sat at a limit), then replay the step from the reproduction bundle eagerly "
        f"under {_REPLAY}."
    )


def _text(sentence: str) -> Callable[[Facts], str]:
    return lambda facts: sentence


# -- the catalogue --------------------------------------------------------------

CATALOGUE: dict[str, Remedy] = {
    remedy.id: remedy
    for remedy in (
        Remedy(
            "lower_lr",
            "Lower the learning rate",
            _lower_lr,
            applies=lambda f: f.evidence.get("lr") != 0,  # a rate of 0 cannot be lowered
        ),
        Remedy(
            "fix_schedule",
            "Fix the learning-rate schedule",
            _fix_schedule,
            applies=lambda f: f.number("lr") is not None and f.number("lr_before") is not None,
        ),
        Remedy(
            "clip_gradients",
            "Clip gradients",
            _text("Clip gradients: clipnorm=1.0 or global_clipnorm=1.0 in the optimizer."),
        ),
        Remedy(
            "raise_epsilon",
            "Raise the optimizer's epsilon",
            _text("Raise the optimizer's epsilon (Adam/RMSprop: 1e-7 -> 1e-4; never 0)."),
            applies=lambda f: f.optimizer not in NO_EPSILON,
        ),
        Remedy(
            "from_logits",
            "Compute the loss from logits",
            _text("Compute the loss from logits (from_logits=True, no final activation)."),
            applies=lambda f: f.loss_from_logits is not True,
        ),
        Remedy(
            "clip_predictions",
            "Clip predictions before the log",
            _text(
                "In a hand-written cross-entropy, clip the predictions to [1e-7, 1 - 1e-7] "
                "before the log (rather than log(p + eps))."
            ),
            applies=lambda f: f.loss_from_logits is not True,
        ),
        Remedy(
            "float32_policy",
            "Keep large layers in float32",
            _text(
                "Keep the layers with large outputs or gradients in float32 (dtype='float32', "
                "e.g. the final softmax or a normalisation), or use bfloat16 (float32's range) "
                "where the hardware supports it."
            ),
            applies=lambda f: f.mixed_precision,
        ),
        Remedy("normalize_inputs", "Normalise the inputs", _normalize_inputs),
        Remedy(
            "scale_targets",
            "Scale the targets",
            _scale_targets,
            # A loss that reads logits or probabilities takes labels, not values to scale.
            applies=lambda f: f.loss_from_logits is None,
        ),
        Remedy("drop_bad_rows", "Find and drop the bad rows", _drop_bad_rows),
        Remedy(
            "lr_warmup",
            "Warm up the learning rate",
            _text("Add a learning-rate warm-up over the first steps."),
        ),
        Remedy("fix_weights", "Restore clean weights", _fix_weights),
        Remedy("fix_code", "Fix the op in the code", _fix_code),
    )
}
REMEDY_IDS = tuple(CATALOGUE)
# A short label for each remedy id (the tab's vocabulary).
REMEDY_LABELS = {remedy.id: remedy.label for remedy in CATALOGUE.values()}
