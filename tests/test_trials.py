"""Remedy trials: each scenario is built so that its cause and the remedy that
works are known, and each trial's outcome is checked against a re-run with the
remedy applied by hand (a fresh model, plain ``train_on_batch``).

A re-run by hand "works" as a trial is ``fixed``: the loss and every weight
stay finite, and the loss stays under 1e3 x its lowest value over the first 5
steps (the explosion line).
"""

from __future__ import annotations

import json
import os

import keras
import nanwatch_testlib as lib
import numpy as np
import pytest
import tensorflow as tf
from scenarios import dead_relu_head

import tb_nanwatch
from tb_nanwatch.evidence.options import WatchOptions
from tb_nanwatch.evidence.trials import TRIALS_FILE
from tb_nanwatch.record.after_incident import trial_episodes, trials, trials_file
from tb_nanwatch.record.after_incident.bundle import ReproBundle
from tb_nanwatch.record.after_incident.rewind_file import RewindPoint

LINE = 1e3  # WatchOptions' explosion_factor
BATCH = 8


# -- the re-run by hand ----------------------------------------------------------------


def by_hand(model, weights, batches, steps, optimizer, prepare=None, rate=None):
    """(works, losses): ``model`` set to ``weights`` and trained with
    ``optimizer`` on ``batches`` (cycled) for ``steps`` steps; ``prepare`` maps
    a batch, ``rate(step)`` sets each step's learning rate."""
    model.compile(optimizer=optimizer, loss="mse")
    model.set_weights(weights)
    losses = []
    for step in range(steps):
        x, y = batches[step % len(batches)]
        if prepare is not None:
            x, y = prepare(x, y)
        if rate is not None:
            model.optimizer.learning_rate.assign(rate(step))
        losses.append(float(model.train_on_batch(x, y)))
        finite = np.isfinite(losses[-1]) and all(np.isfinite(w).all() for w in model.get_weights())
        if not finite or losses[-1] > LINE * min(losses[:5]):
            return False, losses
    return True, losses


def learning(losses, span):
    """The loss of the last pass over the batches below 95% of the first's."""
    return np.mean(losses[-span:]) < 0.95 * np.mean(losses[:span])


def split(x, y, count):
    return [[x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH]] for i in range(count)]


def rewind_point(model, optimizer, batches, rates):
    """A rewind point before step 0: the model's weights, the optimizer's state."""
    optimizer.build(model.trainable_variables)
    return RewindPoint(
        step=0,
        weights={v.path: v.numpy() for v in model.weights},
        optimizer={v.path: v.numpy() for v in optimizer.variables},
        batches=[list(b) for b in batches],
        structure=[0, 0],
        learning_rates=list(rates),
    )


def exact_bundle(model, step, x, y) -> ReproBundle:
    """An exact bundle of ``step``: the batch ``[x, y]`` and the model's trainable weights now."""
    weights = {v.path: v.numpy() for v in model.trainable_weights}
    return ReproBundle(step, [x, y], weights, {"exact": True})


def run(model, cause, data, loss_fn=None, **options):
    options.setdefault("trial_budget_s", lib.TRIAL_BUDGET_S)
    lines = []
    found = trials.run_trials(model, cause, data, loss_fn, WatchOptions(**options), lines.append)
    return {t.remedy: t for t in found}, found, lines


def mlp(features, widths, seed=0):
    keras.utils.set_random_seed(seed)
    layers = [keras.layers.Dense(w, activation="relu") for w in widths]
    return keras.Sequential([keras.Input((features,)), *layers, keras.layers.Dense(1)])


# -- raw house prices: the data's scale, not the rate -----------------------------------


def house_prices():
    """Raw square feet, year and lot size; prices 2e5-7e5; SGD 1e-4: Inf at step 1."""
    rng = np.random.RandomState(0)
    rows = 4 * BATCH
    x = np.stack(
        [rng.uniform(500, 4000, rows), rng.uniform(1900, 2020, rows), rng.uniform(1e3, 2e4, rows)],
        axis=1,
    ).astype("float32")
    y = (100 * x[:, :1] + 5 * x[:, 2:] + rng.uniform(1e5, 2e5, (rows, 1))).astype("float32")
    return split(x, y, 4)


