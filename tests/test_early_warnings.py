"""Early warnings (issue 58): each kind's rule, and real Keras runs.

Per kind, a run that really goes NaN/Inf later, whose warning is on disk
in time (at step 0 for the step-0 kinds, with a lead of 5 steps or more for
the forecasts), and a healthy twin that raises nothing: warm restarts, a
softmax classifier, a Normalization first on raw data, outputs that grow
then plateau, a mixed-precision run whose loss scale settles.
"""

from __future__ import annotations

import json
import math

import keras
import numpy as np
import pytest
import scenarios

from tb_nanwatch import NanWatch
from tb_nanwatch.board import report
from tb_nanwatch.evidence import early_warnings as rules
from tb_nanwatch.evidence.warning_record import warning_line, warnings_of
from tb_nanwatch.evidence.warning_watch import EarlyWarnings
from tb_nanwatch.record.writing.synthetic import build_schema

BATCH = 16
ROWS = 1600


# -- the rules ------------------------------------------------------------------


def test_a_typo_in_a_piecewise_schedule_is_a_jump_at_its_step():
    rates = [1e-3] * 61 + [10.0] * 39
    found = rules.schedule_jump(rates)
    assert found["kind"] == "schedule_jump" and found["step"] == 0
    assert found["predicted_step"] == 61
    assert found["evidence"]["rate"] == 10.0


@pytest.mark.parametrize(
    "rates",
    [
        [0.0] + [0.1 * i / 20 for i in range(1, 21)] + [0.1] * 50,  # linear warm-up from 0
        [1e-7] + [1e-3 * i / 10 for i in range(1, 11)] + [1e-3] * 10,  # warm-up from near 0
        [0.1 * 0.9**i for i in range(100)],  # exponential decay
        [0.05 * (1 + math.cos(math.pi * (i % 20) / 20)) / 2 for i in range(100)],  # restarts
        [0.05] + [0.05 * (1 + math.cos(math.pi * i / 20)) / 2 for i in range(1, 20)] + [0.0500001],
        [0.1] * 30 + [0.01] * 30 + [0.001] * 30,  # step decay
        [0.1] * 50,
    ],
    ids=[
        "warmup_from_0",
        "warmup_near_0",
        "decay",
        "warm_restarts",
        "restart_rounded_up",
        "step_decay",
        "constant",
    ],
)
def test_ramps_decays_and_restarts_are_no_jump(rates):
    assert rules.schedule_jump(rates) is None


def test_a_one_step_spike_is_a_jump():
    rates = [1e-3] * 61 + [10.0] + [1e-3] * 38
    assert rules.schedule_jump(rates)["predicted_step"] == 61


def test_a_jump_must_pass_the_largest_rate_before_it():
    rates = [1.0] * 10 + [0.001] * 10 + [0.5] * 10  # 500x up, but back below the start
    assert rules.schedule_jump(rates) is None


def _output(low, high, units=5, activation="linear"):
    return {"name": "head", "min": low, "max": high, "units": units, "activation": activation}


def test_outputs_that_are_no_probabilities_for_a_probability_loss():
    loss = "sparse_categorical_crossentropy"
    assert rules.probabilities_expected([_output(-2.0, 3.0)], loss, False)["step"] == 0
    assert rules.probabilities_expected([_output(0.0, 1.5)], loss, False) is not None
    # Rows of 5 values each at most 0.1 cannot sum to 1.
    assert rules.probabilities_expected([_output(0.0, 0.1)], loss, False) is not None
    assert rules.probabilities_expected([_output(0.0, 0.9)], loss, False) is None
    assert (
        rules.probabilities_expected([_output(-2.0, 3.0, activation="softmax")], loss, False)
        is None
    )
    assert rules.probabilities_expected([_output(-2.0, 3.0)], loss, True) is None
    assert rules.probabilities_expected([_output(-2.0, 3.0)], "mse", None) is None


def _input(name, low, high, dtype="float32", target=False):
    return {"name": name, "min": low, "max": high, "dtype": dtype, "target": target}


def test_data_at_scale_1e3_and_what_is_not_checked():
    assert rules.data_scale([_input("x", -2e5, 1e5)], "mse", "Dense")["kind"] == "data_scale"
    assert rules.data_scale([_input("x", -2e5, 1e5)], "mse", "Normalization") is None
    assert rules.data_scale([_input("x", 0, 3e4, dtype="int32")], "mse", "Embedding") is None
    assert rules.data_scale([_input("x", 0, 3e4)], "mse", "Embedding") is None
    target = _input("target", 0, 999.0, target=True)
    assert rules.data_scale([target], "sparse_categorical_crossentropy", "Dense") is None
    assert rules.data_scale([{**target, "max": 5e3}], "mse", "Dense") is not None
    assert rules.data_scale([_input("x", -999.0, 999.0)], "mse", "Dense") is None


