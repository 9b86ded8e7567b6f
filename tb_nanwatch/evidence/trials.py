"""The outcome of trying a remedy: what the counterfactual trial found.

After training stops at an incident or an explosion, ``record/after_incident/trials.py``
re-runs the step (from the reproduction bundle) or the steps since a rewind
point, on a copy of the model, once per applicable remedy, and writes one
:class:`Trial` per remedy to ``<run dir>/repro/trials.json``. The cause engine
ranks the remedies by these outcomes; the card, ``report`` and the console
quote them.

Pure Python, no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

from tb_nanwatch.evidence.limits import count

TRIALS_FILE = "trials.json"  # in the run dir's repro/ folder
TRIALS_PATH = f"repro/{TRIALS_FILE}"  # relative to the run dir
TRIALS_VERSION = 1
OUTCOMES = ("fixed", "not_fixed", "not_tried", "cannot_verify")
# How each outcome reads on the card, in ``report`` and on the console (the
# tab's vocabulary serves them).
OUTCOME_WORDS = {
    "fixed": "Tried",
    "not_fixed": "Tried, did not help",
    "not_tried": "Not tried",
    "cannot_verify": "Cannot verify",
}
# A trials file larger than this is not read.
MAX_TRIALS_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class Trial:
    """One remedy's trial.

    ``outcome``: ``"fixed"`` (finite through the trial; for an explosion the
    signal stayed under the explosion line), ``"not_fixed"``,
    ``"not_tried"`` (``why`` says why) or ``"cannot_verify"`` (the re-run
    without a remedy did not reproduce the recorded run, so no trial of it
    says anything about the remedy; ``why``: "cannot verify: the re-run
    diverged from the recorded run at step k (...)"). ``steps``: the steps the trial ran.
    ``setting``: what was applied (``"clipnorm=1.0"``, ``"lr x0.01"``).
    ``loss_first``/``loss_last``: the trial's loss at its first and last step
    (None when not known). ``learning``: whether the loss went down over the
    trial (None when not known); a fix that stops learning ranks lower.
    ``together``: the remedies a combination trial applied at once (e.g.
    ``["normalize_inputs", "scale_targets"]``; its ``remedy`` is
    :func:`combined_id` of them); () for a single remedy. A combination is its
    own remedy: its members keep their own trials.
    """

    remedy: str
    outcome: str
    steps: int = 0
    setting: str = ""
    why: str = ""
    loss_first: float | None = None
    loss_last: float | None = None
    learning: bool | None = None
    together: tuple[str, ...] = ()

    def to_json(self) -> dict:
        """The JSON form (``report --json``'s ``trial`` object plus ``remedy``)."""
        body = dataclasses.asdict(self)
        body["together"] = list(self.together)
        return body

    @classmethod
    def from_json(cls, data: object) -> Trial | None:
        """A trial from its JSON form, or None when it is not one (no remedy
        id, an unknown outcome). An entry with a field of the wrong type (a
        run dir from anyone: ``"steps": "x"``) is ``not_tried``, :data:`MALFORMED`:
        never a fix."""
        if not isinstance(data, dict) or data.get("outcome") not in OUTCOMES:
            return None
        remedy = data.get("remedy")
        if not isinstance(remedy, str):
            return None
        if not _well_formed(data):
            return cls(remedy=remedy, outcome="not_tried", why=MALFORMED)
        return cls(
            remedy=remedy,
            outcome=data["outcome"],
            steps=data.get("steps", 0),
            setting=data.get("setting") or "",
            why=data.get("why") or "",
            loss_first=_number(data.get("loss_first")),
            loss_last=_number(data.get("loss_last")),
            learning=data.get("learning"),
            together=_together(data.get("together")),  # absent in older files: ()
        )


# The why of a trials.json entry whose fields are not of their types.
MALFORMED = "malformed entry in trials.json"
# Each field's check; an absent field (an older file) is its default.
_FIELDS = {
    "steps": lambda v: count(v, 2**53 - 1) is not None,
    "setting": lambda v: v is None or isinstance(v, str),
    "why": lambda v: v is None or isinstance(v, str),
    "loss_first": lambda v: v is None or _number(v) is not None,
    "loss_last": lambda v: v is None or _number(v) is not None,
    "learning": lambda v: v is None or isinstance(v, bool),
    "together": lambda v: isinstance(v, list) and all(isinstance(r, str) for r in v),
}


def _well_formed(data: dict) -> bool:
    """Whether every field of a trials.json entry that is there has its type."""
    return all(check(data[key]) for key, check in _FIELDS.items() if key in data)


def combined_id(remedies: Sequence[str]) -> str:
    """The id of a combination of remedies (``normalize_inputs+scale_targets``)."""
    return "+".join(remedies)


def _together(value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) < 2:
        return ()
    return tuple(value)


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)  # NaN and Inf kept: a loss that went non-finite is the data


# -- reading a trials file ---------------------------------------------------------


def parse_trials(data: object) -> tuple[Trial, ...]:
    """The trials of a ``trials.json`` body (``{"version", "step", "cause",
    "trials": [...]}``); () when it is not one. A malformed entry is left out;
    a remedy tried twice keeps its first trial."""
    if not isinstance(data, dict) or data.get("version") != TRIALS_VERSION:
        return ()
    entries = data.get("trials")
    if not isinstance(entries, list):
        return ()
    found: dict[str, Trial] = {}
    for entry in entries:
        trial = Trial.from_json(entry)
        if trial is not None and trial.remedy not in found:
            found[trial.remedy] = trial
    return tuple(found.values())


# -- ranking -------------------------------------------------------------------------


def _rank_key(trial: Trial | None) -> int:
    """0: fixed and learning; 1: fixed, learning not known; 2: fixed by stopping
    learning; 3: not tried or cannot verify (nothing known); 4: tried and did
    not help."""
    if trial is None or trial.outcome in ("not_tried", "cannot_verify"):
        return 3
    if trial.outcome == "not_fixed":
        return 4
    return {True: 0, None: 1, False: 2}[trial.learning]


def rank(remedy_ids: Sequence[str], trials: Iterable[Trial]) -> list[str]:
    """``remedy_ids`` ordered by their trials: the fixes that keep learning
    first, then the other fixes, then the remedies not tried or whose trial
    cannot be verified, and those tried that did not help last; the given
    order within each group."""
    by_id = by_remedy(trials)
    order = sorted(range(len(remedy_ids)), key=lambda i: (_rank_key(by_id.get(remedy_ids[i])), i))
    return [remedy_ids[i] for i in order]


def by_remedy(trials: Iterable[Trial]) -> dict[str, Trial]:
    """The trials by remedy id (a remedy tried twice: its first trial)."""
    found: dict[str, Trial] = {}
    for trial in trials:
        found.setdefault(trial.remedy, trial)
    return found


# -- the words ---------------------------------------------------------------------


def loss_text(value: float | None) -> str:
    """A loss as the trial texts quote it: ``1.0e4``, ``7.7e-3``, ``NaN``, ``Inf``."""
    if value is None:
        return "?"
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Inf" if value > 0 else "-Inf"
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def trial_text(trial: Trial) -> str:
    """One line on a remedy's trial, e.g. ``Tried: clipnorm=1.0 kept 40 steps
    finite, loss 1.0e4 -> 7.7e3``; ``Tried, did not help: ...``; ``Not tried: why``;
    ``Cannot verify: the re-run diverged from the recorded run at step k (...)``."""
    setting = trial.setting or trial.remedy
    if trial.outcome == "not_tried":
        return f"{OUTCOME_WORDS['not_tried']}: {trial.why or 'no reason recorded'}"
    if trial.outcome == "cannot_verify":
        why = trial.why or "the re-run did not reproduce the recorded run"
        prefix = "cannot verify: "
        why = why[len(prefix) :] if why.lower().startswith(prefix) else why
        return f"{OUTCOME_WORDS['cannot_verify']}: {why}"
    loss = ""
    if trial.loss_first is not None and trial.loss_last is not None:
        loss = f", loss {loss_text(trial.loss_first)} -> {loss_text(trial.loss_last)}"
    if trial.outcome == "fixed":
        flat = " (but the loss stopped going down)" if trial.learning is False else ""
        steps = _counted(trial.steps, "step")
        return f"{OUTCOME_WORDS['fixed']}: {setting} kept {steps} finite{loss}{flat}"
    why = f" ({trial.why})" if trial.why else ""
    return (
        f"{OUTCOME_WORDS['not_fixed']}: {setting} over {_counted(trial.steps, 'step')}{why}{loss}"
    )


def _counted(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def trial_json(trial: Trial) -> dict:
    """A remedy's ``trial`` object in a cause (``report --json``, the card):
    the trial's fields without ``remedy`` and ``together`` (a combination's
    remedy says what it combined), and its ``text``."""
    body = trial.to_json()
    del body["remedy"], body["together"]
    body["text"] = trial_text(trial)
    return body
