"""What a remedy changes: the vocabulary its catalogue entry declares its trial in.

A remedy of :data:`tb_nanwatch.evidence.remedies.CATALOGUE` names its change
as data, one of the kinds below (``Remedy.trial``; None: advice, never tried),
and whether that change can be set on a running optimizer (``Remedy.live``).
The record side reads these kinds, never a remedy's id:
``record/after_incident/trial_remedies.py`` turns a change into the re-run of
a remedy trial, ``record/after_incident/live_remedies.py`` sets it on the
optimizer of a run that rewinds (``on_nonfinite="rewind"``). A new remedy
that makes one of these changes is one catalogue entry; a new kind of change
is a class here and a case in each of the two readers.

The kinds:

* :class:`OptimizerSettings`: optimizer settings (``clipnorm=1.0``);
* :class:`ScaleRate`: the learning rate divided by each factor in turn;
* :class:`HoldRate`: the learning rate held at its value before a jump;
* :class:`WarmUp`: a linear learning-rate warm-up;
* :class:`DataTransform`: the batches changed (``normalise_inputs``,
  ``standardise_targets``, ``drop_nonfinite_rows``);
* :class:`Float32Policy`, :class:`Float32Layer`, :class:`FromLogits`,
  :class:`ClipPredictions`, :class:`OutputActivation`: the model's dtype
  policy (or one layer's), its loss reading
  logits, its predictions clipped, an activation on its outputs.

Pure Python, no TensorFlow.
"""

from __future__ import annotations

import dataclasses

# The batch transforms a DataTransform names.
DATA_TRANSFORMS = ("normalise_inputs", "standardise_targets", "drop_nonfinite_rows")


@dataclasses.dataclass(frozen=True)
class OptimizerSettings:
    """Optimizer settings, set in order (None: the setting unset).

    Trial: the fresh optimizer is built with them (not tried when its config
    has no such setting). Live: set on the running optimizer, whose step is
    traced again (not set when it has no setting that is given a value).
    """

    settings: tuple[tuple[str, float | None], ...]

    @property
    def words(self) -> str:
        """The settings given a value, as a trial's setting (``clipnorm=1.0``)."""
        return ", ".join(f"{name}={value!r}" for name, value in self.settings if value is not None)


@dataclasses.dataclass(frozen=True)
class ScaleRate:
    """The learning rate of each step divided by each factor in turn; the
    trial reports the first factor that works (else all of them). Live: the
    rate (or the schedule) times the factor its trial found."""

    factors: tuple[float, ...]


@dataclasses.dataclass(frozen=True)
class HoldRate:
    """The learning rate held at its value before the jump (the verdict's
    ``lr_before``, else the rate before the largest rise in the recorded
    rates). Live: the rate set to it, or a schedule replaced by it."""


@dataclasses.dataclass(frozen=True)
class WarmUp:
    """A linear warm-up of the recorded rate over the recorded batches (a
    bundle's trial: over half its steps; at least 2 steps)."""


@dataclasses.dataclass(frozen=True)
class DataTransform:
    """The batches changed before each step (one of :data:`DATA_TRANSFORMS`).

    ``partner``: the remedy whose trial is tried together with this one when
    this one alone does not fix the run and the cause offers both (inputs and
    targets both far from unit scale).
    """

    transform: str
    partner: str | None = None

    def __post_init__(self) -> None:
        if self.transform not in DATA_TRANSFORMS:
            raise ValueError(f"unknown data transform {self.transform!r}: one of {DATA_TRANSFORMS}")


@dataclasses.dataclass(frozen=True)
class Float32Policy:
    """Every layer in float32 (a mixed-precision optimizer without its loss scale)."""


@dataclasses.dataclass(frozen=True)
class Float32Layer:
    """The one layer that overflowed (the verdict's ``layer``, else the
    incident's) in float32, the rest of the model in its mixed policy."""


@dataclasses.dataclass(frozen=True)
class FromLogits:
    """The loss reads logits: ``from_logits=True``, the final sigmoid/softmax removed."""


@dataclasses.dataclass(frozen=True)
class ClipPredictions:
    """The predictions clipped to ``[low, high]`` before the loss reads them."""

    low: float
    high: float


@dataclasses.dataclass(frozen=True)
class OutputActivation:
    """The loss sees ``activation(outputs)``: raw logits fed to a loss that
    reads probabilities get the softmax (or sigmoid) they lack. None: the one
    the run's loss and outputs expect (``remedies.expected_activation``)."""

    activation: str | None = None


Change = (
    OptimizerSettings
    | ScaleRate
    | HoldRate
    | WarmUp
    | DataTransform
    | Float32Policy
    | Float32Layer
    | FromLogits
    | ClipPredictions
    | OutputActivation
)
KINDS = (
    OptimizerSettings,
    ScaleRate,
    HoldRate,
    WarmUp,
    DataTransform,
    Float32Policy,
    Float32Layer,
    FromLogits,
    ClipPredictions,
    OutputActivation,
)
