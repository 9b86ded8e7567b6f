"""Remedy trials as the user sees them: the ranking, the "Tried: ..." words,
the cause's ``remedies`` with their trials, and a run dir's ``repro/trials.json``
read back into the report's text and JSON."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os

import nanwatch_testlib as lib
import pytest
from test_remedies import HOUSE, make_schema, raw_house_prices, record

from tb_nanwatch.board import reader, report
from tb_nanwatch.evidence import causes, trials, vocabulary
from tb_nanwatch.evidence.options import WatchOptions
from tb_nanwatch.evidence.trials import Trial
from tb_nanwatch.record.writing.journal import RunJournal

CLIP = Trial("clip_gradients", "fixed", 40, "clipnorm=1.0", "", 1.0e4, 7.7e3, True)
LR_FLAT = Trial("lower_lr", "fixed", 40, "lr x0.001", "", 1.0e4, 1.0e4, False)
LR_UNKNOWN = Trial("lower_lr", "fixed", 40, "lr x0.1")
NORMALIZE_FAILED = Trial("normalize_inputs", "not_fixed", 4, "Normalization", "Inf at step 2")
SCALE_SKIPPED = Trial("scale_targets", "not_tried", why="no targets in the batches kept")


# -- ranking -------------------------------------------------------------------------


def test_fixes_that_keep_learning_lead_and_failures_come_last():
    ids = ["normalize_inputs", "scale_targets", "lower_lr", "clip_gradients", "lr_warmup"]
    ranked = trials.rank(ids, [NORMALIZE_FAILED, SCALE_SKIPPED, LR_FLAT, CLIP])
    # fixed and learning, fixed by a flat loss, not tried (a reason / no trial), did not help
    assert ranked == [
        "clip_gradients",
        "lower_lr",
        "scale_targets",
        "lr_warmup",
        "normalize_inputs",
    ]


def test_a_fix_whose_learning_is_not_known_ranks_between():
    ids = ["lower_lr", "clip_gradients", "scale_targets"]
    flat = Trial("scale_targets", "fixed", 40, "standardised", learning=False)
    assert trials.rank(ids, [flat, LR_UNKNOWN, CLIP]) == [
        "clip_gradients",
        "lower_lr",
        "scale_targets",
    ]


def test_without_trials_the_rule_order_stands():
    ids = ["lower_lr", "clip_gradients", "lr_warmup"]
    assert trials.rank(ids, []) == ids
    assert trials.rank(ids, [Trial("fix_code", "fixed", 3, learning=True)]) == ids


# -- the words -----------------------------------------------------------------------


def test_the_tried_texts():
    assert (
        trials.trial_text(CLIP) == "Tried: clipnorm=1.0 kept 40 steps finite, loss 1.0e4 -> 7.7e3"
    )
    assert trials.trial_text(LR_FLAT) == (
        "Tried: lr x0.001 kept 40 steps finite, loss 1.0e4 -> 1.0e4 "
        "(but the loss stopped going down)"
    )
    assert trials.trial_text(NORMALIZE_FAILED) == (
        "Tried, did not help: Normalization over 4 steps (Inf at step 2)"
    )
    assert trials.trial_text(SCALE_SKIPPED) == "Not tried: no targets in the batches kept"
    failed = Trial("lower_lr", "not_fixed", 4, "lr x0.1", "", 1.0e11, math.inf)
    assert (
        trials.trial_text(failed) == "Tried, did not help: lr x0.1 over 4 steps, loss 1.0e11 -> Inf"
    )
    assert [trials.loss_text(v) for v in (7.7e-3, 0.0, math.nan, -math.inf, None)] == [
        "7.7e-3",
        "0.0e0",
        "NaN",
        "-Inf",
        "?",
    ]


def test_the_outcome_words_are_in_the_vocabulary():
    words = vocabulary.vocabulary()["trial_outcomes"]
    assert list(words) == list(trials.OUTCOMES)
    assert words["not_fixed"] == "Tried, did not help"
    assert trials.trial_text(NORMALIZE_FAILED).startswith(words["not_fixed"] + ":")


# -- the cause with its trials ----------------------------------------------------------


def test_a_cause_lists_its_remedies_with_their_trials_working_first():
    tried = (NORMALIZE_FAILED, SCALE_SKIPPED, LR_FLAT, CLIP)
    plain = record(2, raw_house_prices, HOUSE)
    cause = causes.diagnose(dataclasses.replace(plain, trials=tried))
    assert cause["id"] == "unscaled_data"
    assert cause["remedy_ids"] == [
        "clip_gradients",
        "lower_lr",
        "scale_targets",
        "lr_warmup",  # growth_overflow's, a candidate too
        "fix_code",  # loss_math's advice
        "normalize_inputs",
    ]
    assert [r["id"] for r in cause["remedies"]] == cause["remedy_ids"]
    first = cause["remedies"][0]
    assert first["text"].startswith("Clip gradients")
    assert first["trial"] == {
        "outcome": "fixed",
        "steps": 40,
        "setting": "clipnorm=1.0",
        "why": "",
        "loss_first": 1.0e4,
        "loss_last": 7.7e3,
        "learning": True,
        "text": "Tried: clipnorm=1.0 kept 40 steps finite, loss 1.0e4 -> 7.7e3",
    }
    assert cause["remedies"][-1]["trial"]["outcome"] == "not_fixed"
    line = causes.describe(cause)
    assert "First try: Clip gradients" in line and "(Tried: clipnorm=1.0 kept 40 steps" in line
    assert "\n" not in line


def test_a_trial_of_a_remedy_not_offered_is_left_out():
    plain = record(2, raw_house_prices, HOUSE)
    other = Trial("raise_epsilon", "fixed", 40, "epsilon=1e-4", learning=True)
    cause = causes.diagnose(dataclasses.replace(plain, trials=(other,)))
    assert "raise_epsilon" not in cause["remedy_ids"]
    assert all(r["trial"] is None for r in cause["remedies"])


# -- trials.json in a run dir -------------------------------------------------------------


def trials_file(steps=1, cause="unscaled_data", entries=None) -> dict:
    chosen = entries if entries is not None else (NORMALIZE_FAILED, SCALE_SKIPPED, LR_FLAT, CLIP)
    body = [t.to_json() for t in chosen]
    return {"version": trials.TRIALS_VERSION, "step": steps, "cause": cause, "trials": body}


@pytest.mark.parametrize(
    "body",
    [
        [],
        {"version": 2, "trials": []},
        {"version": 1, "trials": "all fixed"},
        {"version": 1, "trials": [{"remedy": "lower_lr", "outcome": "maybe"}, 7]},
    ],
)
def test_a_file_that_is_not_a_trials_file_gives_no_trials(body):
    assert trials.parse_trials(body) == ()


def test_parse_keeps_the_well_formed_entries_first_trial_per_remedy():
    body = trials_file(entries=(CLIP, LR_FLAT))
    body["trials"] += [{"remedy": "x", "outcome": "??"}, {**CLIP.to_json(), "steps": 3}]
    assert trials.parse_trials(body) == (CLIP, LR_FLAT)


@pytest.fixture(scope="module")
def house_run(tmp_path_factory):
    """A raw-house-prices run written by the real journal, read back through TensorBoard's loader."""
    root = str(tmp_path_factory.mktemp("trials"))
    schema = make_schema()
    journal = RunJournal(
        os.path.join(root, "house"),
        schema,
        {"model": "house", "optimizer": "SGD"},
        WatchOptions(trial_budget_s=lib.TRIAL_BUDGET_S),
    )
    for step in range(2):
        vector = lib.base_vector(schema, step)
        raw_house_prices(schema, step, vector)
        if journal.record(step, 0, step, vector) is not None:
            break
    journal.close("stopped")
    return root