def standardise(batches, inputs=True, targets=True):
    xs = np.concatenate([b[0] for b in batches])
    ys = np.concatenate([b[1] for b in batches])

    def prepare(x, y):
        x = (x - xs.mean(0)) / xs.std(0) if inputs else x
        y = (y - ys.mean(0)) / ys.std(0) if targets else y
        return x.astype("float32"), y.astype("float32")

    return prepare


def test_raw_house_prices_need_scaled_data_not_a_lower_rate():
    batches = house_prices()
    model = mlp(3, [16, 16])
    model.compile(optimizer=keras.optimizers.SGD(1e-4), loss="mse")
    start = model.get_weights()
    point = rewind_point(model, keras.optimizers.SGD(1e-4), batches, [1e-4] * 4)
    cause = {
        "id": "unscaled_data",
        "remedy_ids": ["normalize_inputs", "scale_targets", "lower_lr", "clip_gradients"],
        "evidence": {},
    }
    found, listed, _ = run(model, cause, trials.TrialData(rewind=point))
    steps = trial_episodes.MIN_REWIND_STEPS
    assert listed.baseline.outcome == "not_fixed"
    assert not by_hand(mlp(3, [16, 16]), start, batches, steps, keras.optimizers.SGD(1e-4))[0]
    # Inputs and targets both raw: neither alone is enough (each keeps its
    # own outcome), both together train: the combination is its own remedy,
    # tried once.
    for remedy in ("normalize_inputs", "scale_targets"):
        assert found[remedy].outcome == "not_fixed" and not found[remedy].together
    both_trial = found["normalize_inputs+scale_targets"]
    assert both_trial.outcome == "fixed"
    assert both_trial.together == ("normalize_inputs", "scale_targets")
    assert "inputs normalised" in both_trial.setting
    assert "targets standardised" in both_trial.setting
    assert [t.remedy for t in listed].count("normalize_inputs+scale_targets") == 1
    alone = [standardise(batches, targets=False), standardise(batches, inputs=False)]
    for prepare in alone:
        assert not by_hand(
            mlp(3, [16, 16]), start, batches, steps, keras.optimizers.SGD(1e-4), prepare
        )[0]
    both = standardise(batches)
    assert by_hand(mlp(3, [16, 16]), start, batches, steps, keras.optimizers.SGD(1e-4), both)[0]
    # A lower rate does not help at any factor.
    assert found["lower_lr"].outcome == "not_fixed"
    assert found["lower_lr"].setting == "lr x0.1, lr x0.01, lr x0.001"
    for factor in (10, 100, 1000):
        optimizer = keras.optimizers.SGD(1e-4 / factor)
        assert not by_hand(mlp(3, [16, 16]), start, batches, steps, optimizer)[0]


# -- targets near 100, a high rate: clipping learns, a much lower rate only survives ------


def test_targets_near_100_clipping_works_and_ranks_before_a_rate_that_stops_learning():
    rng = np.random.RandomState(1)
    x = rng.normal(size=(4 * BATCH, 8)).astype("float32")
    batches = split(x, (100 + rng.normal(size=(4 * BATCH, 1))).astype("float32"), 4)
    model = mlp(8, [32] * 4)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    start = model.get_weights()
    point = rewind_point(model, keras.optimizers.SGD(0.05), batches, [0.05] * 4)
    cause = {"id": "growth_overflow", "remedy_ids": ["lower_lr", "clip_gradients"], "evidence": {}}
    found, listed, _ = run(model, cause, trials.TrialData(rewind=point))
    steps = trial_episodes.MIN_REWIND_STEPS
    assert not by_hand(mlp(8, [32] * 4), start, batches, steps, keras.optimizers.SGD(0.05))[0]

    clipped = found["clip_gradients"]
    works, losses = by_hand(
        mlp(8, [32] * 4), start, batches, steps, keras.optimizers.SGD(0.05, clipnorm=1.0)
    )
    assert (clipped.outcome, clipped.setting, clipped.steps) == ("fixed", "clipnorm=1.0", steps)
    assert works and clipped.learning is True and learning(losses, 4)

    lower = found["lower_lr"]
    assert (lower.outcome, lower.setting, lower.learning) == ("fixed", "lr x0.01", False)
    assert not by_hand(mlp(8, [32] * 4), start, batches, steps, keras.optimizers.SGD(0.005))[0]
    works, losses = by_hand(mlp(8, [32] * 4), start, batches, steps, keras.optimizers.SGD(5e-4))
    assert works and not learning(losses, 4)
    # The fix that keeps learning ranks first.
    assert [line.split(":")[0] for line in trials.tried_lines(listed)] == [
        "clip_gradients",
        "lower_lr",
    ]


