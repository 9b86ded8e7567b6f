"""The card is a contract (issue 55, item 3): a user who does literally what
its first remedy says gets what it promised.

Each test trains a script's model under NanWatch, reads the card as the user
does (``tb-nanwatch report --json``: the first remedy's id, its ``together``
and its ``code``), then *runs that code* (the snippet, pasted into the test's
own script: its ``x_train``, ``y_train`` and ``optimizer``) and trains again:
finite, the loss falling.
"""

from __future__ import annotations

import dataclasses
import io
import json

import keras
import nanwatch_testlib as lib
import numpy as np
import pytest
from test_trial_fidelity import fit_normalised_at_a_high_rate, normalised_model
from test_trial_fidelity import run as run_trials

import tb_nanwatch
from tb_nanwatch import cli
from tb_nanwatch.evidence import causes, remedies
from tb_nanwatch.evidence.trials import TRIALS_FILE, Trial, parse_trials, rank

BATCH = 32


def card(logdir) -> dict:
    """The run's cause as ``report --json`` gives it (what the card shows)."""
    out = io.StringIO()
    assert cli.main(["report", str(logdir), "--json"], out=out, err=io.StringIO()) == 0
    (run,) = json.loads(out.getvalue())["runs"]
    return run["cause"]


def paste(code: str, namespace: dict) -> dict:
    """The snippet run as the user pastes it into their script."""
    exec(compile(code, "<the card's code>", "exec"), namespace)  # noqa: S102 - the test's own snippet
    return namespace


def trains(model: keras.Model, x, y, epochs: int = 3) -> bool:
    history = model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    losses = history.history["loss"]
    return bool(np.isfinite(losses).all() and losses[-1] < losses[0])


# -- (a) raw house prices: the combination is one remedy --------------------------------------


def raw_house_prices(rows: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """Inputs 500-1e5 (square feet, year, lot size), prices 1e5-1e6."""
    rng = np.random.RandomState(0)
    x = np.stack(
        [rng.uniform(500, 4000, rows), rng.uniform(1900, 2020, rows), rng.uniform(1e4, 1e5, rows)],
        axis=1,
    ).astype("float32")
    y = 100 * x[:, :1] + x[:, 2:] + rng.uniform(1e5, 3e5, (rows, 1))
    return x, y.astype("float32")


def house_model(first: keras.layers.Layer | None = None) -> keras.Model:
    """The script's model: Dense layers on the raw features (``first``: a
    layer the user put first, e.g. the card's Normalization)."""
    keras.utils.set_random_seed(0)
    layers = [first] if first is not None else []
    layers += [
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(1),
    ]
    return keras.Sequential([keras.Input((3,)), *layers])


def test_raw_house_prices_first_remedy_is_the_combination_and_following_it_trains(tmp_path):
    x, y = raw_house_prices()
    assert y.min() >= 1e5 and y.max() <= 1e6 and x.max() > 5e4
    model = house_model()
    model.compile(optimizer=keras.optimizers.SGD(1e-4), loss="mse")
    watch = tb_nanwatch.NanWatch(str(tmp_path), trial_budget_s=lib.TRIAL_BUDGET_S)
    model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, callbacks=[watch], verbose=0)
    assert watch.incident is not None
    cause = card(tmp_path)
    first = cause["remedies"][0]
    # One remedy, both texts joined, its trial the combination's.
    assert first["together"] == ["normalize_inputs", "scale_targets"], cause["remedies"]
    assert first["id"] == "normalize_inputs+scale_targets"
    assert first["text"].startswith("Normalise the inputs and standardise the targets")
    assert first["trial"]["outcome"] == "fixed"
    # The single remedies keep their own outcomes: alone, neither fixed the run.
    alone = {r["id"]: r for r in cause["remedies"]}
    for remedy in first["together"]:
        assert alone[remedy]["trial"]["outcome"] == "not_fixed", alone[remedy]
    # The trials file holds the combination as its own trial.
    with open(tmp_path / "repro" / TRIALS_FILE) as f:
        written = {t.remedy: t for t in parse_trials(json.load(f))}
    assert written[first["id"]].together == ("normalize_inputs", "scale_targets")
    # Literally: the card's code pasted into the script, then the same fit.
    pasted = paste(first["code"], {"keras": keras, "np": np, "x_train": x, "y_train": y})
    again = house_model(first=pasted["norm"])
    again.compile(optimizer=keras.optimizers.SGD(1e-4), loss="mse")
    assert trains(again, x, pasted["y_train"])
    # One of them alone, followed literally, still does not train.
    single = next(r for r in cause["remedies"] if r["id"] == "normalize_inputs")
    pasted = paste(single["code"], {"keras": keras, "x_train": x})
    alone_model = house_model(first=pasted["norm"])
    alone_model.compile(optimizer=keras.optimizers.SGD(1e-4), loss="mse")
    assert not trains(alone_model, x, y)


