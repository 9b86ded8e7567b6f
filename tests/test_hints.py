"""The cause engine's signs (the card's hints): each fires on data that supports it, and only then."""

from __future__ import annotations

import json

import numpy as np
import pytest
from nanwatch_testlib import base_vector

from tb_nanwatch.evidence import causes
from tb_nanwatch.evidence.recorded import Flight, Record, Series
from tb_nanwatch.record.writing.synthetic import build_schema

SCHEMA = build_schema(3)
LAYERS = [e.layer for e in SCHEMA.find(kind="activation")]


def series(n: int, **columns: np.ndarray) -> Series:
    base = {
        "loss": np.ones(n),
        "grad_norm": np.ones(n),
        "logit_min": -np.ones(n),
        "logit_max": np.ones(n),
        "lr": np.full(n, 1e-3),
    }
    base.update(columns)
    return Series(np.arange(n), {k: np.asarray(v, np.float32) for k, v in base.items()})


def flight(first: int, last: int, edit=None) -> Flight:
    vectors = []
    for step in range(first, last + 1):
        vector = base_vector(SCHEMA, step)
        if edit is not None:
            edit(step, vector)
        vectors.append(vector)
    return Flight(first, np.stack(vectors), SCHEMA)


def entry(phase: str, kind: str, layer):
    return next(e for e in SCHEMA.entries if (e.phase, e.kind, e.layer) == (phase, kind, layer))


def incident(step: int, phase: str, layer=None, kind: str = "nan", **extra) -> dict:
    return {
        "step": step,
        "phase": phase,
        "layer": layer,
        "tensor": extra.pop("tensor", f"{phase} tensor"),
        "kind": kind,
        "epoch": 0,
        "batch": step,
        **extra,
    }


def ids(record: Record) -> list[str]:
    found = causes.compute_hints(record)
    for hint in found:
        json.dumps(hint, allow_nan=False)  # evidence is plain, finite JSON
        assert set(hint) == {"id", "title", "text", "evidence"}
    return [h["id"] for h in found]


def only(record: Record, hint_id: str) -> dict:
    found = {h["id"]: h for h in causes.compute_hints(record)}
    assert hint_id in found, list(found)
    return found[hint_id]


# (a) logits rising before a loss-phase NaN ---------------------------------


def rising_logits(n: int = 51, rise_from: int = 40) -> np.ndarray:
    logits = np.full(n, 5.0)
    logits[rise_from:] = 5.0 + np.arange(n - rise_from)
    return logits


def test_logits_rising_fires_with_count_and_values():
    rec = Record(SCHEMA, incident(50, "loss"), series=series(51, logit_max=rising_logits()))
    hint = only(rec, "logits_rising")
    assert hint["evidence"]["steps"] == 10
    assert hint["evidence"]["first"] == 5.0 and hint["evidence"]["last"] == 15.0
    assert (hint["evidence"]["first_step"], hint["evidence"]["last_step"]) == (40, 50)
    assert "10 consecutive steps" in hint["text"]


def test_logits_rising_stops_at_a_nonfinite_incident_value():
    logits = rising_logits()
    logits[50] = np.nan
    rec = Record(SCHEMA, incident(50, "loss"), series=series(51, logit_max=logits))
    assert only(rec, "logits_rising")["evidence"]["last_step"] == 49


@pytest.mark.parametrize(
    "case",
    ["flat", "noisy", "short_rise", "forward_phase", "no_series"],
)
def test_logits_rising_does_not_fire_without_support(case):
    logits = rising_logits()
    phase = "loss"
    data = series
    if case == "flat":
        logits = np.full(51, 5.0)
    elif case == "noisy":
        logits = 5.0 + np.random.default_rng(0).random(51)
    elif case == "short_rise":
        logits = rising_logits(rise_from=47)
    elif case == "forward_phase":
        phase = "forward"
    rec = Record(
        SCHEMA,
        incident(50, phase),
        series=None if case == "no_series" else data(51, logit_max=logits),
    )
    assert "logits_rising" not in ids(rec)


# (b) gradient-norm spike ----------------------------------------------------