# -- RMSprop with epsilon 0: 0/0 in the update of a variable with no gradient ----------


def dead_head_model(optimizer):
    """A ReLU head that never fires: its gradients are exactly 0."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((3,))
    live = keras.layers.Dense(1, name="live")(inp)
    dead = dead_relu_head(inp)
    model = keras.Model(inp, keras.layers.Add()([live, dead]))
    model.compile(optimizer=optimizer, loss="mse")
    return model


def test_trials_of_an_xla_run_run_under_xla_and_say_so(tmp_path):
    x = np.random.RandomState(4).uniform(0.5, 1.5, (4 * BATCH, 3)).astype("float32")
    y = np.ones((len(x), 1), "float32")
    model = dead_head_model(keras.optimizers.RMSprop(0.01, epsilon=0.0))
    model.compile(optimizer=model.optimizer, loss="mse", jit_compile=True)
    watch = tb_nanwatch.NanWatch(str(tmp_path), trial_budget_s=lib.TRIAL_BUDGET_S)
    model.fit(x, y, batch_size=BATCH, shuffle=False, callbacks=[watch], verbose=0)
    # The run record proves the user's step was compiled by XLA.
    assert watch.journal.summary()["jit_compile"] is True
    assert watch._recorder.built_for_xla is True
    assert watch.incident["phase"] == "update"
    with open(tmp_path / "repro" / TRIALS_FILE) as f:
        written = json.load(f)
    # Every re-run (the baseline's and each remedy's) ran under XLA too.
    assert written["compiled"] == "xla", written.get("compiled")
    found = {t["remedy"]: t for t in written["trials"]}
    assert found["raise_epsilon"]["outcome"] == "fixed", found["raise_epsilon"]
    assert written["baseline"]["outcome"] == "not_fixed"


def test_rmsprop_epsilon_zero_is_fixed_by_a_larger_epsilon(tmp_path, capfd):
    x = np.random.RandomState(4).uniform(0.5, 1.5, (4 * BATCH, 3)).astype("float32")
    y = np.ones((len(x), 1), "float32")
    model = dead_head_model(keras.optimizers.RMSprop(0.01, epsilon=0.0))
    start = model.get_weights()
    watch = tb_nanwatch.NanWatch(str(tmp_path), trial_budget_s=lib.TRIAL_BUDGET_S)
    model.fit(x, y, batch_size=BATCH, shuffle=False, callbacks=[watch], verbose=0)
    assert watch.incident["phase"] == "update"
    with open(tmp_path / "repro" / TRIALS_FILE) as f:
        written = json.load(f)
    assert written["cause"] == "optimizer_update"
    found = {t["remedy"]: t for t in written["trials"]}
    assert found["raise_epsilon"]["outcome"] == "fixed"
    assert found["raise_epsilon"]["setting"] == "epsilon=0.0001"
    # The trial started before the step (the incident is at step 0): by hand the same.
    assert watch.incident["step"] == 0
    steps = found["raise_epsilon"]["steps"]
    batches = split(x, y, 1)  # the rewind point's: from step 0 through the incident
    fixed = keras.optimizers.RMSprop(0.01, epsilon=1e-4)
    assert by_hand(dead_head_model(fixed), start, batches, steps, fixed)[0]
    broken = keras.optimizers.RMSprop(0.01, epsilon=0.0)
    assert not by_hand(dead_head_model(broken), start, batches, steps, broken)[0]
    assert found["lower_lr"]["outcome"] == "not_fixed"  # 0/0 at any rate
    err = capfd.readouterr().err
    assert "NanWatch remedies, tried on a re-run of the recorded steps:" in err
    assert "raise_epsilon: Tried: epsilon=0.0001 kept" in err


# -- a schedule typo: the rate jumps a millionfold at step 5 -------------------------------


@keras.saving.register_keras_serializable("test_trials")
class TypoSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """1e-3, then 1e3 from step 5 on (meant: 1e-3 throughout)."""

    def __call__(self, step):
        return tf.where(step < 5, 1e-3, 1e3)

    def get_config(self):
        return {}


def test_a_schedule_typo_is_fixed_by_holding_the_rate_before_the_jump():
    x = np.random.RandomState(2).normal(size=(BATCH, 4)).astype("float32")
    y = np.random.RandomState(3).normal(size=(BATCH, 1)).astype("float32")
    optimizer = keras.optimizers.SGD(TypoSchedule())
    model = mlp(4, [8])
    model.compile(optimizer=optimizer, loss="mse")
    start = model.get_weights()
    saved = exact_bundle(model, 5, x, y)
    cause = {
        "id": "optimizer_update",
        "remedy_ids": ["fix_schedule", "lower_lr", "clip_gradients"],
        "evidence": {"lr": 1e3, "lr_before": 1e-3, "lr_ratio": 1e6},
    }
    found, listed, _ = run(model, cause, trials.TrialData(bundle=saved, optimizer=optimizer))
    steps = trial_episodes.BUNDLE_STEPS
    assert listed.baseline.outcome == "not_fixed"
    assert not by_hand(mlp(4, [8]), start, [[x, y]], steps, keras.optimizers.SGD(1e3))[0]
    held = found["fix_schedule"]
    assert (held.outcome, held.setting, held.steps) == ("fixed", "lr held at 0.001", steps)
    assert by_hand(mlp(4, [8]), start, [[x, y]], steps, keras.optimizers.SGD(1e-3))[0]
    # The search: x0.1 and x0.01 still fail, x0.001 works.
    assert (found["lower_lr"].outcome, found["lower_lr"].setting) == ("fixed", "lr x0.001")
    assert not by_hand(mlp(4, [8]), start, [[x, y]], steps, keras.optimizers.SGD(10.0))[0]
    assert by_hand(mlp(4, [8]), start, [[x, y]], steps, keras.optimizers.SGD(1.0))[0]


# -- a NaN row in one batch --------------------------------------------------------------


def test_a_nan_row_is_fixed_by_dropping_it_and_the_session_writes_the_trials(tmp_path, capfd):
    x = np.random.RandomState(0).normal(size=(6 * BATCH, 3)).astype("float32")
    x[3 * BATCH + 2, 1] = np.nan
    y = np.ones((len(x), 1), "float32")
    model = mlp(3, [4])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    watch = tb_nanwatch.NanWatch(str(tmp_path), trial_budget_s=lib.TRIAL_BUDGET_S)
    model.fit(x, y, batch_size=BATCH, shuffle=False, callbacks=[watch], verbose=0)
    assert watch.incident["step"] == 3 and watch.incident["phase"] == "input"
    with open(tmp_path / "repro" / TRIALS_FILE) as f:
        written = json.load(f)
    assert (written["version"], written["step"], written["cause"]) == (1, 3, "input_data")
    (dropped,) = [t for t in written["trials"] if t["remedy"] == "drop_bad_rows"]
    assert dropped["outcome"] == "fixed" and dropped["steps"] == trial_episodes.BUNDLE_STEPS
    saved = tb_nanwatch.load_bundle(str(tmp_path))
    weights = [saved.weights[v.path] for v in model.trainable_weights]
    clean = [[b[np.isfinite(saved.batch[0]).all(axis=1)] for b in saved.batch]]
    sgd = keras.optimizers.SGD
    assert by_hand(mlp(3, [4]), weights, clean, trial_episodes.BUNDLE_STEPS, sgd(0.01))[0]
    assert not by_hand(mlp(3, [4]), weights, [saved.batch], trial_episodes.BUNDLE_STEPS, sgd(0.01))[
        0
    ]
    err = capfd.readouterr().err
    assert "NanWatch trial 1/1: drop_bad_rows: Tried: rows holding NaN/Inf dropped" in err


def test_no_trials_when_they_are_off(tmp_path):
    x = np.ones((2 * BATCH, 3), "float32")
    x[BATCH] = np.nan
    model = mlp(3, [4])
    model.compile(optimizer="sgd", loss="mse")
    watch = tb_nanwatch.NanWatch(str(tmp_path), remedy_trials=False)
    model.fit(x, x[:, :1], batch_size=BATCH, shuffle=False, callbacks=[watch], verbose=0)
    assert watch.incident is not None
    assert not os.path.exists(tmp_path / "repro" / TRIALS_FILE)


# -- float16 overflow ----------------------------------------------------------------------


def fp16_model():
    """Inputs near 300 times a kernel of 100, three features: 9e4 > float16's 65504."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((3,))
    h = keras.layers.Dense(8, kernel_initializer=keras.initializers.Constant(100.0))(inp)
    return keras.Model(inp, keras.layers.Dense(1, dtype="float32")(h))


