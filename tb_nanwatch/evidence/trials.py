"""The outcome of trying a remedy: what the counterfactual trial found.

After training stops at an incident or an explosion, ``record/trials.py``
re-runs the step (from the reproduction bundle) or the steps since a rewind
point, on a copy of the model, once per applicable remedy, and writes one
:class:`Trial` per remedy to ``<run dir>/repro/trials.json``. The cause engine
ranks the remedies by these outcomes; the card, ``report`` and the console
quote them.

Pure Python, no TensorFlow.
"""

from __future__ import annotations

import dataclasses

TRIALS_FILE = "trials.json"  # in the run dir's repro/ folder
TRIALS_VERSION = 1
OUTCOMES = ("fixed", "not_fixed", "not_tried")


@dataclasses.dataclass(frozen=True)
class Trial:
    """One remedy's trial.

    ``outcome``: ``"fixed"`` (finite through the trial; for an explosion the
    signal stayed under the explosion line), ``"not_fixed"`` or
    ``"not_tried"`` (``why`` says why). ``steps``: the steps the trial ran.
    ``setting``: what was applied (``"clipnorm=1.0"``, ``"lr x0.01"``).
    ``loss_first``/``loss_last``: the trial's loss at its first and last step
    (None when not known). ``learning``: whether the loss went down over the
    trial (None when not known); a fix that stops learning ranks lower.
    """

    remedy: str
    outcome: str
    steps: int = 0
    setting: str = ""
    why: str = ""
    loss_first: float | None = None
    loss_last: float | None = None
    learning: bool | None = None

    def to_json(self) -> dict:
        """The JSON form (``report --json``'s ``trial`` object plus ``remedy``)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: object) -> Trial | None:
        """A trial from its JSON form, or None when it is not one."""
        if not isinstance(data, dict) or data.get("outcome") not in OUTCOMES:
            return None
        remedy = data.get("remedy")
        if not isinstance(remedy, str):
            return None
        steps = data.get("steps")
        return cls(
            remedy=remedy,
            outcome=data["outcome"],
            steps=steps if isinstance(steps, int) and not isinstance(steps, bool) else 0,
            setting=_text(data.get("setting")),
            why=_text(data.get("why")),
            loss_first=_number(data.get("loss_first")),
            loss_last=_number(data.get("loss_last")),
            learning=data.get("learning") if isinstance(data.get("learning"), bool) else None,
        )


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)  # NaN and Inf kept: a loss that went non-finite is the data