def read_cause(root: str) -> tuple[reader.Run, dict]:
    source = reader.Source(lib.multiplexer_provider(root), lib.CTX, "")
    run = source.runs()["house"]
    rec = reader.run_record(run, source.incident(run), source.series(run), source.flight(run), root)
    return run, causes.diagnose(rec)


def write_trials(root: str, body: object, raw: str | None = None) -> str:
    folder = os.path.join(root, "house", "repro")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, trials.TRIALS_FILE)
    with open(path, "w", encoding="utf-8") as out:
        out.write(raw if raw is not None else json.dumps(body))
    return path


def test_the_report_lists_the_trials_of_the_run_dir(house_run):
    _, before = read_cause(house_run)
    assert before["id"] == "unscaled_data"
    assert before["remedy_ids"][:2] == ["normalize_inputs", "scale_targets"]
    assert all(r["trial"] is None for r in before["remedies"])
    write_trials(house_run, trials_file())
    run, cause = read_cause(house_run)
    assert cause["remedy_ids"] == [
        "clip_gradients",
        "lower_lr",
        "scale_targets",
        "lr_warmup",  # growth_overflow's, a candidate too
        "fix_code",  # loss_math's advice
        "normalize_inputs",
    ]
    lines = report.format_cause(cause)
    at = lines.index(
        next(line for line in lines if line.startswith("    remedy 1: Clip gradients"))
    )
    assert lines[at + 1] == "      Tried: clipnorm=1.0 kept 40 steps finite, loss 1.0e4 -> 7.7e3"
    assert "      Not tried: no targets in the batches kept" in lines
    last = lines.index(next(line for line in lines if line.startswith("    remedy 6: ")))
    assert (
        lines[last + 1] == "      Tried, did not help: Normalization over 4 steps (Inf at step 2)"
    )
    # Each remedy with a trial carries its code to paste, with the trial's numbers.
    assert lines[at + 2 : at + 4] == [
        "      code:",
        "        keras.optimizers.SGD(..., clipnorm=1.0)",
    ]
    assert "  Shown to work on a re-run of your steps:" in lines
    body = json.loads(json.dumps(report.run_report(run, cause), allow_nan=False))
    remedies = body["cause"]["remedies"]
    assert [r["id"] for r in remedies] == body["cause"]["remedy_ids"]
    assert all({"id", "text", "trial"} <= set(r) for r in remedies)
    outcomes = [r["trial"] and r["trial"]["outcome"] for r in remedies]
    assert outcomes == ["fixed", "fixed", "not_tried", None, None, "not_fixed"]
    assert {"outcome", "steps", "setting", "why"} <= set(remedies[0]["trial"])
    assert remedies[0]["trial"]["steps"] == 40 and remedies[0]["trial"]["setting"] == "clipnorm=1.0"