# -- (b) a rate too high: the snippet's rate is the one the trial found -------------------------


def test_a_rate_too_high_first_remedy_code_sets_the_rate_the_trial_found(tmp_path):
    x, y = fit_normalised_at_a_high_rate(tmp_path)
    cause = card(tmp_path)
    first = cause["remedies"][0]
    assert first["id"] == "lower_lr", cause["remedies"]
    assert first["trial"]["outcome"] == "fixed"
    factor = float(first["trial"]["setting"].split("lr x")[1].split()[0])
    assert f"learning_rate = {2.0 * factor:.4g}" in first["code"]
    # Literally: the script's optimizer, then the card's line.
    optimizer = keras.optimizers.SGD(2.0)
    paste(first["code"], {"keras": keras, "optimizer": optimizer})
    assert float(optimizer.learning_rate) == pytest.approx(2.0 * factor)
    again = normalised_model(x)
    again.compile(optimizer=optimizer, loss="mse")
    assert trains(again, x, y)


# -- (c) a fix that stopped learning is never first; rewind never sets it over one ---------------


def test_a_fix_that_stopped_learning_never_leads_a_learning_fix():
    tried = [
        Trial("lower_lr", "fixed", setting="lr x0.001", learning=False),
        Trial("clip_gradients", "fixed", setting="clipnorm=1.0", learning=True),
        Trial("normalize_inputs", "not_fixed"),
        Trial("raise_epsilon", "fixed", setting="epsilon=0.0001"),  # learning not known
    ]
    ids = ["lower_lr", "normalize_inputs", "raise_epsilon", "clip_gradients"]
    assert rank(ids, tried) == ["clip_gradients", "raise_epsilon", "lower_lr", "normalize_inputs"]


def test_a_combination_is_read_back_and_old_files_have_none():
    both = Trial("a+b", "fixed", setting="x + y", learning=True, together=("a", "b"))
    body = both.to_json()
    assert body["together"] == ["a", "b"]
    assert Trial.from_json(body) == both
    del body["together"]  # a file written before combinations
    assert Trial.from_json(body).together == ()


def test_the_code_uses_the_numbers_the_trial_used():
    facts = remedies.Facts(
        cause="growth_overflow",
        evidence={"lr": 0.2, "lr_before": 0.00123456},
        summary={"optimizer": "SGD"},
    )
    lower = remedies.CATALOGUE["lower_lr"]
    code = lower.code_for(facts, Trial("lower_lr", "fixed", setting="lr x0.01"))
    assert code.splitlines()[0].startswith("optimizer.learning_rate = 0.002  #")
    assert "keras.optimizers.SGD(learning_rate=0.002)" in code
    held = remedies.CATALOGUE["fix_schedule"].code_for(facts, None)
    assert held.startswith("optimizer.learning_rate = 0.001235  #")
    clip = remedies.CATALOGUE["clip_gradients"].code_for(facts, None)
    assert clip == "keras.optimizers.SGD(..., clipnorm=1.0)"
    for remedy in remedies.CATALOGUE.values():  # every remedy with a trial has code
        if remedy.trial is not None:
            assert remedy.code is not None, remedy.id


def test_the_heading_says_when_nothing_worked():
    from tb_nanwatch.board import report

    failed = [{"id": "lower_lr", "text": "t", "trial": {"outcome": "not_fixed"}}]
    assert report.remedies_heading(failed) == "Nothing we tried fixed the run; what to try first:"
    fixed = [*failed, {"id": "a", "text": "t", "trial": {"outcome": "fixed"}}]
    assert report.remedies_heading(fixed) == "Shown to work on a re-run of your steps:"