def test_grad_norm_spike_fires_with_ratio():
    norms = np.ones(101)
    norms[95:100] = 5000.0
    norms[100] = np.inf
    rec = Record(
        SCHEMA,
        incident(100, "backward", LAYERS[1]),
        series=series(101, grad_norm=norms),
    )
    hint = only(rec, "grad_norm_spike")
    assert hint["evidence"]["ratio"] == pytest.approx(5000.0)
    assert hint["evidence"]["median"] == 1.0
    assert hint["evidence"]["grad_norm_step"] == 95


@pytest.mark.parametrize("case", ["small_rise", "too_few_earlier", "no_incident"])
def test_grad_norm_spike_does_not_fire_without_support(case):
    n = 15 if case == "too_few_earlier" else 101
    norms = np.ones(n)
    norms[-3:] = 50.0 if case == "small_rise" else 5000.0
    rec = Record(
        SCHEMA,
        None if case == "no_incident" else incident(n - 1, "forward", LAYERS[0]),
        series=series(n, grad_norm=norms),
    )
    assert "grad_norm_spike" not in ids(rec)


# (c) saturated sigmoid/softmax fed to the loss ------------------------------

LOGITS = entry("forward", "logits", LAYERS[-1])


def saturated(step, vector, low=-31.0, high=2.0):
    vector[[LOGITS.index("min"), LOGITS.index("max")]] = (low, high)


def test_saturated_output_fires_from_the_flight_window():
    rec = Record(SCHEMA, incident(20, "loss", kind="inf"), flight=flight(10, 20, saturated))
    hint = only(rec, "saturated_output")
    assert hint["evidence"]["max_abs_logit"] == 31.0
    assert hint["evidence"]["output"] == LAYERS[-1]
    assert "from_logits=True" in hint["text"]


def test_saturated_output_falls_back_to_the_series():
    rec = Record(
        SCHEMA,
        incident(20, "loss", kind="inf"),
        series=series(21, logit_min=np.full(21, -40.0)),
    )
    assert only(rec, "saturated_output")["evidence"]["max_abs_logit"] == 40.0


@pytest.mark.parametrize("case", ["moderate", "forward_phase", "no_activation"])
def test_saturated_output_does_not_fire_without_support(case):
    schema = SCHEMA
    edit = saturated
    if case == "moderate":

        def edit(step, vector):
            return saturated(step, vector, -3.0, 3.0)

    if case == "no_activation":
        # The recorder names a plain output "output of ...": no sigmoid/softmax.
        schema = build_schema(3)
        logits = schema.find(kind="logits")[0]
        schema.entries[schema.entries.index(logits)] = type(logits)(
            logits.phase,
            logits.kind,
            logits.layer,
            "output of model output y",
            logits.offset,
        )
    window = flight(10, 20, edit)
    rec = Record(
        schema,
        incident(20, "forward" if case == "forward_phase" else "loss", kind="inf"),
        flight=Flight(window.first_step, window.matrix, schema),
    )
    assert "saturated_output" not in ids(rec)


# (d) non-finite input -------------------------------------------------------

INPUT = entry("input", "input", "input_0")


def nonfinite_input(step, vector):
    if step == 30:
        vector[INPUT.index("nan")] = 2.0


def test_input_nonfinite_names_the_input():
    rec = Record(
        SCHEMA,
        incident(30, "input", "input_0", tensor="model input input_0"),
        flight=flight(20, 30, nonfinite_input),
    )
    hint = only(rec, "input_nonfinite")
    assert hint["evidence"]["input"] == "model input 'input_0'"
    assert hint["text"].startswith("Model input 'input_0' contained NAN at step 30")
    assert hint["evidence"]["finite_steps_before"] == 10
    assert "data pipeline" in hint["text"]
    assert "float64" not in hint["text"]


def test_input_inf_mentions_float64():
    rec = Record(SCHEMA, incident(30, "input", "input_0", kind="inf"))
    assert "float64" in only(rec, "input_nonfinite")["text"]


@pytest.mark.parametrize("phase", ["forward", "loss", "backward"])
def test_input_hint_needs_an_input_phase_origin(phase):
    rec = Record(SCHEMA, incident(30, phase, LAYERS[0]), flight=flight(20, 30))
    assert "input_nonfinite" not in ids(rec)


