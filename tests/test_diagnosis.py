"""diagnosis.py: one incident rule for the journal, the heatmap, the step table and the hints."""

from __future__ import annotations

import math

import numpy as np
import pytest
from nanwatch_testlib import base_vector

from tb_nanwatch.board import reader, report, views
from tb_nanwatch.evidence import diagnosis
from tb_nanwatch.evidence.options import WatchOptions
from tb_nanwatch.evidence.recorded import Flight
from tb_nanwatch.record.writing.journal import RunJournal
from tb_nanwatch.record.writing.synthetic import build_schema

SCHEMA = build_schema(3)
LAYERS = [e.layer for e in SCHEMA.find(kind="activation")]
RULES = WatchOptions(max_consecutive_skips=3, min_loss_scale=0.0)


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
    grad = entry("backward", "grad_in", LAYERS[1])
    vector[grad.index("norm")] = np.inf  # the sum of squares overflowed float32
    assert not diagnosis.entry_nonfinite(vector, grad)
    assert diagnosis.find_origin(SCHEMA, vector) is None
    heatmap = views.heatmap(Flight(0, vector[None, :], SCHEMA), None)
    assert heatmap["nonfinite"] == [[0]] * len(heatmap["layers"])
    assert heatmap["grad_norm"][heatmap["layers"].index(LAYERS[1])] == [math.inf]


def test_heatmap_cells_are_nonfinite_exactly_where_the_diagnosis_finds_nonfinite_entries():
    vectors = [base_vector(SCHEMA, step) for step in range(4)]
    nan_in(vectors[2], "forward", "activation", LAYERS[1])
    nan_in(vectors[3], "backward", "grad_var", LAYERS[0])
    heatmap = views.heatmap(Flight(0, np.stack(vectors), SCHEMA), None)
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
    rules = WatchOptions(max_consecutive_skips=0, min_loss_scale=8.0)
    vectors = [skipped(base_vector(SCHEMA, 0), 16.0), skipped(base_vector(SCHEMA, 1), 4.0)]
    nan_in(vectors[1], "loss", "loss", None)
    verdicts = judge_all(vectors, rules)
    assert verdicts[0].incident is None
    incident = verdicts[1].incident
    assert incident["step"] == 1 and incident["phase"] == "loss"
    assert incident["note"] == "loss scale fell to 4, below the floor 8"


def test_skips_alone_are_no_incident_when_both_rules_are_off():
    rules = WatchOptions(max_consecutive_skips=0, min_loss_scale=0.0)
    vectors = [
        nan_in(skipped(base_vector(SCHEMA, s)), "input", "input", "input_0") for s in range(30)
    ]
    assert all(v.incident is None and v.skipped for v in judge_all(vectors, rules))


