"""diagnosis.py: one incident rule for the journal, the heatmap, the step table and the hints."""

from __future__ import annotations

import math

import numpy as np
import pytest
from nanwatch_testlib import base_vector

from tb_nanwatch import diagnosis, reader, report, views
from tb_nanwatch.journal import JournalSettings, RunJournal
from tb_nanwatch.synthetic import build_schema

SCHEMA = build_schema(3)
LAYERS = [e.layer for e in SCHEMA.find(kind="activation")]
RULES = diagnosis.IncidentRules(max_consecutive_skips=3, min_loss_scale=0.0, explosion_factor=1e3)


def entry(phase: str, kind: str, layer: str | None):
    return next(e for e in SCHEMA.entries if (e.phase, e.kind, e.layer) == (phase, kind, layer))


def skipped(vector: np.ndarray, loss_scale: float = 1024.0) -> np.ndarray:
    vector[SCHEMA.header_index("skipped")] = 1.0
    vector[SCHEMA.header_index("loss_scale")] = loss_scale
    return vector


def nan_in(vector: np.ndarray, phase: str, kind: str, layer: str | None) -> np.ndarray:
    vector[entry(phase, kind, layer).index("nan")] = 2.0
    return vector


def judge_all(vectors: list[np.ndarray], rules=RULES) -> list[diagnosis.Verdict]:
    run = diagnosis.RunDiagnosis(SCHEMA, rules)
    return [
        run.judge(diagnosis.StepPlace(step, 0, step), vector) for step, vector in enumerate(vectors)
    ]


@pytest.mark.parametrize(
    ("nan", "inf", "expected"),
    [(0, 0, False), (1, 0, True), (0, 4, True), (math.nan, 0, True), (0, math.inf, True)],
)
def test_an_entry_is_nonfinite_exactly_when_a_count_is_nonzero(nan, inf, expected):
    assert diagnosis.is_nonfinite(nan, inf) is expected


def test_an_overflowing_norm_over_finite_elements_is_not_nonfinite():
    vector = base_vector(SCHEMA, 0)
    grad = entry("backward", "grad_out", LAYERS[1])
    vector[grad.index("norm")] = np.inf  # the sum of squares overflowed float32
    assert not diagnosis.entry_nonfinite(vector, grad)
    assert diagnosis.find_origin(SCHEMA, vector) is None
    heatmap = views.heatmap(reader.Flight(0, vector[None, :], SCHEMA), None)
    assert heatmap["nonfinite"] == [[0]] * len(heatmap["layers"])
    assert heatmap["grad_norm"][heatmap["layers"].index(LAYERS[1])] == [math.inf]


def test_heatmap_cells_are_nonfinite_exactly_where_the_diagnosis_finds_nonfinite_entries():
    vectors = [base_vector(SCHEMA, step) for step in range(4)]
    nan_in(vectors[2], "forward", "activation", LAYERS[1])
    nan_in(vectors[3], "backward", "grad_var", LAYERS[0])
    heatmap = views.heatmap(reader.Flight(0, np.stack(vectors), SCHEMA), None)
    for row, layer in zip(heatmap["nonfinite"], heatmap["layers"], strict=True):
        owned = [e for e in SCHEMA.diagnosed() if e.layer == layer and e.kind != "logits"]
        expected = [int(any(diagnosis.entry_nonfinite(v, e) for e in owned)) for v in vectors]
        assert row == expected
    assert heatmap["nonfinite"][heatmap["layers"].index(LAYERS[1])] == [0, 0, 1, 0]
    assert heatmap["nonfinite"][heatmap["layers"].index(LAYERS[0])] == [0, 0, 0, 1]


def test_step_table_counts_are_the_ones_the_diagnosis_reads():
    vector = nan_in(base_vector(SCHEMA, 0), "forward", "activation", LAYERS[2])
    rows = views.step_rows(SCHEMA, vector)
    flagged = [(r["phase"], r["layer"]) for r in rows if r["nan"] or r["inf"]]
    origin = diagnosis.find_origin(SCHEMA, vector)
    assert flagged == [("forward", LAYERS[2])]
    assert (origin["phase"], origin["layer"]) == flagged[0]