# (e) update-phase non-finite with a zero gradient: Adam epsilon ------------

GRAD_VAR = entry("backward", "grad_var", LAYERS[1])
UPDATE = incident(40, "update", LAYERS[1], tensor=f"{LAYERS[1]}/kernel after update")


def zero_grad(step, vector):
    vector[GRAD_VAR.index("norm")] = 0.0


def test_adam_epsilon_fires_on_a_zero_gradient():
    rec = Record(SCHEMA, UPDATE, flight=flight(30, 40, zero_grad), summary={"optimizer": "Adam"})
    hint = only(rec, "adam_epsilon")
    assert hint["evidence"]["zero_gradient"] == GRAD_VAR.tensor
    assert hint["evidence"]["grad_norm"] == 0.0
    assert hint["evidence"]["optimizer"] == "Adam"
    assert "epsilon" in hint["text"]


@pytest.mark.parametrize("case", ["nonzero_gradients", "no_flight", "not_update", "outside_window"])
def test_adam_epsilon_does_not_fire_without_support(case):
    record = {
        "nonzero_gradients": Record(SCHEMA, UPDATE, flight=flight(30, 40)),
        "no_flight": Record(SCHEMA, UPDATE),
        "not_update": Record(
            SCHEMA, incident(40, "forward", LAYERS[1]), flight=flight(30, 40, zero_grad)
        ),
        "outside_window": Record(SCHEMA, UPDATE, flight=flight(10, 20, zero_grad)),
    }[case]
    assert "adam_epsilon" not in ids(record)


# (f) backward-phase origin with a finite forward pass ----------------------

BACKWARD = incident(25, "backward", LAYERS[1], tensor=f"gradient w.r.t. output of {LAYERS[1]}")


def test_backward_origin_fires_with_finite_forward():
    rec = Record(SCHEMA, BACKWARD, flight=flight(20, 25))
    hint = only(rec, "backward_origin")
    assert hint["evidence"]["layer"] == LAYERS[1]
    assert hint["evidence"]["loss"] == 0.5  # the total-loss entry
    assert hint["evidence"]["output_min"] == -1.0
    assert "epsilon" in hint["text"] and "sqrt" in hint["text"]


def test_backward_origin_uses_the_series_without_a_window():
    rec = Record(SCHEMA, BACKWARD, series=series(26))
    assert only(rec, "backward_origin")["evidence"]["loss"] == 1.0


def forward_nan(step, vector):
    activation = entry("forward", "activation", LAYERS[0])
    vector[activation.index("nan")] = 1.0


@pytest.mark.parametrize("case", ["forward_nonfinite", "loss_scaler_streak", "nan_loss", "no_data"])
def test_backward_origin_does_not_fire_without_support(case):
    record = {
        "forward_nonfinite": Record(SCHEMA, BACKWARD, flight=flight(20, 25, forward_nan)),
        "loss_scaler_streak": Record(
            SCHEMA,
            incident(25, "backward", None, tensor="scaled gradients", note="20 skipped"),
            flight=flight(20, 25),
        ),
        "nan_loss": Record(SCHEMA, BACKWARD, series=series(26, loss=np.full(26, np.nan))),
        "no_data": Record(SCHEMA, BACKWARD),
    }[case]
    assert "backward_origin" not in ids(record)


# (g) explosion without NaN -------------------------------------------------


def exploding_loss(n: int = 80, onset: int = 60) -> np.ndarray:
    loss = np.ones(n)
    loss[onset:] = 1e4
    return loss


def test_explosion_fires_without_an_incident():
    rec = Record(
        SCHEMA,
        None,
        explosion={"step": 60, "signal": "loss"},
        series=series(80, loss=exploding_loss()),
    )
    hint = only(rec, "explosion")
    # A record written without factor/value/reference: the series' peak / median.
    assert hint["evidence"]["factor"] == pytest.approx(1e4)
    assert hint["evidence"]["lr"] == pytest.approx(1e-3)
    assert "learning rate" in hint["text"] and "clip" in hint["text"]


def test_explosion_reads_the_logits_signal():
    logits = np.ones(80)
    logits[60:] = 500.0
    rec = Record(
        SCHEMA,
        None,
        explosion={"step": 60, "signal": "logits"},
        series=series(80, logit_max=logits),
    )
    assert only(rec, "explosion")["evidence"]["value"] == 500.0