def _logs(values):
    return np.log(np.asarray(values, np.float64))[:, None]


def test_geometric_growth_is_forecast_to_pass_float16_within_the_horizon():
    values = 100.0 * 1.3 ** np.arange(rules.WINDOW)
    ahead = rules.overflow_steps(_logs(values), np.array([rules.FLOAT16_MAX]))
    expected = math.ceil(math.log(rules.FLOAT16_MAX / values[-1]) / math.log(1.3))
    assert ahead[0] == pytest.approx(expected, abs=1)


@pytest.mark.parametrize(
    "values",
    [
        300 * (1 - 0.8 ** np.arange(1, 17)),  # grows, then plateaus
        1.0 + np.arange(16) * 50.0,  # linear growth
        1.01 ** np.arange(16),  # too slow
        1e-3 * 1.3 ** np.arange(16),  # geometric but far from the limit
        np.full(16, 7.0),
    ],
    ids=["plateau", "linear", "slow", "far", "flat"],
)
def test_growth_that_slows_or_stays_far_is_no_forecast(values):
    assert rules.overflow_steps(_logs(values), np.array([rules.FLOAT16_MAX]))[0] == np.inf


def test_a_loss_scale_halved_eight_times_in_a_row_collapses():
    found = rules.loss_scale_collapse(8, 8, 2.0**7, floor=1.0, max_skips=20)
    assert found["kind"] == "loss_scale_collapse" and found["predicted_step"] == 16
    assert rules.loss_scale_collapse(8, 7, 2.0**7, 1.0, 20) is None
    assert rules.loss_scale_collapse(8, 8, 2.0**7, 1.0, 10)["predicted_step"] == 10


def _scaled_steps(scales, nan_gradients=False):
    """An EarlyWarnings fed one step a loss scale; its warnings' kinds."""
    schema = build_schema(2)
    watch = EarlyWarnings(schema, {"dtype_policy": "mixed_float16"})
    vector = np.zeros(schema.size, np.float32)
    for entry in schema.find(phase="forward"):
        vector[entry.index("max")] = 1.0
    for entry in schema.find(phase="backward"):
        vector[entry.index("nan")] = 3.0 if nan_gradients else 0.0
    for step, scale in enumerate(scales):
        vector[schema.header_index("loss_scale")] = scale
        watch.observe(step, vector)
    return [w["kind"] for w in watch.warnings]


def test_the_halvings_from_the_initial_scale_are_no_collapse():
    start = [2.0**15 / 2**i for i in range(12)] + [16.0] * 4  # 11 halvings, Inf gradients
    assert _scaled_steps(start + [16.0 / 2**i for i in range(1, 6)]) == []  # 5 after settling
    assert _scaled_steps(start + [16.0 / 2**i for i in range(1, 9)]) == ["loss_scale_collapse"]


def test_halvings_from_the_start_over_nan_gradients_collapse():
    assert _scaled_steps([2.0**15 / 2**i for i in range(9)], nan_gradients=True) == [
        "loss_scale_collapse"
    ]


def test_the_readers_bound_and_check_what_a_run_dir_says():
    good = rules.warning(3, "data_scale", None, "\x1b[2Jraw data", {"max": math.inf, "x": [1]})
    summary = {"warnings": [good, {"kind": "nope", "step": 1}, {"kind": "data_scale"}] * 30}
    found = warnings_of(summary)
    assert len(found) == 7  # the first 20 read, the malformed left out
    assert found[0]["message"].startswith("\\x1b")
    assert found[0]["evidence"] == {"max": math.inf, "x": None}
    assert warnings_of({"warnings": "nope"}) == [] and warnings_of(None) == []
    assert "data_scale" in warning_line(found[0])


# -- real runs ------------------------------------------------------------------------


def _fit(model, x, y, log_dir, epochs=1, callbacks=()):
    watch = NanWatch(str(log_dir), remedy_trials=False)
    model.fit(x, y, batch_size=BATCH, epochs=epochs, callbacks=[watch, *callbacks], verbose=0)
    return watch


