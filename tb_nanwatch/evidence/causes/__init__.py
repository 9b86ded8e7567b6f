"""The cause engine: why a run went non-finite (or exploded), from recorded evidence.

One table, :data:`RULES`, holds every rule. A :class:`Rule` is one entry: its
id, its label, its test on the recorded case, and the remedies it offers
(ids of :mod:`tb_nanwatch.evidence.remedies`, ranked, each with when it
applies). A rule's test is a verdict test, a sign test, or both:

* **verdict** (:func:`diagnose`): the one cause of a run's incident or
  explosion, from the fixed vocabulary :data:`CAUSE_IDS`. Verdict tests are
  tried in table order (``nonfinite_weights`` first, ``explosion`` only
  without an incident, ``unknown`` last: what was seen, no guess, only when
  no other holds); every one that holds is a candidate (a ``decisive`` rule
  holding first is the only one). The remedies are every candidate's (the
  first candidate's first), so the trials try them all; once trials ran, the
  verdict is the candidate whose remedy fixed the run, else the first::

      {"id": str, "summary": str, "evidence": {name: number | str | list},
       "remedies": [{"id": str, "text": str, "code": str | None,
                     "trial": {...} | None}, ...],
       "remedy_ids": [remedy id, ...], "candidates": [cause id, ...],
       "decided_by": "trials" | "rule_order", "verdict": str,
       "fixed": bool | None}

  ranked: the record's remedy trials first put the fixes that keep the loss
  going down, then the other fixes, the remedies not tried, and last those
  that were tried and did not help (:func:`tb_nanwatch.evidence.trials.rank`;
  a ``trial`` is :func:`tb_nanwatch.evidence.trials.trial_json`). ``verdict``
  says what the trials showed ("" without trials; "Untested: ..." when none
  could run), and ends ``summary``. ``code``: what the remedy's trial did as
  code to paste, with the trial's numbers (None for advice). A combination
  trial (two remedies tried together) is one remedy of its own, id
  ``a+b``, with ``together: [a, b]``, both texts joined and both codes; the
  single remedies keep their own trials;

* **sign** (:func:`compute_hints`): a hint on the incident card, given only
  when the data supports it, every sign that holds, in table order::

      {"id": str, "title": str, "text": str, "evidence": {name: number | str}}

Where things go:

* a new cause: one :class:`Rule` entry in :data:`RULES` (at its place in the
  decision order), its test a function ``Case -> Finding | None`` in the
  module of its theme (:mod:`.data`, :mod:`.growth`, :mod:`.precision`,
  :mod:`.math_errors`, :mod:`.optimizer`), its remedies as :class:`Offer`\\ s;
* a new remedy: one entry in :data:`tb_nanwatch.evidence.remedies.CATALOGUE`
  (id, label, text, when it applies), then name its id in the rules that
  offer it;
* a new sign on the card: one :class:`Rule` entry with a ``sign`` test.

Run-summary keys the rules read (missing: "not known", as in runs written
before them):

* ``"weights_at_start": {"checked": int, "nonfinite": [variable path, ...]}``:
  every weight checked once when training begins;
* ``"dtype_policy": "mixed_float16" | "float32" | ...``: the Keras policy;
* ``"loss_from_logits": bool | null``: whether the loss reads logits;
* ``"optimizer": str``: the optimizer's type name;
* ``"optimizer_settings": {"epsilon", "clipnorm", "global_clipnorm",
  "clipvalue"}``: each a number, or null when the optimizer has none;
* ``"has_attention": bool``, ``"layer_classes": [class name, ...]``: whether
  a layer is an attention layer, and the layers' class names;
* ``"input_dtypes": {input name: dtype}``: integer inputs are ids, not values
  whose scale matters;
* ``"loss_name": str``: the loss's class or function name (a classification
  loss's whole-number targets are class ids);
* ``"first_layer_class": str``, ``"normalizes_inputs": bool``: the first
  layer after the inputs (a Normalization: the inputs are not told to be
  normalised again);
* ``"output_activations": [str | None, ...]``: each output layer's final
  activation (a softmax/sigmoid: none is added).

Pure Python and NumPy, no TensorFlow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from tb_nanwatch.evidence import remedies, trials
from tb_nanwatch.evidence.causes import data, growth, math_errors, optimizer, precision
from tb_nanwatch.evidence.causes.case import (
    SATURATED_LOGIT,
    Case,
    Finding,
    clean_evidence,
    is_target_tensor,
)
from tb_nanwatch.evidence.causes.data import input_rows
from tb_nanwatch.evidence.recorded import Record
from tb_nanwatch.evidence.remedies import Facts

__all__ = [
    "VERDICT_KEYS",
    "CAUSE_IDS",
    "CAUSE_LABELS",
    "RULES",
    "SATURATED_LOGIT",
    "Case",
    "Finding",
    "Offer",
    "Rule",
    "compute_hints",
    "describe",
    "diagnose",
    "input_rows",
    "offered",
    "remedy_text",
]

Test = Callable[[Case], Finding | None]


@dataclasses.dataclass(frozen=True)
class Offer:
    """A remedy a rule offers: its catalogue id, and when this cause offers it.

    ``when`` reads the verdict's :class:`~tb_nanwatch.evidence.remedies.Facts`;
    the catalogue's own ``applies`` is checked as well. An id offered twice
    (with complementary conditions) ranks by the first offer that holds.
    """

    remedy: str
    when: Callable[[Facts], bool] | None = None


@dataclasses.dataclass(frozen=True)
class Rule:
    """One entry of the engine: a cause (verdict), a card sign, or both."""

    id: str
    label: str  # the cause's label in the tab, or the sign's title on the card
    verdict: Test | None = None
    sign: Test | None = None
    remedies: tuple[Offer, ...] = ()
    needs_incident: bool | None = True  # True: only with an incident; False: only without
    title: str | None = None  # the sign's title when the entry is a verdict too
    # When this verdict holds first, no other rule is a candidate (a model
    # broken before training, a batch that brought the NaN).
    decisive: bool = False

    @property
    def kind(self) -> str:
        return "verdict" if self.verdict is not None else "sign"


# -- when a cause offers a remedy --------------------------------------------------


def _probabilities(f: Facts) -> bool:
    return f.outputs_probabilities


def _saturated_or_probabilities(f: Facts) -> bool:
    return f.evidence.get("saturated") is True or f.evidence.get("outputs_probabilities") is True


def _inf(f: Facts) -> bool:
    return "inf" in str(f.evidence.get("kind"))


def _inf_in_target(f: Facts) -> bool:
    return _inf(f) and is_target_tensor(f.evidence.get("tensor"))


def _inf_in_input(f: Facts) -> bool:
    return _inf(f) and not _inf_in_target(f)


def _lr_spike(f: Facts) -> bool:
    ratio = f.number("lr_ratio")
    return ratio is not None and ratio >= optimizer.LR_SPIKE


def _no_lr_spike(f: Facts) -> bool:
    return not _lr_spike(f)


def _no_zero_gradient(f: Facts) -> bool:
    return not f.evidence.get("zero_gradients")


def _lr_change(f: Facts) -> bool:
    return f.evidence.get("lr_change") is not None


def _reads_probabilities_from_raw_outputs(f: Facts) -> bool:
    return f.loss_from_logits is False and not f.outputs_end_in_probabilities


# -- the table ---------------------------------------------------------------------

RULES: tuple[Rule, ...] = (
    Rule(
        "nonfinite_weights",
        "Weights already NaN/Inf before the step",
        verdict=data.nonfinite_weights,
        remedies=(Offer("fix_weights"), Offer("fix_code")),
        needs_incident=None,  # a broken start outranks everything, incident or not
        decisive=True,
    ),
    Rule(
        "input_data",
        "Bad input data",
        verdict=data.input_data,
        remedies=(
            Offer("scale_targets", when=_inf_in_target),
            Offer("normalize_inputs", when=_inf_in_input),
            Offer("drop_bad_rows"),
        ),
        decisive=True,
    ),
    Rule(
        "logits_as_probabilities",
        "Loss reads probabilities, got raw logits",
        verdict=math_errors.logits_as_probabilities,
        remedies=(Offer("output_activation"), Offer("from_logits")),
    ),
    Rule(
        "unscaled_data",
        "Data far from unit scale",
        verdict=data.unscaled_data,
        remedies=(
            Offer("normalize_inputs"),
            Offer("scale_targets"),
            Offer("lower_lr"),
            Offer("clip_gradients"),
        ),
    ),
    Rule(
        "growth_overflow",
        "Overflow after growth",
        verdict=growth.growth_overflow,
        remedies=(
            Offer("fix_schedule", when=_lr_change),
            Offer("lower_lr"),
            Offer("clip_gradients"),
            Offer("lr_warmup"),
            Offer("from_logits", when=_probabilities),
            Offer("normalize_inputs"),
            Offer("scale_targets"),
        ),
    ),
    Rule(
        "fp16_overflow",
        "float16 overflow",
        verdict=precision.fp16_overflow,
        remedies=(Offer("float32_layer"), Offer("float32_policy"), Offer("normalize_inputs")),
    ),
    Rule(
        "forward_math",
        "Math error in the forward pass",
        verdict=math_errors.forward_math,
        remedies=(Offer("fix_code"),),
    ),
    Rule(
        "loss_math",
        "Math error in the loss",
        verdict=math_errors.loss_math,
        remedies=(
            Offer("from_logits", when=_saturated_or_probabilities),
            Offer("output_activation", when=_reads_probabilities_from_raw_outputs),
            Offer("clip_predictions"),
            Offer("from_logits"),
            Offer("lower_lr", when=_saturated_or_probabilities),
            Offer("scale_targets"),
            Offer("fix_code"),
        ),
    ),
    Rule(
        "backward_math",
        "Math error in the backward pass",
        verdict=math_errors.backward_math,
        remedies=(Offer("fix_code"), Offer("clip_predictions")),
    ),
    Rule(
        "optimizer_update",
        "Optimizer update broke the weights",
        verdict=optimizer.optimizer_update,
        remedies=(
            Offer("fix_schedule", when=_lr_spike),
            Offer("raise_epsilon", when=_no_lr_spike),
            Offer("lower_lr"),
            Offer("clip_gradients"),
            Offer("raise_epsilon"),
            Offer("fix_schedule", when=_no_zero_gradient),
        ),
    ),
    Rule(
        "explosion",
        "Explosion (no NaN/Inf yet)",
        verdict=growth.explosion,
        sign=growth.explosion_sign,
        title="Training is exploding",
        remedies=(
            Offer("fix_schedule", when=_lr_change),
            Offer("lower_lr"),
            Offer("clip_gradients"),
            Offer("lr_warmup"),
            Offer("normalize_inputs"),
            Offer("scale_targets"),
        ),
        needs_incident=False,
    ),
    Rule(
        "unknown",
        "Unknown cause",
        verdict=math_errors.unknown,
        remedies=(Offer("fix_code"),),
    ),
    Rule("input_nonfinite", "Non-finite input data", sign=data.input_nonfinite),
    Rule(
        "backward_origin",
        "Finite forward pass, non-finite gradient",
        sign=math_errors.backward_origin,
    ),
    Rule("adam_epsilon", "Optimizer update divided by ~0", sign=optimizer.adam_epsilon),
    Rule(
        "saturated_output",
        "Saturated sigmoid/softmax fed to the loss",
        sign=math_errors.saturated_output,
    ),
    Rule("logits_rising", "Logits grew until the loss broke", sign=growth.logits_rising),
    Rule("grad_norm_spike", "Gradient norm exploded", sign=growth.grad_norm_spike),
)

# A short label for each cause id, in the order the tab lists them (the decision order).
CAUSE_LABELS = {rule.id: rule.label for rule in RULES if rule.kind == "verdict"}
CAUSE_IDS = tuple(CAUSE_LABELS)


# -- the engine --------------------------------------------------------------------


def diagnose(rec: Record, batch: object = None) -> dict | None:
    """The cause of the run's incident or explosion, or None for a healthy run.

    Every verdict rule whose evidence holds is a candidate (``unknown`` only
    when none is; a decisive rule holding first is the only one); the
    remedies are those of every candidate, the first candidate's first.
    Once remedy trials ran (``rec.trials``), the verdict is the candidate
    whose remedy fixed the run; when no trial could run, the rule order
    decides and the verdict says it is untested (``decided_by``, ``verdict``).

    ``batch``: the offending batch's arrays when at hand (a list, or a dict
    such as a bundle's ``batch/<i>`` arrays): ``input_data`` then names the
    sample rows.
    """
    case = Case(rec, batch)
    found: list[tuple[Rule, Finding]] = []
    for rule in RULES:
        if rule.verdict is None or not _runs(rule, case):
            continue
        if rule.id == "unknown" and found:
            continue
        finding = rule.verdict(case)
        if finding is None:
            continue
        found.append((rule, finding))
        if found[0][0].decisive:
            break
    return _verdict(case, found) if found else None


def compute_hints(rec: Record) -> list[dict]:
    """Every sign the record supports, as hints for the card, most specific first."""
    case = Case(rec)
    hints = []
    for rule in RULES:
        if rule.sign is None or not _runs(rule, case):
            continue
        finding = rule.sign(case)
        if finding is not None:
            hints.append(
                {
                    "id": rule.id,
                    "title": finding.title or rule.title or rule.label,
                    "text": finding.text,
                    "evidence": clean_evidence(finding.evidence),
                }
            )
    return hints


def describe(cause: dict | None) -> str:
    """The cause in one line (the console message at the incident): the best
    remedy and, when it was tried, how its trial went."""
    if not cause:
        return "cause: none (no NaN/Inf, no explosion)"
    remedy = ""
    if cause.get("remedies"):
        first = cause["remedies"][0]
        remedy = f" First try: {remedy_text(first)}"
        trial = first.get("trial") if isinstance(first, dict) else None
        if isinstance(trial, dict) and trial.get("text"):
            remedy += f" ({trial['text']})"
    return f"cause {cause['id']}: {cause['summary']}{remedy}"


def remedy_text(remedy: dict | str) -> str:
    """A cause's remedy as text (a remedy dict's ``text``; older causes: the text)."""
    return str(remedy.get("text", "")) if isinstance(remedy, dict) else str(remedy)


def offered(rule: Rule, facts: Facts) -> list[str]:
    """The remedy ids ``rule`` offers on ``facts``, ranked, each once."""
    chosen: list[str] = []
    for offer in rule.remedies:
        if offer.remedy in chosen or (offer.when is not None and not offer.when(facts)):
            continue
        if remedies.CATALOGUE[offer.remedy].applies(facts):
            chosen.append(offer.remedy)
    return chosen


def _runs(rule: Rule, case: Case) -> bool:
    return rule.needs_incident is None or rule.needs_incident == (case.rec.incident is not None)


def _facts(rule: Rule, case: Case, finding: Finding) -> Facts:
    return Facts(
        cause=rule.id,
        evidence=clean_evidence(finding.evidence),
        summary=case.rec.summary,
        mixed_precision=case.mixed_precision(),
        outputs_probabilities=case.outputs_probabilities(),
        incident=case.incident,
        scales=case.data_scales(),
        layers=tuple(str(e.layer) for e in case.rec.schema.find(kind="activation")),
    )


# The keys of a verdict (see :func:`diagnose`).
VERDICT_KEYS = frozenset(
    {
        "id",
        "summary",
        "evidence",
        "remedies",
        "remedy_ids",
        "candidates",
        "decided_by",
        "verdict",
        "fixed",
    }
)
# Trial outcomes that ran the remedy (the others, not_tried and cannot_verify,
# say nothing of it).
RAN = ("fixed", "not_fixed")


def _verdict(case: Case, found: list[tuple[Rule, Finding]]) -> dict:
    candidates = [(rule, finding, _facts(rule, case, finding)) for rule, finding in found]
    # Each remedy once, worded by the first candidate that offers it.
    owner: dict[str, Facts] = {}
    offers: dict[str, list[str]] = {}
    for rule, _, facts in candidates:
        offers[rule.id] = offered(rule, facts)
        for remedy in offers[rule.id]:
            owner.setdefault(remedy, facts)
    recorded = _split_legacy(case.rec.trials)
    tried = trials.by_remedy(recorded)
    together = _combinations(list(owner), recorded)
    ids = trials.rank(_with_combinations(list(owner), together), recorded)
    ran = [i for i in ids if i in tried and tried[i].outcome in RAN]
    fixed = [i for i in ran if tried[i].outcome == "fixed"]
    chosen = candidates[0]
    if fixed:
        first = together.get(fixed[0], (fixed[0],))[0]
        chosen = next(c for c in candidates if first in offers[c[0].id])
        decided_by = "trials"
    else:
        decided_by = "trials" if ran else "rule_order"
    rule, finding, facts = chosen
    verdict = _verdict_text(rule, [tried[i] for i in ran], fixed, bool(case.rec.trials))
    summary = finding.text + (f" {verdict}" if verdict else "")
    return {
        "id": rule.id,
        "summary": summary,
        "evidence": dict(facts.evidence),
        "remedies": [_remedy(i, owner, together, tried.get(i)) for i in ids],
        "remedy_ids": ids,
        "candidates": [c[0].id for c in candidates],
        "decided_by": decided_by,
        "verdict": verdict,
        "fixed": bool(fixed) if ran else None,
    }


# How a trials file written before combinations were their own remedy began
# the ``why`` of a remedy whose trial was the combination.
LEGACY_TOGETHER = "alone it did not help: "


def _split_legacy(tried: Sequence[trials.Trial]) -> list[trials.Trial]:
    """Older trials files recorded a combination under its first remedy (its
    setting ``A + B``, its why ``alone it did not help: ...``): the single
    remedy gets back its own outcome (did not help) and the combination
    becomes its own trial."""
    out = list(tried)
    for i, trial in enumerate(tried):
        change = getattr(remedies.CATALOGUE.get(trial.remedy), "trial", None)
        partner = getattr(change, "partner", None)
        if trial.together or not partner or not trial.why.startswith(LEGACY_TOGETHER):
            continue
        alone = trial.why.removeprefix(LEGACY_TOGETHER)
        setting = trial.setting.split(" + ")[0]
        out[i] = trials.Trial(trial.remedy, "not_fixed", setting=setting, why=alone)
        pair = tuple(r for r in remedies.REMEDY_IDS if r in (trial.remedy, partner))
        combined = dataclasses.replace(
            trial, remedy=trials.combined_id(pair), why="", together=pair
        )
        if all(t.remedy != combined.remedy for t in out):
            out.append(combined)
    return out


def _combinations(ids: list[str], tried: Sequence[trials.Trial]) -> dict[str, tuple[str, ...]]:
    """The combination trials whose remedies are all offered: {its id: the remedies}."""
    return {t.remedy: t.together for t in tried if t.together and all(r in ids for r in t.together)}


def _with_combinations(ids: list[str], together: dict[str, tuple[str, ...]]) -> list[str]:
    """``ids`` with each combination after the last of its remedies."""
    out = list(ids)
    for combined, members in together.items():
        out.insert(max(out.index(m) for m in members) + 1, combined)
    return out


def _remedy(
    remedy: str,
    owner: dict[str, Facts],
    together: dict[str, tuple[str, ...]],
    trial: trials.Trial | None,
) -> dict:
    """One ranked remedy of a verdict: ``{"id", "text", "code", "trial"}`` (a
    combination: ``together`` too, its text and code both remedies')."""
    if remedy in together:
        members = together[remedy]
        body = remedies.combination(members, [owner[m] for m in members], trial)
        body["together"] = list(members)
    else:
        entry = remedies.CATALOGUE[remedy]
        body = {
            "id": remedy,
            "text": entry.text(owner[remedy]),
            "code": entry.code_for(owner[remedy], trial),
        }
    body["trial"] = trials.trial_json(trial) if trial is not None else None
    return body


# The most trials the verdict's sentence quotes.
MAX_QUOTED_TRIALS = 4


def _verdict_text(rule: Rule, ran: list[trials.Trial], fixed: list[str], any_trial: bool) -> str:
    """What the trials showed, in a sentence ("" without a trial file)."""
    if not ran:
        return (
            "Untested: no remedy trial could run; the rule order named the cause."
            if any_trial
            else ""
        )
    quoted = []
    for trial in ran[:MAX_QUOTED_TRIALS]:
        setting = trial.setting or remedies.REMEDY_LABELS.get(trial.remedy, trial.remedy)
        if trial.outcome == "fixed":
            still = " but the loss stopped going down" if trial.learning is False else ""
            quoted.append(f"{setting} kept the run finite{still}")
        else:
            quoted.append(f"{setting} did not")
    shown = "; ".join(quoted)
    if not fixed:
        return f"No remedy tried fixed the run: {shown}."
    return f"Decided by the trials ({rule.label.lower()}): {shown}."