def test_a_float16_overflow_is_fixed_by_the_float32_policy(mixed_precision):
    x = np.random.RandomState(5).uniform(290, 310, (BATCH, 3)).astype("float32")
    y = np.ones((BATCH, 1), "float32")
    model = fp16_model()
    model.compile(optimizer=keras.optimizers.SGD(1e-12), loss="mse")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    start = model.get_weights()
    saved = exact_bundle(model, 0, x, y)
    cause = {"id": "fp16_overflow", "remedy_ids": ["float32_policy"], "evidence": {}}
    found, listed, _ = run(model, cause, trials.TrialData(bundle=saved))
    steps = trial_episodes.BUNDLE_STEPS
    assert listed.baseline.outcome == "not_fixed"
    assert not by_hand(fp16_model(), start, [[x, y]], steps, keras.optimizers.SGD(1e-12))[0]
    assert found["float32_policy"].outcome == "fixed"
    assert found["float32_policy"].steps == steps
    keras.mixed_precision.set_global_policy("float32")
    assert by_hand(fp16_model(), start, [[x, y]], steps, keras.optimizers.SGD(1e-12))[0]


# -- an explosion after a jump of the rate, from a rewind point ------------------------------


def test_an_explosion_after_a_rate_jump_is_fixed_by_the_rate_before_it():
    rng = np.random.RandomState(6)
    x = rng.normal(size=(8 * BATCH, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1)) + 0.1 * rng.normal(size=(8 * BATCH, 1))).astype("float32")
    batches = split(x, y, 8)
    rates = [0.01] * 5 + [1.5] * 3  # the jump at step 5

    def linear():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])

    model = linear()
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    start = model.get_weights()
    point = rewind_point(model, keras.optimizers.SGD(0.01), batches, rates)
    cause = {
        "id": "explosion",
        "remedy_ids": ["fix_schedule", "lower_lr"],
        "evidence": {"signal": "loss", "onset_step": 5},
    }
    found, listed, _ = run(model, cause, trials.TrialData(rewind=point))
    steps = trial_episodes.MIN_REWIND_STEPS
    assert (listed.baseline.outcome, listed.baseline.why.split(" at ")[0]) == (
        "not_fixed",
        "the loss crossed the explosion line",
    )
    recorded = lambda step: rates[min(step, len(rates) - 1)]  # noqa: E731 - after the span: the last
    sgd = keras.optimizers.SGD
    assert not by_hand(linear(), start, batches, steps, sgd(0.01), rate=recorded)[0]
    held = found["fix_schedule"]
    assert (held.outcome, held.setting, held.learning) == ("fixed", "lr held at 0.01", True)
    works, losses = by_hand(linear(), start, batches, steps, sgd(0.01))
    assert works and learning(losses, 8)
    lower = found["lower_lr"]
    assert (lower.outcome, lower.setting) == ("fixed", "lr x0.1")
    assert by_hand(linear(), start, batches, steps, sgd(0.01), rate=lambda s: recorded(s) / 10)[0]


