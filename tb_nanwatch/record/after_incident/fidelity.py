"""Fidelity before verdicts: did the no-remedy re-run reproduce the recorded run?

The run without a remedy goes first (the trials' baseline) and must reproduce
the recorded run before any remedy is judged: its loss at each of the first
:data:`REPRODUCE_STEPS` steps must be within :data:`RTOL` x |recorded| +
:data:`ATOL` of the recorded loss of the same step (the journal's series), or
both non-finite. The first step has the recorded weights, batch and random
state: only the order of float sums can differ (the recorded step also
computed the statistics). From the second step that rounding has gone through
an update, which an adaptive optimizer magnifies (ResNet50 + Adam: 1.9e-3 at
the second step): there the bound is :data:`RTOL_LATER`, or
:data:`SPREAD_MARGIN` x what a re-run whose start was nudged by
:data:`ROUNDING_NUDGE` moves (measured on the spot, when the first step
matched). When the re-run does not reproduce, every remedy is
``cannot_verify`` with the why :attr:`Fidelity.why` ("cannot verify: the
re-run diverged from the recorded run at step k (recorded L1, re-run L2)"),
never "did not help".
"""

from __future__ import annotations

import dataclasses
import math

REPRODUCE_STEPS = 3
RTOL = 1e-3
RTOL_LATER = 1e-2
ATOL = 1e-6
# The rounding probe's nudge (relative, about what the recorded step's
# statistics change by rounding) and how far past its spread still counts.
ROUNDING_NUDGE = 1e-6
SPREAD_MARGIN = 10.0


@dataclasses.dataclass(frozen=True)
class Fidelity:
    """The outcome of a comparison: ``line`` says it in words (the trials
    file's ``fidelity``), ``diverged`` whether the re-run failed to reproduce,
    ``first_step_matched`` whether at least its first compared step did (then
    a rounding probe can tell whether rounding explains the rest)."""

    line: str
    diverged: bool = False
    first_step_matched: bool = False

    @property
    def why(self) -> str:
        """The ``cannot verify: ...`` why of every remedy when it diverged."""
        return f"cannot verify: {self.line}"


def compare(
    losses: list[float],
    recorded: dict[int, float] | None,
    first_step: int | None,
    span: int,
    spread: list[float] | None = None,
) -> Fidelity:
    """Whether the re-run's ``losses`` (from the run's step ``first_step``,
    over a recorded ``span`` of steps) reproduce ``recorded`` over their first
    REPRODUCE_STEPS steps. ``spread``: the rounding probe's difference at each
    step; after the first step, a difference within SPREAD_MARGIN x it is
    reproduced. Without recorded losses nothing is compared and the line says so."""
    if recorded is None or first_step is None:
        return Fidelity("the re-run was not checked against a recorded run (no recorded losses)")
    steps = range(first_step, first_step + min(REPRODUCE_STEPS, span))
    compared, matched = [], False
    for i, step in enumerate(steps[: len(losses)]):
        want = recorded.get(step)
        if want is None:
            continue
        got = losses[i]
        compared.append(step)
        noise = SPREAD_MARGIN * spread[i] if spread and i < len(spread) and i > 0 else 0.0
        if not same_loss(want, got, RTOL if i == 0 else RTOL_LATER, noise):
            line = (
                f"the re-run diverged from the recorded run at step {step} "
                f"(recorded {want:.7g}, re-run {got:.7g}"
                + (f"; rounding alone moves it {spread[i]:.2g}" if noise else "")
                + ")"
            )
            return Fidelity(line, diverged=True, first_step_matched=matched)
        matched = True
        if not math.isfinite(want):
            break  # the recorded run ends here
    if not compared:
        line = f"the recorded losses of steps {steps.start}-{steps.stop - 1} are not known"
        return Fidelity(line, diverged=True)
    gaps = [
        abs(losses[s - first_step] - recorded[s]) / max(abs(recorded[s]), ATOL)
        for s in compared
        if math.isfinite(recorded[s])
    ]
    return Fidelity(reproduced_line(compared, gaps, spread), first_step_matched=matched)


def reproduced_line(compared: list[int], gaps: list[float], spread: list[float] | None) -> str:
    """The fidelity line of a re-run that reproduced the recorded steps ``compared``."""
    largest = f"; largest relative difference {max(gaps):.1e}" if gaps else ""
    first = f"within {RTOL:g} relative + {ATOL:g} at the first"
    if spread:
        probe = ", ".join(f"{d:.2g}" for d in spread[1:])
        within = (
            f"{first}, after it within {RTOL_LATER:g} or {SPREAD_MARGIN:g}x the difference "
            f"rounding alone makes (a re-run nudged by {ROUNDING_NUDGE:g}: {probe})"
        )
    else:
        within = f"{first}, {RTOL_LATER:g} after it"
    return (
        f"the re-run reproduced the recorded losses of steps {compared[0]}-{compared[-1]} "
        f"({within}{largest})"
    )


def same_loss(recorded: float, rerun: float, rtol: float, noise: float = 0.0) -> bool:
    """The re-run's loss is the recorded one: both non-finite, or within
    rtol x |recorded| + ATOL, or within ``noise``."""
    if not (math.isfinite(recorded) and math.isfinite(rerun)):
        return not math.isfinite(recorded) and not math.isfinite(rerun)
    return abs(rerun - recorded) <= max(rtol * abs(recorded) + ATOL, noise)
