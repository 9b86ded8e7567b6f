"""Remedy trials re-run the user's own run (issue 55, items 1 and 5).

The trials train the user's model, loss and optimizer objects from the
recorded state; the no-remedy re-run must reproduce the recorded losses
before any remedy is judged ("cannot verify" otherwise); the user's model and
optimizer hold exactly their trained state afterwards; a growth trial re-runs
the whole recorded span and is judged against the level the recorded run
reached, never against a reference of 0.
"""

from __future__ import annotations

import json

import keras
import nanwatch_testlib as lib
import numpy as np
import pytest
import tensorflow as tf

import tb_nanwatch
from tb_nanwatch.evidence import trials as evidence_trials
from tb_nanwatch.evidence.options import WatchOptions
from tb_nanwatch.evidence.trials import TRIALS_FILE
from tb_nanwatch.record.after_incident import fidelity, trials
from tb_nanwatch.record.after_incident.rewind_file import RewindPoint, load_rewind_point

BATCH = 32


def written(run_dir) -> dict:
    with open(run_dir / "repro" / TRIALS_FILE) as f:
        return json.load(f)


def by_remedy(body: dict) -> dict:
    return {t["remedy"]: t for t in body["trials"]}


def house_features(rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Raw square feet, year, lot size; the price standardised."""
    rng = np.random.RandomState(seed)
    x = np.stack(
        [rng.uniform(500, 4000, rows), rng.uniform(1900, 2020, rows), rng.uniform(1e3, 2e4, rows)],
        axis=1,
    ).astype("float32")
    y = 100 * x[:, :1] + 5 * x[:, 2:] + rng.uniform(1e5, 2e5, (rows, 1))
    return x, ((y - y.mean()) / y.std()).astype("float32")


def normalised_model(x: np.ndarray, dropout: float = 0.0) -> keras.Model:
    """An adapted Normalization first: the inputs reach the Dense layers at unit scale."""
    keras.utils.set_random_seed(0)
    norm = keras.layers.Normalization()
    norm.adapt(x)
    layers = [norm, keras.layers.Dense(16, activation="relu")]
    if dropout:
        layers.append(keras.layers.Dropout(dropout))
    layers += [keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
    return keras.Sequential([keras.Input((3,)), *layers])


def trains(model: keras.Model, x, y, epochs: int = 3) -> bool:
    history = model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    losses = history.history["loss"]
    return bool(np.isfinite(losses).all() and losses[-1] < losses[0])


# -- (a) an adapted Normalization at SGD lr 2.0 ----------------------------------------------


def fit_normalised_at_a_high_rate(run_dir) -> tuple[np.ndarray, np.ndarray]:
    """The house features through an adapted Normalization at SGD lr 2.0,
    watched into ``run_dir`` until its incident; returns the data (x, y)."""
    x, y = house_features(256)
    model = normalised_model(x)
    model.compile(optimizer=keras.optimizers.SGD(2.0), loss="mse")
    watch = tb_nanwatch.NanWatch(str(run_dir), trial_budget_s=lib.TRIAL_BUDGET_S)
    model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, callbacks=[watch], verbose=0)
    assert watch.incident is not None
    return x, y


def test_a_normalised_model_at_a_high_rate_is_fixed_by_a_lower_rate(tmp_path):
    x, y = fit_normalised_at_a_high_rate(tmp_path)
    body = written(tmp_path)
    # The re-run is the user's run: the adapted mean and variance are in it.
    assert body["fidelity"].startswith("the re-run reproduced the recorded losses of steps")
    assert body["baseline"]["outcome"] == "not_fixed"
    lower = by_remedy(body)["lower_lr"]
    assert lower["outcome"] == "fixed", lower
    # Literally: the same script at a tenth of the rate trains.
    factor = float(lower["setting"].removeprefix("lr x"))
    again = normalised_model(x)
    again.compile(optimizer=keras.optimizers.SGD(2.0 * factor), loss="mse")
    assert trains(again, x, y)


# -- (b) a Python-function loss and a custom schedule class ----------------------------------


def plain_mse(y_true, y_pred):  # not registered for serialization
    return tf.reduce_mean(tf.square(y_true - y_pred))


class JumpSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """0.01, then 50 from step 6 on (not registered: it cannot be deserialized)."""

    def __call__(self, step):
        return tf.where(step < 6, 0.01, 50.0)


def test_a_function_loss_and_a_custom_schedule_run_their_trials(tmp_path):
    rng = np.random.RandomState(3)
    x = rng.normal(size=(12 * 16, 4)).astype("float32")
    y = (x @ rng.normal(size=(4, 1))).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    schedule = JumpSchedule()
    optimizer = keras.optimizers.SGD(schedule)
    model.compile(optimizer=optimizer, loss=plain_mse)
    watch = tb_nanwatch.NanWatch(str(tmp_path), rewind_every=4, trial_budget_s=lib.TRIAL_BUDGET_S)
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, callbacks=[watch], verbose=0)
    assert watch.incident is not None or watch.session.journal.explosion_onset is not None
    body = written(tmp_path)
    found = by_remedy(body)
    assert found, body
    assert not any("cannot be copied" in t["why"] for t in body["trials"]), body
    assert body["fidelity"].startswith("the re-run reproduced"), body["fidelity"]
    assert any(t["outcome"] == "fixed" for t in body["trials"]), body
    # The user's optimizer keeps its own schedule object.
    assert model.optimizer is optimizer and optimizer._learning_rate is schedule


# -- (c) a re-run that does not reproduce the recorded run -------------------------------------


def regression_case():
    """A linear model at SGD 1.5 on unit-scale data: it explodes within its 8 batches."""
    rng = np.random.RandomState(6)
    x = rng.normal(size=(8 * 8, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1))).astype("float32")
    batches = [[x[i * 8 : (i + 1) * 8], y[i * 8 : (i + 1) * 8]] for i in range(8)]
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(1.5)
    model.compile(optimizer=optimizer, loss="mse")
    optimizer.build(model.trainable_variables)
    point = RewindPoint(
        step=10,
        weights={v.path: v.numpy() for v in model.variables},
        optimizer={v.path: v.numpy() for v in optimizer.variables},
        batches=batches,
        structure=[0, 0],
        learning_rates=[1.5] * 8,
    )
    # The recorded run: the same steps by Keras' own train_on_batch on a twin.
    keras.utils.set_random_seed(0)
    twin = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    twin.compile(optimizer=keras.optimizers.SGD(1.5), loss="mse")
    twin.set_weights(model.get_weights())
    recorded = {10 + i: float(twin.train_on_batch(*b)) for i, b in enumerate(batches)}
    cause = {"id": "growth_overflow", "remedy_ids": ["lower_lr", "clip_gradients"]}
    return model, point, recorded, cause


def run(model, cause, data):
    return trials.run_trials(
        model, cause, data, None, WatchOptions(trial_budget_s=lib.TRIAL_BUDGET_S), lambda line: None
    )


def test_the_recorded_run_reproduced_lets_the_remedies_be_judged():
    model, point, recorded, cause = regression_case()
    found = run(model, cause, trials.TrialData(rewind=point, recorded_losses=recorded))
    assert found.fidelity.startswith("the re-run reproduced the recorded losses of steps 10-12")
    assert found.baseline.outcome == "not_fixed"
    assert {t.outcome for t in found} <= {"fixed", "not_fixed"}


def test_the_first_step_is_held_to_1e_3_and_the_next_ones_to_1e_2():
    model, point, recorded, cause = regression_case()
    recorded[11] *= 1.005  # within 1e-2 at the second step: rounding an update magnified
    found = run(model, cause, trials.TrialData(rewind=point, recorded_losses=recorded))
    assert found.fidelity.startswith("the re-run reproduced the recorded losses of steps 10-12")
    recorded[11] /= 1.005
    recorded[10] *= 1.005  # not within 1e-3 at the first step
    found = run(model, cause, trials.TrialData(rewind=point, recorded_losses=recorded))
    assert "diverged from the recorded run at step 10" in found[0].why


def test_a_perturbed_record_makes_every_remedy_cannot_verify():
    model, point, recorded, cause = regression_case()
    recorded[11] *= 1.05
    found = run(model, cause, trials.TrialData(rewind=point, recorded_losses=recorded))
    assert [t.outcome for t in found] == ["cannot_verify", "cannot_verify"]
    for trial in found:
        assert trial.why.startswith(
            "cannot verify: the re-run diverged from the recorded run at step 11 (recorded "
        )
        text = evidence_trials.trial_text(trial)
        assert text.startswith("Cannot verify: the re-run diverged") and "did not help" not in text
    assert found.baseline.outcome == "cannot_verify"


def test_a_later_step_is_judged_against_what_rounding_alone_moves_the_re_run(monkeypatch):
    model, point, recorded, cause = regression_case()
    recorded[11] *= 1.05
    found = run(model, cause, trials.TrialData(rewind=point, recorded_losses=recorded))
    # The first step matched: the nudged probe ran, and rounding moves this run little.
    assert "diverged from the recorded run at step 11" in found[0].why
    assert "rounding alone moves it" in found[0].why
    # A run that a nudge at the start moves by more (as an adaptive optimizer's
    # first updates do): the same 5% is within what rounding explains.
    monkeypatch.setattr(fidelity, "ROUNDING_NUDGE", 0.3)
    found = run(model, cause, trials.TrialData(rewind=point, recorded_losses=recorded))
    assert found.fidelity.startswith("the re-run reproduced the recorded losses of steps 10-12")
    assert "the difference rounding alone makes (a re-run nudged by 0.3:" in found.fidelity
    # Never at the first step: there the state, batch and random state are the recorded ones.
    recorded[11] /= 1.05
    recorded[10] *= 1.05
    found = run(model, cause, trials.TrialData(rewind=point, recorded_losses=recorded))
    assert "diverged from the recorded run at step 10" in found[0].why


def test_a_perturbed_start_makes_every_remedy_cannot_verify():
    model, point, recorded, cause = regression_case()
    kernel = next(k for k in point.weights if k.endswith("kernel"))
    point.weights[kernel] = point.weights[kernel] + 0.1
    found = run(model, cause, trials.TrialData(rewind=point, recorded_losses=recorded))
    assert {t.outcome for t in found} == {"cannot_verify"}
    assert "diverged from the recorded run at step 10" in found[0].why


def test_unknown_recorded_losses_cannot_verify():
    model, point, recorded, cause = regression_case()
    found = run(model, cause, trials.TrialData(rewind=point, recorded_losses={}))
    assert {t.outcome for t in found} == {"cannot_verify"}
    assert "the recorded losses of steps 10-12 are not known" in found[0].why


def test_cannot_verify_ranks_with_not_tried_and_is_read_back():
    trial = evidence_trials.Trial("lower_lr", "cannot_verify", why="cannot verify: x")
    fixed = evidence_trials.Trial("clip_gradients", "fixed", learning=True)
    failed = evidence_trials.Trial("lr_warmup", "not_fixed")
    order = evidence_trials.rank(
        ["lr_warmup", "lower_lr", "clip_gradients"], [trial, fixed, failed]
    )
    assert order == ["clip_gradients", "lower_lr", "lr_warmup"]
    assert evidence_trials.Trial.from_json(trial.to_json()) == trial
    assert evidence_trials.OUTCOME_WORDS["cannot_verify"] == "Cannot verify"


# -- (d) the user's model and optimizer hold exactly their trained state ------------------------


def state_of(model, optimizer) -> list[np.ndarray]:
    variables = [*model.variables, *model.metrics_variables, *optimizer.variables]
    return [np.array(v.numpy(), copy=True) for v in variables]


def test_after_the_trials_the_model_and_optimizer_are_bitwise_as_trained():
    x, y = house_features(128, seed=1)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Normalization(),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.Dropout(0.2),
            keras.layers.Dense(1),
        ]
    )
    model.layers[0].adapt(x)
    optimizer = keras.optimizers.Adam(0.01)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    batches = [[x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH]] for i in range(4)]
    point = RewindPoint(
        step=0,
        weights={v.path: v.numpy() * 1.5 for v in model.variables},  # another state
        optimizer={v.path: v.numpy() for v in optimizer.variables},
        batches=batches,
        structure=[0, 0],
        learning_rates=[0.01] * 4,
    )
    before = state_of(model, optimizer)
    config, rate, count = optimizer.get_config(), optimizer._learning_rate, len(optimizer.variables)
    cause = {
        "id": "growth_overflow",
        "remedy_ids": ["lower_lr", "clip_gradients", "raise_epsilon", "float32_policy"],
    }
    found = run(model, cause, trials.TrialData(rewind=point))
    assert found.baseline is not None and len(found) == 4
    after = state_of(model, optimizer)
    assert len(after) == len(before)
    for was, now in zip(before, after, strict=True):
        assert was.dtype == now.dtype and np.array_equal(was, now, equal_nan=True)
        assert was.tobytes() == now.tobytes()
    assert optimizer.get_config() == config
    assert optimizer._learning_rate is rate and len(optimizer.variables) == count
    assert optimizer.clipnorm is None and optimizer.epsilon == config["epsilon"]
    # A change that needs a copy says so.
    float32 = {t.remedy: t for t in found}["float32_policy"]
    assert "on a copy of the model" in float32.setting or float32.outcome == "not_tried"


# -- (e) dropout: the seed state at the rewind point is restored ----------------------------------


def test_a_dropout_models_re_run_reproduces_the_recorded_losses(tmp_path):
    x, y = house_features(256, seed=2)
    model = normalised_model(x, dropout=0.3)
    model.compile(optimizer=keras.optimizers.SGD(2.0), loss="mse")
    watch = tb_nanwatch.NanWatch(str(tmp_path), rewind_every=3, trial_budget_s=lib.TRIAL_BUDGET_S)
    model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, callbacks=[watch], verbose=0)
    body = written(tmp_path)
    assert body["fidelity"].startswith("the re-run reproduced the recorded losses"), body
    assert {t["outcome"] for t in body["trials"]} != {"cannot_verify"}
    # The rewind point holds the dropout layer's seed state.
    saved = load_rewind_point(str(tmp_path))
    assert any("seed_generator_state" in name for name in saved.weights)


# -- (f) a loss that starts at exactly 0 and climbs to Inf ------------------------------------------


def test_a_loss_from_exactly_zero_to_inf_fails_its_baseline_and_lower_lr_is_judged(tmp_path):
    rng = np.random.RandomState(0)
    rows = 16
    x = rng.normal(size=(20 * rows, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1))).astype("float32")
    y[:rows] = 0.0  # the first batch: zero weights predict it exactly, loss 0
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1, kernel_initializer="zeros")])
    model.compile(optimizer=keras.optimizers.SGD(1.5), loss="mse")
    watch = tb_nanwatch.NanWatch(str(tmp_path), trial_budget_s=lib.TRIAL_BUDGET_S)
    model.fit(x, y, batch_size=rows, epochs=20, shuffle=False, callbacks=[watch], verbose=0)
    assert watch.incident is not None
    body = written(tmp_path)
    assert body["baseline"]["loss_first"] == 0.0
    assert body["baseline"]["outcome"] == "not_fixed", body["baseline"]
    # The whole recorded span, from the rewind point through the incident.
    first, last = 0, watch.incident["step"]
    assert f"(steps {first}-{last})" in body["plan"], body["plan"]
    lower = by_remedy(body)["lower_lr"]
    assert lower["outcome"] == "fixed", lower
    assert "did not fail" not in lower["why"]


def test_the_explosion_line_never_has_a_reference_of_zero():
    judge = trials._Judge("loss", 1e3)
    assert judge.above_line([0.0, 1e-3, 2e-3, 0.5, 2.0])  # 2.0 > 1e3 x 1e-3
    assert not judge.above_line([0.0, 1e-3, 2e-3, 0.5])
    floor = trials._Judge("loss", 1e3, floor=1e-2)
    assert floor.above_line([0.0, 0.0, 0.0, 0.0, 0.0, 20.0])  # from the recorded run's floor
    level = trials._Judge("loss", 1e3, floor=1e-2, level=1e4)
    assert level.at_level([1.0, 6e3]) and not level.at_level([1.0, 4e3])


# -- on_nonfinite="rewind": a remedy that cannot be verified is not "shown not to work" ----------


def test_rewind_mode_names_a_cannot_verify_remedy_as_such(tmp_path, monkeypatch):
    from test_rewind_mode import _fit

    monkeypatch.setattr(fidelity, "same_loss", lambda *args: False)  # never reproduced
    _, watch, _ = _fit(tmp_path / "run", on_nonfinite="rewind")
    summary = watch.journal.summary()
    assert summary["recoveries"] == []  # nothing verified: no remedy is set
    why = summary["skip_fallback"]["why"]
    assert "Cannot verify: the re-run diverged from the recorded run at step 0" in why
    assert "no remedy shown to work" not in why
    body = written(tmp_path / "run")
    assert {t["outcome"] for t in body["trials"]} == {"cannot_verify"}


# -- output_activation: the trial's loss sees the activation of the outputs -------------------------


def test_a_variants_output_activation_is_what_the_loss_sees():
    from tb_nanwatch.record.after_incident.trial_replica import (
        Replica,
        Start,
        TrainedState,
        Variant,
    )

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])  # raw logits
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="categorical_crossentropy")
    x = np.random.RandomState(0).normal(size=(8, 4)).astype("float32")
    y = np.eye(3, dtype="float32")[np.arange(8) % 3]
    logits = model.predict(x, verbose=0)
    expected = float(keras.losses.CategoricalCrossentropy(from_logits=True)(y, logits))
    start = Start({v.path: v.numpy() for v in model.variables}, True, {})
    trained = TrainedState(model, model.optimizer)
    replica = Replica(model, None, start, Variant(output_activation="softmax"), model.optimizer)
    try:
        loss = replica.run([x, y]).loss
    finally:
        replica.close()
        trained.restore()
    assert np.isclose(loss, expected, rtol=1e-5)


@pytest.mark.parametrize("activation", ["sigmoid", "softmax"])
def test_a_trial_reads_the_logits_of_a_probability_output_as_the_recorder_does(activation):
    from tb_nanwatch.record.after_incident.trial_replica import (
        Replica,
        Start,
        TrainedState,
        Variant,
    )

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation=activation)])
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="binary_crossentropy")
    kernel = model.layers[0].kernel
    kernel.assign(kernel.numpy() * 100.0)  # logits far beyond 1: probabilities never are
    x = np.random.RandomState(0).normal(size=(8, 4)).astype("float32")
    y = np.ones((8, 3), "float32")
    logits = x @ kernel.numpy() + model.layers[0].bias.numpy()
    start = Start({v.path: v.numpy() for v in model.variables}, True, {})
    trained = TrainedState(model, model.optimizer)
    replica = Replica(model, None, start, Variant(), model.optimizer)
    try:
        seen = replica.run([x, y]).logits
    finally:
        replica.close()
        trained.restore()
    assert np.isclose(seen, np.abs(logits).max(), rtol=1e-5) and seen > 1.0


# -- a bundle holds no dropout seed state: the trials start from the rewind point instead ------------


def test_an_update_incident_under_dropout_is_verified_from_the_rewind_point(tmp_path):
    from scenarios import dead_relu_head

    keras.utils.set_random_seed(0)
    inp = keras.Input((3,))
    live = keras.layers.Dense(1, name="live")(keras.layers.Dropout(0.5)(inp))
    model = keras.Model(inp, keras.layers.Add()([live, dead_relu_head(inp)]))
    model.compile(optimizer=keras.optimizers.RMSprop(0.01, epsilon=0.0), loss="mse")
    x = np.random.RandomState(4).uniform(0.5, 1.5, (4 * 8, 3)).astype("float32")
    y = np.ones((len(x), 1), "float32")
    watch = tb_nanwatch.NanWatch(
        str(tmp_path), pre_step_weights="every_step", trial_budget_s=lib.TRIAL_BUDGET_S
    )
    model.fit(x, y, batch_size=8, shuffle=False, callbacks=[watch], verbose=0)
    assert watch.incident["phase"] == "update"
    assert tb_nanwatch.load_bundle(str(tmp_path)).weights  # a bundle to start from
    body = written(tmp_path)
    assert body["plan"].startswith("from the rewind point"), body["plan"]
    assert body["fidelity"].startswith("the re-run reproduced"), body["fidelity"]
    assert by_remedy(body)["raise_epsilon"]["outcome"] == "fixed"