def test_a_combination_in_a_verdict_is_one_remedy_with_both_texts_and_codes():
    from test_remedies import HOUSE, record
    from test_remedies import raw_house_prices as house_case

    rec = dataclasses.replace(
        record(2, house_case, HOUSE),
        trials=(
            Trial("normalize_inputs", "not_fixed", setting="inputs normalised", steps=3),
            Trial("scale_targets", "not_fixed", setting="targets standardised", steps=2),
            Trial(
                "normalize_inputs+scale_targets",
                "fixed",
                setting="inputs normalised + targets standardised",
                steps=20,
                learning=True,
                together=("normalize_inputs", "scale_targets"),
            ),
            Trial("lower_lr", "fixed", setting="lr x0.001", steps=20, learning=False),
        ),
    )
    cause = causes.diagnose(rec)
    first = cause["remedies"][0]
    assert first["id"] == cause["remedy_ids"][0] == "normalize_inputs+scale_targets"
    assert first["together"] == ["normalize_inputs", "scale_targets"]
    assert first["text"].startswith("Normalise the inputs and standardise the targets")
    assert "norm.adapt(x_train)" in first["code"] and "y_train = (y_train" in first["code"]
    assert first["trial"]["outcome"] == "fixed"
    outcomes = {r["id"]: r["trial"] and r["trial"]["outcome"] for r in cause["remedies"]}
    assert outcomes["normalize_inputs"] == outcomes["scale_targets"] == "not_fixed"
    assert cause["remedy_ids"][1] == "lower_lr"  # fixed but stopped learning: after


# -- (d) float32 for the layer that overflowed under mixed precision ----------------------------


@keras.saving.register_keras_serializable(package="nanwatch_test")
class SquareNorm(keras.layers.Layer):
    """A hand-written normalisation: (x - mean) / sqrt(mean(x*x) - mean**2).
    In float16, x*x of values near 300 is Inf (beyond 65504), Inf - Inf NaN."""

    def call(self, x):
        mean = keras.ops.mean(x, axis=-1, keepdims=True)
        var = keras.ops.mean(x * x, axis=-1, keepdims=True) - mean * mean
        return (x - mean) / keras.ops.sqrt(var + 1e-3)


def square_norm_model(norm_dtype=None) -> keras.Model:
    keras.utils.set_random_seed(0)
    inp = keras.Input((4,))
    norm = SquareNorm(name="square_norm", dtype=norm_dtype)
    h = keras.layers.Dense(8, activation="relu")(norm(inp))
    return keras.Model(inp, keras.layers.Dense(1, dtype="float32")(h))


def test_a_float16_overflow_in_one_layer_is_fixed_by_that_layer_in_float32(mixed_precision):
    from test_trials import exact_bundle

    from tb_nanwatch.record.after_incident import trials

    rng = np.random.RandomState(3)
    x = rng.uniform(250, 350, (BATCH, 4)).astype("float32")
    y = rng.uniform(-1, 1, (BATCH, 1)).astype("float32")
    model = square_norm_model()
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    assert not np.isfinite(model.predict(x, verbose=0)).all()  # float16 overflows
    saved = exact_bundle(model, 0, x, y)
    evidence = {"layer": "square_norm", "dtype_policy": "mixed_float16"}
    cause = {"id": "fp16_overflow", "remedy_ids": ["float32_layer"], "evidence": evidence}
    found = run_trials(model, cause, trials.TrialData(bundle=saved))
    assert found.baseline.outcome == "not_fixed"
    (trial,) = found
    assert trial.remedy == "float32_layer" and trial.outcome == "fixed", trial
    assert trial.setting.startswith("layer square_norm in float32")
    # The card's text and code name that layer; applied, the script trains.
    facts = remedies.Facts(
        cause="fp16_overflow", evidence=evidence, summary={}, mixed_precision=True
    )
    entry = remedies.CATALOGUE["float32_layer"]
    assert entry.applies(facts) and "square_norm" in entry.text(facts)
    code = entry.code_for(facts, trial)
    assert 'dtype="float32"' in code and "'square_norm'" in code
    fixed = square_norm_model(norm_dtype="float32")  # SquareNorm(..., dtype="float32")
    fixed.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    assert trains(fixed, x, y, epochs=5)
    # A layer the model does not have: not tried, said so.
    from tb_nanwatch.record.after_incident import trial_replica

    with pytest.raises(trial_replica.TrialSkipped, match="no layer nope"):
        trial_replica.clone(model, trial_replica.Variant(float32_layers=("nope",)))
    copy = trial_replica.clone(model, trial_replica.Variant(float32_layers=("model/square_norm",)))
    assert copy.get_layer("square_norm").dtype_policy.name == "float32"
    dense = [layer for layer in copy.layers if isinstance(layer, keras.layers.Dense)]
    assert dense[0].dtype_policy.name == "mixed_float16"  # the rest as it was
    # Without a named layer it is not offered.
    unnamed = remedies.Facts(cause="fp16_overflow", evidence={}, summary={}, mixed_precision=True)
    assert not entry.applies(unnamed)