# -- the budget, failures, the file ------------------------------------------------------------


def nan_row_case():
    x = np.random.RandomState(0).normal(size=(BATCH, 3)).astype("float32")
    x[2, 1] = np.nan
    model = mlp(3, [4])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    saved = exact_bundle(model, 3, x, np.ones((BATCH, 1), "float32"))
    cause = {"id": "input_data", "remedy_ids": ["drop_bad_rows", "fix_code"], "evidence": {}}
    return model, saved, cause


def test_over_the_budget_a_trial_is_not_tried():
    model, saved, cause = nan_row_case()
    cause["remedy_ids"] = ["drop_bad_rows", "normalize_inputs"]
    found, _, lines = run(model, cause, trials.TrialData(bundle=saved), trial_budget_s=1e-9)
    assert [t.outcome for t in found.values()] == ["not_tried", "not_tried"]
    assert "over the time budget (trial_budget_s=1e-09)" in found["drop_bad_rows"].why
    assert len(lines) == 3  # the run as recorded, then one line per remedy


def test_a_failing_trial_is_a_warning_and_not_tried():
    model, saved, cause = nan_row_case()

    def broken_loss(y, y_pred):
        raise RuntimeError("a loss that breaks")

    with pytest.warns(UserWarning, match="a loss that breaks"):
        found, _, _ = run(model, cause, trials.TrialData(bundle=saved), loss_fn=broken_loss)
    assert list(found) == ["drop_bad_rows"]  # fix_code is advice: no trial
    assert found["drop_bad_rows"].outcome == "not_tried"
    assert "a loss that breaks" in found["drop_bad_rows"].why