def _on_disk(log_dir) -> dict:
    """The run's report entry, read from its event files."""
    body, _ = report.build_report(report.load_provider(str(log_dir)))
    (run,) = body["runs"]
    return run


def _kinds(run: dict) -> list[str]:
    return [w["kind"] for w in run["warnings"]]


def _data(seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(ROWS, 4)) * scale).astype("float32")
    y = (rng.normal(size=(ROWS, 4)) @ rng.normal(size=(4, 1))).astype("float32")
    return x, y


def _regressor(optimizer, first=None):
    layers = [keras.Input((4,))] + ([first] if first is not None else [])
    model = keras.Sequential(
        layers + [keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
    )
    model.compile(optimizer, "mse")
    return model


def test_schedule_jump_is_on_disk_at_step_0_before_the_inf(tmp_path, seeded, capfd):
    x, y = _data()
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([60], [1e-3, 10.0])
    watch = _fit(_regressor(keras.optimizers.SGD(schedule)), x, y, tmp_path)
    run = _on_disk(tmp_path)
    (found,) = run["warnings"]
    assert found["kind"] == "schedule_jump" and found["step"] == 0
    assert found["predicted_step"] == 61
    assert run["first_nonfinite"]["step"] >= 61  # the run really went non-finite after it
    assert watch.incident is not None
    assert capfd.readouterr().err.count("NanWatch warning at step 0 [schedule_jump") == 1


def test_warm_restarts_raise_nothing(tmp_path, seeded):
    x, y = _data()
    schedule = keras.optimizers.schedules.CosineDecayRestarts(0.05, 20)
    _fit(_regressor(keras.optimizers.SGD(schedule)), x, y, tmp_path)
    run = _on_disk(tmp_path)
    assert run["warnings"] == [] and run["first_nonfinite"] is None


def _classifier(final_activation, loss):
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(5, activation=final_activation),
        ]
    )
    model.compile(keras.optimizers.Adam(1e-2), loss)
    return model


def _labels():
    return np.random.default_rng(1).integers(0, 5, size=ROWS)


def test_logits_into_a_probability_loss_warn_at_step_0(tmp_path, seeded):
    x, _ = _data()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=False)
    _fit(_classifier(None, loss), x, _labels(), tmp_path)
    run = _on_disk(tmp_path)
    (found,) = run["warnings"]
    assert found["kind"] == "probabilities_expected" and found["step"] == 0
    assert found["evidence"]["min"] < 0
    assert found["outlived"] is True  # Keras clips the probabilities: no NaN, the run went on


class _HandWrittenCrossentropy(keras.losses.Loss):
    """``-log`` of the probability of the true class, as a user writes it."""

    from_logits = False

    def call(self, y_true, y_pred):
        picked = keras.ops.take_along_axis(
            y_pred, keras.ops.cast(keras.ops.reshape(y_true, (-1, 1)), "int32"), axis=1
        )
        return -keras.ops.log(picked[:, 0])


def test_logits_into_a_hand_written_log_warn_on_disk_with_the_nan(tmp_path, seeded):
    x, _ = _data()
    _fit(_classifier(None, _HandWrittenCrossentropy()), x, _labels(), tmp_path)
    run = _on_disk(tmp_path)
    (found,) = run["warnings"]
    assert found["kind"] == "probabilities_expected" and found["step"] == 0
    assert run["first_nonfinite"] is not None and found["outlived"] is False


def test_a_softmax_classifier_raises_nothing(tmp_path, seeded):
    x, _ = _data()
    _fit(_classifier("softmax", "sparse_categorical_crossentropy"), x, _labels(), tmp_path)
    assert _on_disk(tmp_path)["warnings"] == []


def test_raw_data_at_1e5_warns_at_step_0_before_the_inf(tmp_path, seeded):
    x, y = _data(scale=1e5)
    _fit(_regressor(keras.optimizers.SGD(0.01)), x, y, tmp_path)
    run = _on_disk(tmp_path)
    assert _kinds(run) == ["data_scale"] and run["warnings"][0]["step"] == 0
    assert run["first_nonfinite"] is not None  # the first updates overflowed


def test_a_normalization_first_on_raw_data_raises_nothing(tmp_path, seeded):
    x, y = _data(scale=1e5)
    norm = keras.layers.Normalization()
    norm.adapt(x)
    _fit(_regressor(keras.optimizers.SGD(0.01), first=norm), x, y, tmp_path)
    run = _on_disk(tmp_path)
    assert run["warnings"] == [] and run["first_nonfinite"] is None


