"""The words the tab shows and the encoding it reads, as one JSON object.

The frontend holds no vocabulary of its own: it loads this object once (the
plugin's ``vocabulary`` route, or the data embedded by ``tb-nanwatch export``)
and renders what it is given. Each list comes from the module that owns it::

    {"causes": {id: label},            # causes.CAUSE_LABELS, in the tab's order
     "remedies": {id: label},          # remedies.REMEDY_LABELS
     "trial_outcomes": {outcome: words}, # trials.OUTCOME_WORDS ("Tried", ...)
     "phases": {phase: label},         # schema.PHASES, in diagnosis order
     "incident_kinds": {kind: label},  # diagnosis.KIND_TEXT
     "text_keys": [key, ...],          # TEXT_KEYS below
     "non_finite": {"nan": str, "posinf": str, "neginf": str}}

Pure Python: no TensorFlow, no TensorBoard.
"""

from __future__ import annotations

import json
import math

from tb_nanwatch.evidence import causes, diagnosis, remedies, schema, trials

# Keys of the routes' JSON whose values (and everything below them) are text,
# never numbers: a layer or run may well be named "NaN", so the frontend turns
# a non-finite encoding back into a number only outside these keys.
TEXT_KEYS = (
    "run",
    "layer",
    "layers",
    "tensor",
    "phase",
    "kind",
    "title",
    "text",
    "id",
    "signal",
    "status",
    "error",
    "source",
    "note",
    "model",
    "framework",
    "summary",
    "remedies",
    "remedy_ids",
    "candidates",
    "decided_by",
    "verdict",
    "path",
    "snippet",
    "type",
    "name",
    "output_word",
)

# How a non-finite float reads in the routes' JSON: TensorBoard's JSON cleanser
# writes the same words as Python's json module, which these are taken from.
NON_FINITE = {
    "nan": json.dumps(math.nan),
    "posinf": json.dumps(math.inf),
    "neginf": json.dumps(-math.inf),
}

# Each phase is shown by its own name.
PHASE_LABELS = {phase: phase for phase in schema.PHASES}


def vocabulary() -> dict:
    """The tab's vocabulary, a JSON-ready dict (see the module docstring)."""
    return {
        "causes": dict(causes.CAUSE_LABELS),
        "remedies": dict(remedies.REMEDY_LABELS),
        "trial_outcomes": dict(trials.OUTCOME_WORDS),
        "phases": dict(PHASE_LABELS),
        "incident_kinds": dict(diagnosis.KIND_TEXT),
        "text_keys": list(TEXT_KEYS),
        "non_finite": dict(NON_FINITE),
    }
