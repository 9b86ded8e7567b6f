"""Issue 55's cause verdicts (each record built by hand, judged by the cause
engine directly; test_remedies.py's helpers):

* integer class or token ids are never "far from unit scale", and the
  data-scale rule leaves a math error in one op and a recorded rate jump to
  their own verdicts;
* a remedy already in place (a Normalization first, a softmax output) is not
  offered again;
* raw logits fed to a loss that reads probabilities: the
  ``logits_as_probabilities`` cause and its ``output_activation`` remedy;
* every rule whose evidence holds is a candidate, and once trials ran the
  verdict is the candidate whose remedy fixed the run.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from test_remedies import HOUSE, incident, put, raw_house_prices, record, texts

from tb_nanwatch.evidence import causes, changes, remedies, trials, vocabulary
from tb_nanwatch.evidence.trials import Trial
from tb_nanwatch.record.after_incident import trial_remedies

# -- class ids are no scale --------------------------------------------------------------

NEXT_TOKEN = {"loss_from_logits": False, "input_dtypes": {"input": "int32"}}


def next_token(schema, step, vector):
    """Token ids in, token ids 1-299 as targets, raw logits out (negative and
    above 1) into a loss that reads probabilities: the loss is huge, then NaN."""
    put(schema, vector, "input", "input", "input", min=1.0, max=299.0)
    put(schema, vector, "input", "input", "target", min=1.0, max=299.0)
    put(schema, vector, "forward", "logits", "out", min=-8.5, max=12.0)
    vector[schema.header_index("loss")] = [4.2e3, 3.1e4, math.nan][step]
    if step == 2:
        put(schema, vector, "loss", "loss", None, nan=1, value=math.nan)


LOSS_NAN = incident(2, "loss", kind="nan", tensor="total loss")


def test_token_ids_as_targets_of_a_loss_reading_probabilities_are_no_data_scale():
    cause = causes.diagnose(record(3, next_token, LOSS_NAN, NEXT_TOKEN))
    assert cause["id"] == "logits_as_probabilities", cause
    assert "unscaled_data" not in cause["candidates"]
    assert "scale_targets" not in cause["remedy_ids"]
    assert not any("Standardise the targets" in text for text in texts(cause))
    assert cause["remedy_ids"][:2] == ["output_activation", "from_logits"]
    first = texts(cause)[0]
    assert 'activation="softmax"' in first and "from_logits=True" in first
    assert "-8.5 to 12" in first and "-8.5 to 12" in cause["summary"]


def test_a_custom_loss_named_for_labels_reads_its_integer_targets_as_ids():
    summary = {"loss_name": "sparse_nll", "input_dtypes": {"input": "int32"}}
    cause = causes.diagnose(record(3, next_token, LOSS_NAN, summary))
    assert cause["id"] == "logits_as_probabilities", cause
    assert "scale_targets" not in cause["remedy_ids"]


def test_integer_targets_of_a_regression_are_still_values():
    summary = {"loss_name": "mean_squared_error", "input_dtypes": {"input": "int32"}}
    cause = causes.diagnose(record(3, next_token, LOSS_NAN, summary))
    assert cause["id"] == "unscaled_data", cause
    assert "scale_targets" in cause["remedy_ids"]
    assert "output_activation" not in cause["remedy_ids"]


def test_outputs_that_are_probabilities_are_no_raw_logits():
    def edit(schema, step, vector):
        next_token(schema, step, vector)
        put(schema, vector, "forward", "logits", "out", min=0.0, max=0.9)

    cause = causes.diagnose(record(3, edit, LOSS_NAN, NEXT_TOKEN))
    assert cause["id"] != "logits_as_probabilities", cause


def test_a_log_of_a_negative_activation_stays_forward_math_with_targets_beyond_50():
    def edit(schema, step, vector):
        put(schema, vector, "input", "input", "input", min=-2.0, max=3.0)
        put(schema, vector, "input", "input", "target", min=0.0, max=120.0)
        vector[schema.header_index("loss")] = 5e3
        if step == 5:
            put(schema, vector, "forward", "activation", "dense_1", nan=4, min=math.nan)

    layer_nan = incident(5, "forward", "dense_1", kind="nan", tensor="output of dense_1")
    cause = causes.diagnose(record(6, edit, layer_nan))
    assert cause["id"] == "forward_math", cause
    assert "unscaled_data" not in cause["candidates"]


def jump_in_a_regression(schema, step, vector):
    """Targets 1e5, the loss 1e10 from step 0; the rate jumps 100x at step 5
    and the outputs grow to Inf at step 9."""
    put(schema, vector, "input", "input", "input", min=-2.0, max=2.0)
    put(schema, vector, "input", "input", "target", min=5e4, max=1.5e5)
    vector[schema.header_index("lr")] = 1e-3 if step < 5 else 1e-1
    size = 1.0 if step < 5 else 10.0 ** (6 * (step - 4))
    vector[schema.header_index("loss")] = 1e10 if step < 5 else min(1e10 * size, 1e37)
    for name in ("dense_0", "dense_1"):
        put(schema, vector, "forward", "activation", name, min=0.0, max=size)
    if step == 9:
        put(schema, vector, "forward", "activation", "dense_2", inf=3, max=math.inf)


JUMP_INF = incident(9, "forward", "dense_2", tensor="output of dense_2")


def test_a_rate_jump_in_a_regression_far_from_unit_scale_is_the_schedules_verdict():
    cause = causes.diagnose(record(10, jump_in_a_regression, JUMP_INF))
    assert cause["id"] == "growth_overflow", cause
    assert cause["remedy_ids"][0] == "fix_schedule"
    assert cause["evidence"]["lr_before"] == pytest.approx(1e-3)
    assert cause["evidence"]["lr"] == pytest.approx(1e-1)
    assert "jumped from 0.001 to 0.1 at step 5" in cause["summary"]
    assert texts(cause)[0].startswith("Fix the learning-rate schedule: 0.1 at this step vs 0.001")


# -- a remedy already in place -----------------------------------------------------------


def test_a_model_that_normalises_first_is_not_told_to_add_a_normalization():
    plain = causes.diagnose(record(2, raw_house_prices, HOUSE))
    assert plain["remedy_ids"][0] == "normalize_inputs"
    for summary in ({"first_layer_class": "Normalization"}, {"normalizes_inputs": True}):
        cause = causes.diagnose(record(2, raw_house_prices, HOUSE, summary))
        assert "normalize_inputs" not in cause["remedy_ids"], summary
        assert not any("Normalization" in text for text in texts(cause))
        assert cause["remedy_ids"][0] == "scale_targets"  # the targets are still raw


@pytest.mark.parametrize(
    ("summary", "probabilities"),
    [({"output_activations": ["softmax"]}, False), ({}, True)],
)
def test_outputs_that_end_in_a_softmax_are_not_told_to_add_one(summary, probabilities):
    rec = record(3, next_token, LOSS_NAN, {**NEXT_TOKEN, **summary}, probabilities=probabilities)
    cause = causes.diagnose(rec)
    assert cause["id"] != "logits_as_probabilities"
    assert "output_activation" not in cause["remedy_ids"]


# -- output_activation in the catalogue ---------------------------------------------------


def test_output_activation_is_one_entry_whose_trial_wraps_the_outputs():
    entry = remedies.CATALOGUE["output_activation"]
    assert entry.trial == changes.OutputActivation() and not entry.live
    recorded = trial_remedies.Recorded([], rate_before=None, warmup_steps=2)
    (variant,) = trial_remedies.variants("output_activation", recorded)
    assert variant.output_activation == "softmax"
    assert variant.setting == "softmax on the outputs before the loss"
    binary = dataclasses.replace(recorded, output_activation="sigmoid")
    (variant,) = trial_remedies.variants("output_activation", binary)
    assert variant.output_activation == "sigmoid"
    assert vocabulary.vocabulary()["remedies"]["output_activation"] == entry.label
    labels = vocabulary.vocabulary()["causes"]
    assert labels["logits_as_probabilities"] == "Loss reads probabilities, got raw logits"


@pytest.mark.parametrize(
    "loss, units, expected",
    [
        ("BinaryCrossentropy", [3], "sigmoid"),
        ("my_loss", [1], "sigmoid"),
        ("my_loss", [1, 1], "sigmoid"),
        ("my_loss", [1, 10], "softmax"),
        ("SparseCategoricalCrossentropy", [300], "softmax"),
        (None, None, "softmax"),
        ("my_loss", "junk", "softmax"),
    ],
)
def test_the_activation_raw_outputs_lack_follows_the_loss_and_the_units(loss, units, expected):
    assert remedies.expected_activation(loss, units) == expected


def test_a_binary_loss_is_told_to_add_a_sigmoid():
    summary = {**NEXT_TOKEN, "loss_name": "BinaryCrossentropy"}
    cause = causes.diagnose(record(3, next_token, LOSS_NAN, summary))
    first = texts(cause)[0]
    assert 'activation="sigmoid"' in first and "BinaryCrossentropy(from_logits=True)" in first


# -- the cause decided by the counterfactual ----------------------------------------------

NORMALIZE = Trial("normalize_inputs", "not_fixed", 4, "inputs normalised", "Inf at step 2")
SCALE = Trial("scale_targets", "not_fixed", 4, "targets standardised", "Inf at step 1")
WARMUP = Trial("lr_warmup", "fixed", 20, "linear lr warm-up (10 steps)", "", 8e10, 1e9, True)
LOWER_FLAT = Trial("lower_lr", "fixed", 20, "lr x0.001", "", 8e10, 8e10, False)


def house(tried) -> dict:
    return causes.diagnose(dataclasses.replace(record(2, raw_house_prices, HOUSE), trials=tried))


def test_every_candidate_is_tried_and_the_fix_names_the_cause():
    untried = causes.diagnose(record(2, raw_house_prices, HOUSE))
    assert untried["id"] == "unscaled_data" and untried["decided_by"] == "rule_order"
    assert untried["candidates"][:2] == ["unscaled_data", "growth_overflow"]
    assert "lr_warmup" in untried["remedy_ids"]  # growth_overflow's: the trials try it
    assert untried["verdict"] == "" and untried["fixed"] is None
    cause = house((NORMALIZE, SCALE, LOWER_FLAT, WARMUP))
    assert cause["id"] == "growth_overflow", cause
    assert cause["decided_by"] == "trials" and cause["fixed"] is True
    # The learning fix leads; the fix that stopped learning follows it.
    assert cause["remedy_ids"][:2] == ["lr_warmup", "lower_lr"]
    assert cause["summary"].startswith("The outputs grew")
    assert (
        "linear lr warm-up (10 steps) kept the run finite; lr x0.001 kept the run finite but "
        "the loss stopped going down; inputs normalised did not; targets standardised did not"
    ) in cause["verdict"]
    assert cause["verdict"] in cause["summary"]


def test_a_fix_that_stopped_learning_never_leads_a_learning_fix():
    cause = house((LOWER_FLAT, NORMALIZE, WARMUP))
    assert cause["remedy_ids"][0] == "lr_warmup"
    alone = house((LOWER_FLAT, NORMALIZE))
    assert alone["remedy_ids"][0] == "lower_lr"  # the only fix there is
    assert alone["id"] == "unscaled_data"  # the first candidate that offers it


@pytest.mark.parametrize("outcome", ["not_tried", "cannot_verify"])
def test_when_no_trial_could_run_the_rule_order_decides_and_says_untested(outcome):
    tried = tuple(
        Trial(r, outcome, why="the re-run diverged from the recorded run at step 1")
        for r in ("normalize_inputs", "scale_targets", "lr_warmup")
    )
    cause = house(tried)
    assert cause["id"] == "unscaled_data" and cause["decided_by"] == "rule_order"
    assert cause["verdict"].startswith("Untested: no remedy trial could run")
    assert cause["summary"].endswith(cause["verdict"]) and cause["fixed"] is None


def test_when_nothing_worked_the_verdict_says_so():
    cause = house((NORMALIZE, SCALE))
    assert cause["id"] == "unscaled_data" and cause["fixed"] is False
    assert cause["verdict"].startswith("No remedy tried fixed the run")


def test_the_outcomes_that_ran_are_the_ranked_ones():
    assert set(causes.RAN) <= set(trials.OUTCOMES)


# -- the card's heading over the remedies -------------------------------------------------


def test_the_cards_heading_says_when_nothing_worked():
    from nanwatch_testlib import run_node_module

    script = """
      import { remediesHeading } from "./src/cause.js";
      const of = (...outcomes) => outcomes.map((o) => ({ trial: o ? { outcome: o } : null }));
      console.log(JSON.stringify([
        remediesHeading(of("fixed", "not_fixed")),
        remediesHeading(of("not_fixed", "not_tried")),
        remediesHeading(of("cannot_verify", "not_tried", null)),
        remediesHeading(of(null)),
      ]));
    """
    assert run_node_module(script) == [
        "Shown to work on a re-run of your steps",
        "Nothing we tried fixed the run; what to try first",
        "What to try first (untested: no remedy trial could run)",
        "What to try first",
    ]


# -- a regression learning its scale is no growth -----------------------------------------


def learning_then_loss_nan(schema, step, vector):
    """Targets 5e4-1.5e5; outputs grow from 1 to 1e5 while the loss falls;
    then the loss goes NaN (a hand-written log) at step 29."""
    put(schema, vector, "input", "input", "input", min=-2.0, max=2.0)
    put(schema, vector, "input", "input", "target", min=5e4, max=1.5e5)
    size = 10.0 ** min(5.0, step / 4)
    for name in ("dense_0", "dense_1", "dense_2"):
        put(schema, vector, "forward", "activation", name, min=0.0, max=size)
    put(schema, vector, "forward", "logits", "out", min=1.0, max=size)
    vector[schema.header_index("loss")] = 1e10 * 0.8**step * (1 + 0.3 * (step % 2))
    if step == 29:
        put(schema, vector, "loss", "loss", None, nan=1, value=math.nan)
        vector[schema.header_index("loss")] = math.nan


def test_outputs_that_learned_the_targets_scale_are_no_growth_before_a_later_nan():
    rec = record(30, learning_then_loss_nan, incident(29, "loss", kind="nan", tensor="total loss"))
    cause = causes.diagnose(rec)
    assert "growth_overflow" not in cause["candidates"], cause
    assert cause["id"] == "loss_math"


def test_a_custom_loss_that_learned_on_raw_logits_applies_its_own_softmax():
    # The seed-001 shape: the user's own cross-entropy (softmax, then -log p),
    # token ids as targets, raw logits that the loss learned on for many steps,
    # then Inf when a probability underflows to 0. The logits are right: the
    # loss reads them; adding a softmax would apply it twice.
    steps = 12

    def learned(schema, step, vector):
        put(schema, vector, "input", "input", "input", min=0.0, max=49.0)
        put(schema, vector, "input", "input", "target", min=0.0, max=49.0)
        put(schema, vector, "forward", "logits", "out", min=-20.0, max=25.0)
        loss = 3.9 * 0.7**step if step < steps - 1 else math.inf
        vector[schema.header_index("loss")] = loss
        if step == steps - 1:
            put(schema, vector, "loss", "loss", None, inf=1, value=math.inf)

    summary = {"loss_name": "softmax_then_log", "input_dtypes": {"input": "int32"}}
    inf_at_end = incident(steps - 1, "loss", kind="inf", tensor="total loss")
    cause = causes.diagnose(record(steps, learned, inf_at_end, summary))
    assert cause["id"] == "loss_math", cause
    assert "output_activation" not in cause["remedy_ids"]

    def stuck(schema, step, vector):  # the same outputs, a loss that never learned
        learned(schema, step, vector)
        if step < steps - 1:
            vector[schema.header_index("loss")] = 15.9
            put(schema, vector, "input", "input", "target", min=1.0, max=49.0)

    cause = causes.diagnose(record(steps, stuck, inf_at_end, {**summary, "loss_name": "nll"}))
    assert cause["id"] == "logits_as_probabilities", cause