class _ReadWhileTraining(keras.callbacks.Callback):
    """Reads the run's warnings from disk at the first step the journal has one."""

    def __init__(self, watch, log_dir):
        super().__init__()
        self.watch, self.log_dir, self.seen = watch, log_dir, None

    def on_train_batch_end(self, batch, logs=None):
        journal = self.watch.journal  # settles the steps submitted so far
        if self.seen is None and journal is not None and journal.early_warnings.warnings:
            self.seen = (batch, _on_disk(self.log_dir)["warnings"])


def test_a_diverging_regression_is_forecast_with_a_lead_of_5_steps(tmp_path, seeded):
    x, y = _data()
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(1.5), "mse")
    watch = NanWatch(str(tmp_path), remedy_trials=False)
    reader = _ReadWhileTraining(watch, tmp_path)
    model.fit(x, y, batch_size=BATCH, callbacks=[watch, reader], verbose=0)
    run = _on_disk(tmp_path)
    (found,) = run["warnings"]
    assert found["kind"] == "overflow_forecast"
    nonfinite = run["first_nonfinite"]["step"]
    assert nonfinite - found["step"] >= 5  # the lead time
    assert abs(found["predicted_step"] - nonfinite) <= 10
    read_at, seen = reader.seen
    assert read_at < nonfinite and [w["kind"] for w in seen] == ["overflow_forecast"]  # in time
    assert found["outlived"] is False


def test_outputs_that_grow_then_plateau_raise_nothing(tmp_path, seeded):
    x, _ = _data()
    y = (x @ np.full((4, 1), 100.0)).astype("float32")  # the output grows ~100x, then settles
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.1), "mse")
    _fit(model, x, y, tmp_path)
    run = _on_disk(tmp_path)
    assert run["warnings"] == [] and run["first_nonfinite"] is None


class _Gain(keras.layers.Layer):
    """Multiplies by a gain the _Grow callback sets (not trained)."""

    def build(self, shape):
        self.gain = self.add_weight(shape=(), initializer="ones", trainable=False, name="gain")

    def call(self, t):
        return t * keras.ops.cast(self.gain, t.dtype)


class _Grow(keras.callbacks.Callback):
    """The gain grows by ``factor`` a step up to ``cap``."""

    def __init__(self, layer, factor, cap):
        super().__init__()
        self.layer, self.factor, self.cap = layer, factor, cap

    def on_train_batch_end(self, batch, logs=None):
        self.layer.gain.assign(min(float(self.layer.gain.numpy()) * self.factor, self.cap))


def test_float16_activations_that_grow_then_plateau_raise_nothing(
    tmp_path, seeded, mixed_precision
):
    x, y = _data()
    gain = _Gain()
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(8), gain, keras.layers.Dense(1, dtype="float32")]
    )
    model.compile(keras.optimizers.SGD(0.0), "mse")
    _fit(model, x, y, tmp_path, callbacks=[_Grow(gain, 1.15, 300.0)])  # 1.15x a step to 300x
    run = _on_disk(tmp_path)
    assert run["warnings"] == [] and run["first_nonfinite"] is None


def test_a_collapsing_loss_scale_warns_before_the_run_stalls(tmp_path, seeded, mixed_precision):
    x, y = _data()
    x[20 * BATCH :: BATCH] = 0.0  # from step 20, an all-zero row a batch: sqrt'(0) is NaN
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, use_bias=False),
            keras.layers.Lambda(lambda t: keras.ops.sqrt(keras.ops.abs(t))),
            keras.layers.Dense(1, dtype="float32"),
        ]
    )
    model.compile(keras.optimizers.SGD(0.01), "mse")
    watch = NanWatch(str(tmp_path), remedy_trials=False)
    model.fit(x, y, batch_size=BATCH, callbacks=[watch], verbose=0, shuffle=False)
    run = _on_disk(tmp_path)
    (found,) = run["warnings"]
    assert found["kind"] == "loss_scale_collapse" and found["step"] > 20
    assert run["first_nonfinite"]["step"] - found["step"] >= 5  # the lead time
    assert found["predicted_step"] == run["first_nonfinite"]["step"]