def test_journal_keeps_what_the_verdicts_decide(tmp_path):
    journal = RunJournal(
        str(tmp_path),
        SCHEMA,
        {"model": "t"},
        WatchOptions(max_consecutive_skips=2, flush_secs=1e9),
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


# -- the explosion detector ----------------------------------------------------


def detect(columns: dict[str, np.ndarray], factor: float = 1e3) -> dict | None:
    """Feeds every step of ``columns`` (signal -> values), then ends the run."""
    names = list(columns)
    signals = [(n.split(":")[0], n.split(":")[1] if ":" in n else None) for n in names]
    detector = diagnosis.ExplosionDetector(signals, factor=factor)
    rows = np.stack([np.asarray(columns[n], np.float64) for n in names], axis=1)
    fired = [detector.update(step, row) for step, row in enumerate(rows)]
    end = detector.finish()
    found = [f for f in fired if f is not None] + ([end] if end else [])
    assert len(found) <= 1  # once per run
    return found[0] if found else None


def healthy_columns(rng: np.random.Generator, steps: int) -> dict[str, np.ndarray]:
    t = np.arange(steps)
    return {
        "loss": 2.0 * np.exp(-t / 300) * rng.lognormal(0, 0.3, steps),
        "grad_norm": rng.lognormal(0, 0.8, steps),
        "logits": 8.0 + rng.normal(0, 1.5, steps) ** 2,
        "activation:dense_1": 3.0 * rng.lognormal(0, 0.3, steps),
    }


@pytest.mark.parametrize("seed", range(30))
def test_healthy_noisy_runs_raise_no_alarm(seed):
    rng = np.random.default_rng(seed)
    assert detect(healthy_columns(rng, int(rng.integers(2, 600)))) is None


def test_spikes_that_come_back_raise_no_alarm():
    rng = np.random.default_rng(1)
    columns = healthy_columns(rng, 400)
    for at, width in ((0, 1), (50, 2), (120, 1), (300, 2)):
        columns["loss"][at : at + width] *= 1e5
        columns["grad_norm"][at + 3 : at + 3 + width] *= 1e6
    assert detect(columns) is None


def test_large_steady_logits_raise_no_alarm():
    rng = np.random.default_rng(2)
    columns = healthy_columns(rng, 300)
    columns["logits"] = 4e4 * rng.lognormal(0, 0.2, 300)
    columns["activation:dense_1"] = 1e6 * rng.lognormal(0, 0.2, 300)
    assert detect(columns) is None


def test_a_loss_trained_down_to_1e_minus_6_raises_no_alarm():
    rng = np.random.default_rng(3)
    loss = np.geomspace(2.0, 1e-6, 2000) * rng.lognormal(0, 0.3, 2000)
    loss[1500:1510] = 1e-3  # a bump, far below where training started
    assert detect({"loss": loss, "grad_norm": rng.lognormal(0, 0.5, 2000)}) is None


def test_an_activation_growing_from_zero_to_unit_size_is_no_explosion():
    activation = np.r_[0.0, np.geomspace(1e-6, 2.0, 99)]
    assert detect({"loss": np.ones(100), "activation:head": activation}) is None


@pytest.mark.parametrize("steps", [2, 3, 40])
def test_an_explosion_at_step_1_is_found_with_no_warm_up(steps):
    logits = np.full(steps, 1e8)
    logits[0] = 3.0
    onset = detect({"loss": np.ones(steps), "grad_norm": np.ones(steps), "logits": logits})
    assert onset["step"] == 1 and onset["signal"] == "logits"
    assert onset["factor"] == pytest.approx(1e8 / 3.0)


def test_an_explosion_in_the_last_steps_fires_when_the_run_ends():
    rng = np.random.default_rng(4)
    loss = np.r_[0.4 * rng.lognormal(0, 0.1, 200), [17, 61, 1.2e4, 8e11]]
    detector = diagnosis.ExplosionDetector([("loss", None)])
    assert all(detector.update(step, [v]) is None for step, v in enumerate(loss))
    onset = detector.finish()
    assert onset["step"] == 200 and onset["signal"] == "loss"  # where 17 broke out
    assert onset["factor"] > 1e11
    assert detector.finish() is None  # once per run


def test_a_layer_whose_max_abs_explodes_while_the_loss_is_steady():
    rng = np.random.default_rng(5)
    columns = healthy_columns(rng, 120)
    columns["loss"] = 0.7 * rng.lognormal(0, 0.05, 120)
    columns["activation:block/conv3"] = np.r_[2.0 * np.ones(80), 2.0 * 3.0 ** np.arange(1, 41)]
    onset = detect(columns)
    assert onset["signal"] == "activation" and onset["layer"] == "block/conv3"
    assert 81 <= onset["step"] <= 83  # 3^3 x = 54: above 10x the reference


@pytest.mark.parametrize("reference_steps", [4, 5, 25])
@pytest.mark.parametrize("seed", range(8))
def test_the_steady_state_shortcut_judges_every_step_as_the_full_rule(
    seed, reference_steps, monkeypatch
):
    # Once every reference ring is full, update() takes medians only where one can
    # lower the reference (_steady_update). Fed the same steps (trends, zeros,
    # spikes, non-finite values, explosions), it must decide exactly as the
    # full rule does at every step.
    rng = np.random.default_rng(seed)
    steps = 400
    t = np.arange(steps)
    columns = np.stack(
        [
            2.0 * np.exp(-t / 80) * rng.lognormal(0, 0.3, steps),  # trained down
            rng.lognormal(0, 1.0, steps),
            np.where(rng.random(steps) < 0.05, 0.0, rng.lognormal(2, 0.5, steps)),
            1e-3 * rng.lognormal(0, 0.2, steps),  # a unit signal below 1
        ],
        axis=1,
    )
    columns[rng.random(columns.shape) < 0.02] = np.nan
    columns[rng.random(columns.shape) < 0.01] = np.inf
    for at in rng.integers(reference_steps, steps, 3):
        column = int(rng.integers(0, 4))
        columns[at : at + 6, column] *= 10.0 ** rng.integers(2, 7)
    signals = [("loss", None), ("grad_norm", None), ("activation", "a"), ("logits", None)]
    shortcut = diagnosis.ExplosionDetector(signals, reference_steps=reference_steps, patience=2)
    full = diagnosis.ExplosionDetector(signals, reference_steps=reference_steps, patience=2)
    monkeypatch.setattr(full, "_steady_update", lambda step, values: False)
    taken = 0
    for step, row in enumerate(columns):
        steady = shortcut._floor_line is not None and np.isfinite(row).all()
        taken += steady
        assert shortcut.update(step, row) == full.update(step, row)
        for name in ("_lowest", "_stretch", "_above", "_ratio", "_ring"):
            np.testing.assert_array_equal(getattr(shortcut, name), getattr(full, name), name)
    assert shortcut.pending() == full.pending()
    assert shortcut.finish() == full.finish()
    assert taken > steps / 2  # the shortcut really ran


def test_the_factor_must_exceed_the_rise():
    with pytest.raises(ValueError, match="factor"):
        diagnosis.ExplosionDetector(factor=5.0)


def _loss_at(values: dict[int, float]):
    def edit(step, vector, schema):
        if step in values:
            vector[schema.header_index("loss")] = values[step]

    return edit


def test_the_journal_reports_a_climb_cut_short_by_the_end_of_the_run(tmp_path):
    from nanwatch_testlib import write_vector_run

    summary = write_vector_run(
        str(tmp_path), 104, _loss_at({100: 17.0, 101: 61.0, 102: 1.2e4, 103: 8e11})
    )
    assert summary["first_nonfinite"] is None
    assert summary["explosion"]["step"] == 100 and summary["explosion"]["signal"] == "loss"


def test_the_journal_reports_the_climb_at_the_first_nonfinite_step(tmp_path):
    from nanwatch_testlib import write_vector_run

    def edit(step, vector, schema):
        _loss_at({0: 1.4e3, 1: 2.9e6, 2: 1.4e29, 3: np.inf})(step, vector, schema)
        if step == 3:
            vector[schema.find(kind="activation")[2].index("inf")] = 5.0

    summary = write_vector_run(str(tmp_path), 10, edit)
    assert summary["first_nonfinite"]["step"] == 3
    assert summary["explosion"]["step"] == 1 and summary["explosion"]["signal"] == "loss"


# -- a regression learning its scale is healthy -------------------------------------------


def learning_to_1e5(loss_rises: bool = False) -> list[np.ndarray]:
    """Targets 5e4-1.5e5; the outputs grow from 1 to 1e5 over 20 steps while
    the loss falls from 1e10 (or, ``loss_rises``, climbs)."""
    from test_remedies import make_schema, put

    schema = make_schema()
    vectors = []
    for step in range(40):
        vector = base_vector(schema, step)
        put(schema, vector, "input", "input", "target", min=5e4, max=1.5e5)
        size = 10.0 ** min(5.0, step / 4)
        for name in ("dense_0", "dense_1", "dense_2"):
            put(schema, vector, "forward", "activation", name, min=0.0, max=size)
        put(schema, vector, "forward", "logits", "out", min=-size, max=size)
        fall = 1e10 * 0.8**step * (1 + 0.3 * (step % 2))  # noisy, as one batch's loss is
        vector[schema.header_index("loss")] = 1e10 * 1.5**step if loss_rises else fall
        vectors.append(vector)
    return schema, vectors


def explosion_of(schema, vectors) -> dict | None:
    run = diagnosis.RunDiagnosis(schema, WatchOptions())
    for step, vector in enumerate(vectors):
        verdict = run.judge(diagnosis.StepPlace(step, 0, step), vector)
        if verdict.explosion is not None:
            return verdict.explosion
    return run.finish()


def test_outputs_growing_toward_large_targets_while_the_loss_falls_are_no_explosion():
    assert explosion_of(*learning_to_1e5()) is None
    climbing = explosion_of(*learning_to_1e5(loss_rises=True))
    assert climbing is not None and climbing["signal"] in ("loss", "logits", "activation")


def test_outputs_far_beyond_the_targets_still_explode_while_the_loss_falls():
    schema, vectors = learning_to_1e5()
    from test_remedies import put

    for step in range(25, 40):
        put(schema, vectors[step], "forward", "logits", "out", min=-1e12, max=1e12)
    found = explosion_of(schema, vectors)
    assert found is not None and found["signal"] == "logits"


def test_a_dense_regression_fit_to_targets_of_1e5_is_healthy(tmp_path):
    import keras
    from nanwatch_testlib import report_json

    import tb_nanwatch

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64 * 8, 4)).astype("float32")
    y = (1e5 + 2e4 * x @ np.array([[1.0], [0.5], [-0.3], [0.2]])).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    watch = tb_nanwatch.NanWatch(str(tmp_path / "run"))
    history = model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[watch])
    assert history.history["loss"][0] < 1e10  # it learned: 1e10 at the first step
    prediction = model.predict(x[:16], verbose=0)
    assert np.abs(prediction - y[:16]).max() < 1e4  # the outputs reached the targets' scale
    (run,) = report_json(tmp_path)
    assert run["cause"] is None, run["cause"]