def test_explosion_quotes_the_records_one_ratio():
    explosion = {"step": 60, "signal": "loss", "factor": 2e3, "value": 2e3, "reference": 1.0}
    rec = Record(SCHEMA, None, explosion=explosion, series=series(80, loss=exploding_loss()))
    hint = only(rec, "explosion")
    assert hint["evidence"]["factor"] == pytest.approx(2e3)  # the record's, not peak / median
    assert "2e+03x its reference level" in hint["text"]


@pytest.mark.parametrize("case", ["with_incident", "flat_series", "no_explosion", "no_series"])
def test_explosion_does_not_fire_without_support(case):
    loss = np.ones(80) if case == "flat_series" else exploding_loss()
    rec = Record(
        SCHEMA,
        incident(79, "loss") if case == "with_incident" else None,
        explosion=None if case == "no_explosion" else {"step": 60, "signal": "loss"},
        series=None if case == "no_series" else series(80, loss=loss),
    )
    assert "explosion" not in ids(rec)


def test_healthy_record_has_no_hints():
    assert ids(Record(SCHEMA, None, series=series(100), flight=None)) == []


def test_logits_rising_fires_on_a_noisy_steady_climb():
    # Like seed 001: |logits| climb from ~1 to ~60 over 250 steps with +-4 noise.
    n = 251
    climb = np.linspace(1.0, 60.0, n) + np.random.default_rng(1).uniform(-4, 4, n)
    rec = Record(SCHEMA, incident(n - 1, "loss", kind="inf"), series=series(n, logit_max=climb))
    hint = only(rec, "logits_rising")
    assert hint["evidence"]["steps"] == 200
    assert hint["evidence"]["last"] > 2 * hint["evidence"]["first"]
    assert "climbed steadily" in hint["text"]


def test_logits_trend_needs_a_climb_not_noise():
    n = 251
    noise = 20.0 + np.random.default_rng(2).uniform(-10, 10, n)
    rec = Record(SCHEMA, incident(n - 1, "loss", kind="inf"), series=series(n, logit_max=noise))
    assert "logits_rising" not in ids(rec)


# A hint never contradicts the recorded numbers ----------------------------------


def seed001_series(n: int = 361) -> Series:
    """Like the seed-001 demo: the rate decays to 0 at step 300, |logits| then
    climb from ~25 to ~500 while the gradients fade to exactly 0."""
    steps = np.arange(n)
    logits = np.where(steps < 300, 25.0 + 0.01 * steps, 25.0 * 1.05 ** (steps - 300))
    rate = np.where(steps < 300, 1e-3 * (1 - steps / 300), 0.0)
    norm = np.where(steps < 340, 0.05, 0.0)
    norm[-1] = np.nan  # the incident's gradients
    return series(n, logit_max=logits, lr=rate, grad_norm=norm)


def test_rising_outputs_at_a_rate_of_0_do_not_say_lower_the_rate_or_clip():
    rec = Record(SCHEMA, incident(360, "loss", kind="inf"), series=seed001_series())
    hint = only(rec, "logits_rising")
    text = hint["text"]
    assert "lower the learning rate or clip" not in text.lower()
    assert "Lower the learning rate" not in text and "lower the learning rate," not in text
    assert "learning rate was 0 over steps" in text
    assert "gradient norm 0 at step 359" in text


def test_rising_outputs_with_a_live_rate_keep_the_rate_advice():
    rec = Record(SCHEMA, incident(50, "loss"), series=series(51, logit_max=rising_logits()))
    assert "lower the learning rate" in only(rec, "logits_rising")["text"]


def test_an_explosion_at_a_rate_of_0_does_not_say_lower_the_rate():
    rec = Record(
        SCHEMA,
        None,
        explosion={"step": 60, "signal": "loss"},
        series=series(80, loss=exploding_loss(), lr=np.zeros(80)),
    )
    text = only(rec, "explosion")["text"]
    assert "Lower the learning rate" not in text and "clip gradients (" not in text
    assert "The learning rate was 0 over steps 60-79" in text