def test_a_trials_file_too_large_or_malformed_is_not_read(house_run, caplog):
    write_trials(house_run, None, raw=json.dumps(trials_file()) + " " * trials.MAX_TRIALS_BYTES)
    with caplog.at_level(logging.WARNING, logger=reader.logger.name):
        _, cause = read_cause(house_run)
    assert cause["remedy_ids"][:2] == ["normalize_inputs", "scale_targets"]
    assert all(r["trial"] is None for r in cause["remedies"])
    assert "remedy trials not read" in caplog.text
    write_trials(house_run, None, raw="{not json")
    assert all(r["trial"] is None for r in read_cause(house_run)[1]["remedies"])
    write_trials(house_run, {"version": 1, "trials": {"lower_lr": "fixed"}})
    assert all(r["trial"] is None for r in read_cause(house_run)[1]["remedies"])


def test_a_trials_file_that_leaves_the_run_dir_is_not_read(house_run, tmp_path):
    outside = tmp_path / "elsewhere.json"
    outside.write_text(json.dumps(trials_file()))
    path = os.path.join(house_run, "house", "repro", trials.TRIALS_FILE)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.lexists(path):
        os.remove(path)
    os.symlink(outside, path)
    try:
        assert all(r["trial"] is None for r in read_cause(house_run)[1]["remedies"])
    finally:
        os.remove(path)


def test_without_a_log_dir_no_trials_are_read(house_run):
    write_trials(house_run, trials_file())
    source = reader.Source(lib.multiplexer_provider(house_run), lib.CTX, "")
    run = source.runs()["house"]
    assert reader.read_trials(None, run) == ()
    assert reader.read_trials("gs://bucket/logs", run) == ()
    assert reader.read_trials(house_run, run) == trials.parse_trials(trials_file())
    assert [t.steps for t in reader.read_trials(house_run, run)] == [4, 0, 40, 40]


def test_one_step_is_said_in_the_singular():
    once = trials.Trial("clip_predictions", "not_fixed", steps=1, setting="clipped", why="NaN")
    assert " over 1 step " in trials.trial_text(once) + " "
    assert "1 steps" not in trials.trial_text(once)
    kept = trials.Trial("clip_gradients", "fixed", steps=1, setting="clipnorm=1.0")
    assert "kept 1 step finite" in trials.trial_text(kept)