def recovery_with(tried: list[Trial]):
    """A Recovery of a run whose trials found ``tried`` (an SGD at 0.1)."""
    from types import SimpleNamespace

    from tb_nanwatch.evidence.options import WatchOptions
    from tb_nanwatch.record.after_incident import trials
    from tb_nanwatch.record.after_incident.recovery import Recovery

    session = SimpleNamespace(
        options=WatchOptions(on_nonfinite="rewind", trial_budget_s=lib.TRIAL_BUDGET_S),
        recorder=SimpleNamespace(optimizer=keras.optimizers.SGD(0.1)),
    )
    recovery = Recovery(session, lambda: trials.TrialData())
    recovery.trials = trials.TrialList(tried)
    recovery.use_retrace(lambda: None)
    return recovery


def test_rewind_sets_the_first_learning_fix_it_can_set_live():
    recovery = recovery_with(
        [
            Trial("lower_lr", "fixed", setting="lr x0.001", learning=False),
            Trial("clip_gradients", "fixed", setting="clipnorm=1.0", learning=True),
        ]
    )
    change, why = recovery._choose_remedy()
    assert change is not None and change.remedy == "clip_gradients", why


def test_rewind_sets_the_learning_fix_even_listed_after_one_that_stopped_learning():
    # The cause offered lower_lr first; its trial stopped learning, the
    # schedule's kept learning: the schedule is set, whatever the order.
    recovery = recovery_with(
        [
            Trial("lower_lr", "fixed", setting="lr x0.001", learning=False),
            Trial("raise_epsilon", "not_fixed", setting="epsilon=0.0001"),
            Trial("fix_schedule", "fixed", setting="lr held at 0.001", learning=True),
        ]
    )
    recovery._cause = {"evidence": {"lr_before": 0.001}}
    change, why = recovery._choose_remedy()
    assert change is not None and change.remedy == "fix_schedule", why


def test_rewind_never_sets_a_fix_that_stopped_learning_over_a_learning_fix_it_cannot_set():
    # The learning fix is a data transform (not live): the run is not rewound
    # into one that goes on without learning; why names both.
    recovery = recovery_with(
        [
            Trial("lower_lr", "fixed", setting="lr x0.001", learning=False),
            Trial("scale_targets", "fixed", setting="targets standardised", learning=True),
        ]
    )
    change, why = recovery._choose_remedy()
    assert change is None, change
    assert "scale_targets kept the trial finite but cannot be set on a live run" in why
    assert "lower_lr kept the trial finite but stopped learning" in why


def test_rewind_sets_a_fix_that_stopped_learning_when_no_learning_fix_exists():
    recovery = recovery_with(
        [
            Trial("lower_lr", "fixed", setting="lr x0.001", learning=False),
            Trial("clip_gradients", "not_fixed", setting="clipnorm=1.0"),
        ]
    )
    change, _ = recovery._choose_remedy()
    assert change is not None and change.remedy == "lower_lr"


def test_an_older_trials_file_with_the_combination_under_one_remedy_reads_as_two():
    from test_remedies import HOUSE, record
    from test_remedies import raw_house_prices as house_case

    old = Trial(
        "normalize_inputs",
        "fixed",
        steps=20,
        setting="inputs normalised + targets standardised",
        why="alone it did not help: the loss crossed the explosion line at step 3",
        learning=True,
    )
    cause = causes.diagnose(dataclasses.replace(record(2, house_case, HOUSE), trials=(old,)))
    first, *rest = cause["remedies"]
    assert first["id"] == "normalize_inputs+scale_targets" and first["trial"]["outcome"] == "fixed"
    alone = next(r for r in rest if r["id"] == "normalize_inputs")
    assert alone["trial"]["outcome"] == "not_fixed"
    assert alone["trial"]["setting"] == "inputs normalised"