def test_without_a_bundle_or_rewind_point_nothing_is_tried_and_says_why():
    model, _, cause = nan_row_case()
    found, _, _ = run(model, cause, trials.TrialData(rewind_missing="rewind points are off"))
    assert (
        found["drop_bad_rows"].why
        == "no reproduction bundle; no rewind point (rewind points are off)"
    )
    growth = {"id": "growth_overflow", "remedy_ids": ["lower_lr"], "evidence": {}}
    found, _, _ = run(model, growth, trials.TrialData(bundle=nan_row_case()[1]))
    assert found["lower_lr"].why == "no rewind point (none was saved)"


def test_the_trials_file_is_written_only_where_it_is_ours(tmp_path):
    model, saved, cause = nan_row_case()
    found = trials.run_trials(
        model,
        cause,
        trials.TrialData(bundle=saved),
        None,
        WatchOptions(trial_budget_s=lib.TRIAL_BUDGET_S),
        print,
    )
    path = trials_file.write_trials(str(tmp_path), 3, cause, found)
    with open(path) as f:
        assert json.load(f)["trials"][0]["remedy"] == "drop_bad_rows"
    trials_file.write_trials(str(tmp_path), 3, cause, found)  # its own file: replaced
    os.remove(path)
    with open(path, "w") as f:
        f.write("not ours")
    with pytest.raises(ValueError, match="not a trials file"):
        trials_file.write_trials(str(tmp_path), 3, cause, found)
    os.remove(path)
    target = tmp_path / "elsewhere.txt"
    target.write_text("keep")
    os.symlink(target, path)
    with pytest.raises(ValueError, match="not written"):
        trials_file.write_trials(str(tmp_path), 3, cause, found)
    assert target.read_text() == "keep"


# -- a hand-written cross-entropy on saturated probabilities -----------------------------------


def hand_written_crossentropy(y, p):
    return -tf.reduce_mean(y * tf.math.log(p) + (1 - y) * tf.math.log(1 - p))


def test_a_log_of_a_saturated_probability_is_fixed_by_clipping_the_predictions():
    keras.utils.set_random_seed(0)
    big = keras.initializers.Constant(50.0)
    model = keras.Sequential(
        [keras.Input((2,)), keras.layers.Dense(1, activation="sigmoid", kernel_initializer=big)]
    )
    optimizer = keras.optimizers.SGD(0.01)
    x = np.ones((BATCH, 2), "float32")  # sigmoid(100) == 1.0 in float32: log(1 - p) = -inf
    y = np.zeros((BATCH, 1), "float32")
    saved = exact_bundle(model, 0, x, y)
    cause = {"id": "loss_math", "remedy_ids": ["from_logits", "clip_predictions"], "evidence": {}}
    found, listed, _ = run(
        model, cause, trials.TrialData(bundle=saved, optimizer=optimizer), hand_written_crossentropy
    )
    assert listed.baseline.outcome == "not_fixed"
    assert found["from_logits"].outcome == "not_tried"  # a function has no from_logits
    assert "has no from_logits" in found["from_logits"].why
    clipped = found["clip_predictions"]
    assert clipped.outcome == "fixed" and clipped.steps == trial_episodes.BUNDLE_STEPS
    # By hand: the same loss on clipped predictions stays finite, on raw ones not.
    for clip, works in ((True, True), (False, False)):
        copy = keras.models.clone_model(model)
        copy.set_weights(model.get_weights())
        sgd = keras.optimizers.SGD(0.01)
        finite = True
        for _ in range(trial_episodes.BUNDLE_STEPS):
            with tf.GradientTape() as tape:
                p = copy(x, training=True)
                p = tf.clip_by_value(p, 1e-7, 1 - 1e-7) if clip else p
                loss = hand_written_crossentropy(y, p)
            sgd.apply_gradients(
                zip(
                    tape.gradient(loss, copy.trainable_variables),
                    copy.trainable_variables,
                    strict=True,
                )
            )
            finite = (
                finite
                and bool(np.isfinite(loss))
                and all(np.isfinite(w).all() for w in copy.get_weights())
            )
        assert finite == works