def test_nan_gradients_from_the_first_step_collapse_the_scale(tmp_path, seeded, mixed_precision):
    x, y = _data()
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8),
            keras.layers.Lambda(lambda t: keras.ops.sqrt(keras.ops.relu(t))),  # sqrt'(0) * 0
            keras.layers.Dense(1, dtype="float32"),
        ]
    )
    model.compile(keras.optimizers.SGD(0.01), "mse")
    _fit(model, x, y, tmp_path)
    run = _on_disk(tmp_path)
    (found,) = run["warnings"]
    assert found["kind"] == "loss_scale_collapse"
    assert run["first_nonfinite"]["step"] - found["step"] >= 5  # the lead time


def test_a_healthy_mixed_precision_run_raises_nothing(tmp_path, seeded, mixed_precision):
    x, y = _data()
    model = _regressor(keras.optimizers.Adam(1e-2))
    _fit(model, x, y, tmp_path)
    run = _on_disk(tmp_path)
    assert run["warnings"] == [] and run["first_nonfinite"] is None


def test_under_rewind_a_foreseen_jump_takes_a_rewind_point_just_before_it(tmp_path, seeded):
    x, y = _data()
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([60], [1e-3, 10.0])
    model = _regressor(keras.optimizers.SGD(schedule))
    watch = NanWatch(str(tmp_path), on_nonfinite="rewind")
    model.fit(x, y, batch_size=BATCH, callbacks=[watch], verbose=0, shuffle=False)
    summary = watch.journal.summary()
    assert [w["kind"] for w in summary["warnings"]] == ["schedule_jump"]
    first = summary["recoveries"][0]
    assert 61 - 2 - 1 <= first["rewound_to"] <= 61  # not back to the periodic point at 50


def test_the_tab_marks_each_warning_at_its_step():
    from nanwatch_testlib import run_node_module

    warnings = [
        rules.warning(15, "overflow_forecast", 48, "loss grows", {}),
        rules.warning(0, "schedule_jump", 61, "jumps", {}),
        {"kind": "data_scale"},  # malformed: left out
    ]
    out = run_node_module(
        'import { warningMarks, foreseen } from "./src/warnings.js";\n'
        f"const tl = {{ warnings: {json.dumps(warnings)} }};\n"
        "console.log(JSON.stringify({ marks: warningMarks(tl), "
        "none: warningMarks({}), plain: foreseen({ step: 0, predicted_step: null }) }));"
    )
    assert out["marks"] == [
        {"step": 0, "text": "warning schedule_jump: step 0, predicted step 61 (61 steps ahead)"},
        {
            "step": 15,
            "text": "warning overflow_forecast: step 15, predicted step 48 (33 steps ahead)",
        },
    ]
    assert out["none"] == [] and out["plain"] == ""


def test_the_watch_never_raises_on_what_it_cannot_read():
    schema = build_schema(2)
    broken = EarlyWarnings(schema, {"loss_name": object(), "warnings": "nope"})
    assert broken.observe(0, np.ones(3, np.float32)) is False  # a vector of the wrong size
    assert broken.observe(1, np.ones(schema.size, np.float32)) is False
    assert broken.finished({"steps": "many"}) == []


@pytest.mark.parametrize("build", [scenarios.healthy, scenarios.healthy_small])
def test_the_suites_healthy_runs_raise_nothing(build, tmp_path):
    _, watch, _, _ = scenarios.fit(build, tmp_path, epochs=2)
    assert watch.journal.summary()["warnings"] == []


def test_a_custom_loops_run_without_a_precursor_raises_nothing(tmp_path):
    # A division by an exact zero at step 29, with nothing growing before it.
    watcher, _ = scenarios.train_custom_loop(
        lambda: scenarios.ratio_multi_io(zero_step=29, steps=30), tmp_path
    )
    assert watcher.journal.steps >= 29
    assert watcher.journal.summary().get("warnings", []) == []


def test_a_hostile_warning_in_a_run_dir_prints_inert(tmp_path, capsys):
    from nanwatch_testlib import base_vector

    from tb_nanwatch import cli
    from tb_nanwatch.record.writing.journal import RunJournal

    schema = build_schema(2)
    hostile = rules.warning(0, "data_scale", None, "\x1b]52;c;bad\x07\x1b[2J", {"\x1b": 1})
    journal = RunJournal(str(tmp_path), schema, {"warnings": [hostile, {"kind": "x"}]})
    for step in range(3):
        journal.record(step, 0, step, base_vector(schema, step))
    journal.close()
    assert cli.main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\\x1b]52;c;bad\\x07" in out
    (found,) = _on_disk(tmp_path)["warnings"]
    assert found["evidence"] == {"\\x1b": 1} and found["outlived"] is True