def test_a_nonfinite_step_the_scaler_kept_is_the_incident():
    vectors = [base_vector(SCHEMA, step) for step in range(3)]
    nan_in(vectors[1], "backward", "grad_in", LAYERS[2])
    verdicts = judge_all(vectors)
    assert [v.nonfinite for v in verdicts] == [False, True, False]
    incident = verdicts[1].incident
    assert incident["step"] == 1 and incident["phase"] == "backward"
    assert incident["layer"] == LAYERS[2] and incident["kind"] == "nan"
    assert "note" not in incident
    assert verdicts[2].incident is None  # only the first incident is reported


def test_skipped_steps_become_an_incident_only_at_the_streak_dated_at_its_first_step():
    vectors = [base_vector(SCHEMA, step) for step in range(6)]
    nan_in(skipped(vectors[1]), "forward", "activation", LAYERS[0])
    skipped(vectors[2])
    vectors[3][SCHEMA.header_index("skipped")] = 0.0  # the streak breaks
    for step in (4, 5):
        skipped(vectors[step])
    verdicts = judge_all(vectors + [skipped(base_vector(SCHEMA, 6))])
    assert [v.skipped for v in verdicts] == [False, True, True, False, True, True, True]
    assert [v.incident is not None for v in verdicts] == [False] * 6 + [True]
    incident = verdicts[6].incident
    assert incident["step"] == 4 and incident["batch"] == 4
    assert incident["note"] == "3 consecutive steps skipped by the loss scaler"


def test_a_streak_of_finite_skipped_steps_has_no_origin_tensor():
    vectors = [skipped(base_vector(SCHEMA, step)) for step in range(3)]
    incident = judge_all(vectors)[2].incident
    assert incident["step"] == 0
    assert incident["layer"] is None and incident["kind"] == diagnosis.UNKNOWN_KIND
    assert "not recorded" in incident["tensor"] and "loss scaler" in incident["tensor"]
    assert diagnosis.from_loss_scaler(incident)
    assert set(incident) >= {"step", "phase", "layer", "tensor", "kind", "epoch", "batch"}


def test_a_skipped_step_below_the_loss_scale_floor_is_an_incident_at_that_step():
    rules = diagnosis.IncidentRules(
        max_consecutive_skips=0, min_loss_scale=8.0, explosion_factor=1e3
    )
    vectors = [skipped(base_vector(SCHEMA, 0), 16.0), skipped(base_vector(SCHEMA, 1), 4.0)]
    nan_in(vectors[1], "loss", "loss", None)
    verdicts = judge_all(vectors, rules)
    assert verdicts[0].incident is None
    incident = verdicts[1].incident
    assert incident["step"] == 1 and incident["phase"] == "loss"
    assert incident["note"] == "loss scale fell to 4, below the floor 8"


def test_skips_alone_are_no_incident_when_both_rules_are_off():
    rules = diagnosis.IncidentRules(
        max_consecutive_skips=0, min_loss_scale=0.0, explosion_factor=1e3
    )
    vectors = [
        nan_in(skipped(base_vector(SCHEMA, s)), "input", "input", "input_0") for s in range(30)
    ]
    assert all(v.incident is None and v.skipped for v in judge_all(vectors, rules))


def test_journal_keeps_what_the_verdicts_decide(tmp_path):
    journal = RunJournal(
        str(tmp_path),
        SCHEMA,
        {"model": "t"},
        JournalSettings(max_consecutive_skips=2, flush_secs=1e9),
    )
    returned = []
    for step in range(5):
        vector = base_vector(SCHEMA, step)
        if step in (1, 2, 4):
            skipped(vector)
        returned.append(journal.record(step, 0, step, vector, extra={"replica": 1}))
    journal.close()
    summary = journal.summary()
    assert [r is not None for r in returned] == [False, False, True, False, False]
    assert summary["first_nonfinite"] == returned[2]
    assert returned[2]["step"] == 1 and returned[2]["replica"] == 1
    assert summary["skipped_ranges"] == [[1, 2], [4, 4]]
    rows = np.stack(journal._chunk_rows)
    assert rows[:, journal.series_columns.index("skipped")].tolist() == [0, 1, 1, 0, 1]
    assert rows[:, journal.series_columns.index("nonfinite")].tolist() == [0] * 5


def test_report_text_names_an_unknown_kind_honestly():
    incident = judge_all([skipped(base_vector(SCHEMA, s)) for s in range(3)])[2].incident
    summary = {"steps": 3, "status": "stopped", "first_nonfinite": incident}
    run = reader.Run(reader.RunListing("mp", {}), summary, SCHEMA)
    text = report.format_run(run)
    assert "first non-finite: NaN or Inf at step 0" in text
    assert "no layer" in text and "3 consecutive steps skipped" in text
