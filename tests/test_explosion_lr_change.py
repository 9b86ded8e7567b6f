"""The explosion verdict names a learning-rate jump in the steps before its
onset (step, from, to), and carries the one growth ratio it reports (the
signal's value over its reference level)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from nanwatch_testlib import write_vector_run

from tb_nanwatch.evidence import diagnosis
from tb_nanwatch.evidence.options import WatchOptions
from tb_nanwatch.record.writing.synthetic import build_schema

SCHEMA = build_schema(3)
ONSET = 68


def _seed002_like(lr_jump_step: int | None, lr_after: float = 0.2):
    """Loss ~1e-4 trained down, lr 0.01; lr jumps at ``lr_jump_step``, the loss
    climbs from step 62 and passes 10x its reference at ONSET."""

    def edit(step: int, vector: np.ndarray, schema) -> None:
        lr = 0.01 if lr_jump_step is None or step < lr_jump_step else lr_after
        vector[schema.header_index("lr")] = lr
        loss = 1.0 if step < 25 else 1e-4
        if step >= 62:
            loss = 1e-4 * 4.0 ** (step - 61)
        vector[schema.header_index("loss")] = loss

    return edit


def _judge(edit, steps: int) -> list[diagnosis.Verdict]:
    run = diagnosis.RunDiagnosis(SCHEMA, WatchOptions())
    verdicts = []
    for step in range(steps):
        vector = np.zeros(SCHEMA.size, np.float32)
        vector[SCHEMA.header_index("grad_norm")] = 1.0
        edit(step, vector, SCHEMA)
        verdicts.append(run.judge(diagnosis.StepPlace(step, 0, step), vector))
    return verdicts


def _explosion(verdicts: list[diagnosis.Verdict]) -> dict:
    found = [v.explosion for v in verdicts if v.explosion is not None]
    assert len(found) == 1, found
    return found[0]


def test_a_jump_seven_steps_before_the_onset_is_in_the_verdict():
    explosion = _explosion(_judge(_seed002_like(61), 75))
    assert explosion["step"] == ONSET and explosion["signal"] == "loss"
    change = explosion["lr_change"]
    assert change["step"] == 61
    assert change["from"] == pytest.approx(0.01) and change["to"] == pytest.approx(0.2)


def test_no_jump_no_lr_change():
    explosion = _explosion(_judge(_seed002_like(None), 75))
    assert explosion["step"] == ONSET
    assert "lr_change" not in explosion


def test_a_jump_long_before_the_onset_or_after_it_is_not_named():
    early = _explosion(_judge(_seed002_like(ONSET - diagnosis.LR_LOOKBACK_STEPS - 1), 75))
    assert "lr_change" not in early
    late = _explosion(_judge(_seed002_like(ONSET + 1), 75))
    assert "lr_change" not in late


def test_a_small_change_is_no_jump():
    explosion = _explosion(_judge(_seed002_like(61, lr_after=0.015), 75))
    assert "lr_change" not in explosion


def test_the_ratio_is_value_over_reference():
    explosion = _explosion(_judge(_seed002_like(61), 75))
    assert explosion["factor"] == pytest.approx(explosion["value"] / explosion["reference"])
    assert explosion["value"] > explosion["reference"] > 0


def test_the_largest_jump_in_the_lookback_wins_and_unknown_rates_are_skipped():
    steps = list(range(10))
    lrs = [0.1, 0.1, 0.0, 0.1, 0.3, math.nan, 0.3, 3.0, 1.0, 1.0]
    jumps = diagnosis.lr_jumps(steps, lrs)
    # 0.0 and NaN are unknown: no jump to or from them (0.1 -> 0.1 across the 0).
    assert [(j["step"], j["from"], j["to"]) for j in jumps] == [
        (4, 0.1, 0.3),
        (7, 0.3, 3.0),
        (8, 3.0, 1.0),
    ]
    assert diagnosis.lr_change_before(jumps, 9)["step"] == 7
    assert diagnosis.lr_change_before(jumps, 6)["step"] == 4
    assert diagnosis.lr_change_before(jumps, 9, lookback=1)["step"] == 8
    assert diagnosis.lr_change_before(jumps, 3) is None


def test_the_journal_writes_the_lr_change_into_the_run_summary(tmp_path):
    summary = write_vector_run(str(tmp_path), 75, _seed002_like(61))
    explosion = summary["explosion"]
    assert explosion["step"] == ONSET
    assert explosion["lr_change"]["step"] == 61
    assert explosion["lr_change"]["to"] == pytest.approx(0.2)


def test_the_explosion_cause_names_the_jump_and_offers_the_schedule_fix_first():
    from tb_nanwatch.evidence import causes
    from tb_nanwatch.evidence.recorded import Record

    schema = build_schema(2)
    jump = {"step": 61, "from": 0.01, "to": 0.2}
    explosion = {"step": 68, "signal": "loss", "factor": 1e4, "value": 1e4, "reference": 1.0}
    with_jump = causes.diagnose(Record(schema, None, explosion={**explosion, "lr_change": jump}))
    assert with_jump["id"] == "explosion"
    assert "jumped from 0.01 to 0.2 at step 61" in with_jump["summary"]
    assert with_jump["remedy_ids"][0] == "fix_schedule"
    assert "0.01" in with_jump["remedies"][0]["text"]
    without = causes.diagnose(Record(schema, None, explosion=explosion))
    assert "fix_schedule" not in without["remedy_ids"]
    assert "jumped" not in without["summary"]
