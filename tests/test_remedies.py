"""The remedy catalogue fits the model: the data-scale cause, the wording of
outputs and inputs, and remedies offered only where the recorded facts allow.

Every record is built by hand (schema, flight window, series, summary), each
cause fixed by construction, and judged by the cause engine directly.

Each remedy is one catalogue entry: its text, when it applies, and the change
its trial makes (and a live run takes), as data the record side reads; a new
remedy of a known kind of change is tried and set live from its entry alone.
The schedules a live change sets load from run dirs written before they moved.
"""

from __future__ import annotations

import ast
import math
import subprocess
import sys
import zipfile
from pathlib import Path

import keras
import numpy as np
import pytest
from nanwatch_testlib import base_vector
from test_trial_fidelity import run as run_trials

from tb_nanwatch.evidence import causes, changes, remedies
from tb_nanwatch.evidence.recorded import Flight, Record, Series
from tb_nanwatch.evidence.schema import BEFORE_FINAL_ACTIVATION, Schema
from tb_nanwatch.evidence.trials import Trial
from tb_nanwatch.record.after_incident import live_remedies, schedules, trial_remedies, trials
from tb_nanwatch.record.after_incident.bundle import ReproBundle

LAYERS = ["dense_0", "dense_1", "dense_2"]
CLEAN = {"weights_at_start": {"checked": 6, "nonfinite": []}, "optimizer": "SGD"}


def make_schema(probabilities: bool = False, input_name: str = "input") -> Schema:
    """What the recorder writes for a Sequential of Dense layers (its own texts)."""
    schema = Schema()
    schema.add("header", "header", None, "step header")
    schema.add("input", "input", input_name, f"model input {input_name}")
    schema.add("input", "input", "target", "target")
    for name in LAYERS:
        schema.add("forward", "activation", name, f"output of {name}")
    out = f"logits of model output out {BEFORE_FINAL_ACTIVATION}" if probabilities else None
    schema.add("forward", "logits", "out", out or "model output out")
    schema.add("loss", "loss", None, "total loss")
    for name in reversed(LAYERS):
        schema.add("backward", "grad_out", name, f"gradient w.r.t. output of {name}")
        schema.add("backward", "grad_var", name, f"gradient of {name}/kernel")
    for name in LAYERS:
        schema.add("update", "weights", name, f"{name}/kernel after update")
    return schema


def put(schema: Schema, vector, phase: str, kind: str, layer, **fields: float) -> None:
    entry = next(e for e in schema.entries if (e.phase, e.kind, e.layer) == (phase, kind, layer))
    for name, value in fields.items():
        vector[entry.index(name)] = value


def record(steps: int, edit, incident: dict | None, summary=None, **schema_options) -> Record:
    """A record of ``steps`` steps (all in the flight window and the series)."""
    schema = make_schema(**schema_options)
    vectors = []
    for step in range(steps):
        vector = base_vector(schema, step)
        edit(schema, step, vector)
        vectors.append(vector)
    matrix = np.stack(vectors)
    header = schema.header()
    columns = {f: matrix[:, header.index(f)] for f in ("loss", "grad_norm", "lr")}
    logits = schema.find(kind="logits")[0]
    columns["logit_min"] = matrix[:, logits.index("min")]
    columns["logit_max"] = matrix[:, logits.index("max")]
    return Record(
        schema,
        incident,
        series=Series(np.arange(steps), columns),
        flight=Flight(0, matrix, schema),
        summary={**CLEAN, **(summary or {})},
    )


def incident(step: int, phase: str, layer=None, kind: str = "inf", **extra) -> dict:
    return {"step": step, "phase": phase, "layer": layer, "kind": kind, **extra}


def texts(cause: dict) -> list[str]:
    return [remedy["text"] for remedy in cause["remedies"]]


# -- unscaled data vs growth ---------------------------------------------------------


def raw_house_prices(schema, step, vector):
    """Raw square feet / year / lot (500-2e4) and prices (1e5-4.4e5): loss 8.6e10
    at step 0, the outputs 1e21 at step 1 and the loss Inf."""
    put(schema, vector, "input", "input", "input", min=509.6, max=19222.5)
    put(schema, vector, "input", "input", "target", min=86968.0, max=442795.0)
    if step == 0:
        vector[schema.header_index("loss")] = 8.63e10
        for name in LAYERS:
            put(schema, vector, "forward", "activation", name, min=0.0, max=9e3)
        put(schema, vector, "forward", "logits", "out", min=1.8e3, max=7.2e3)
    else:
        vector[schema.header_index("loss")] = math.inf
        for name in LAYERS:
            put(schema, vector, "forward", "activation", name, min=0.0, max=1.1e21)
        put(schema, vector, "forward", "logits", "out", min=2.4e20, max=1.1e21)
        put(schema, vector, "loss", "loss", None, inf=1, value=math.inf)
    vector[schema.header_index("lr")] = 1e-4


def unit_scale_growth(schema, step, vector):
    """Unit-scale data and a rate far too high: the loss climbs from 1.4e3 to Inf."""
    vector[schema.header_index("loss")] = [1.4e3, 2.9e6, 1.4e29, math.inf][step]
    for name in LAYERS[:2]:
        put(schema, vector, "forward", "activation", name, min=0.0, max=[3, 3e3, 1e12, 1e24][step])
    if step == 3:
        put(schema, vector, "forward", "activation", "dense_2", inf=7, max=math.inf)


HOUSE = incident(1, "loss", tensor="total loss")


def test_raw_house_prices_are_unscaled_data_with_the_data_remedies_first():
    cause = causes.diagnose(record(2, raw_house_prices, HOUSE))
    assert cause["id"] == "unscaled_data", cause
    assert cause["remedy_ids"][:2] == ["normalize_inputs", "scale_targets"]
    assert cause["remedy_ids"][2:4] == ["lower_lr", "clip_gradients"]
    # The other candidates' remedies follow: the trials try them too.
    assert cause["candidates"][:2] == ["unscaled_data", "growth_overflow"]
    assert cause["remedy_ids"][4] == "lr_warmup"
    evidence = cause["evidence"]
    assert evidence["input"] == "the model input" and evidence["target"] == "the target"
    assert evidence["input_max"] == pytest.approx(19222.5)
    assert evidence["target_max"] == pytest.approx(442795.0)
    assert evidence["first_loss"] == pytest.approx(8.63e10, rel=1e-6)
    normalize, scale = texts(cause)[:2]
    assert "the model input ranges 510 to 1.92e+04" in normalize
    assert "keras.layers.Normalization" in normalize and "adapt" in normalize
    assert "the target ranges 8.7e+04 to 4.43e+05" in scale
    assert "1.92e+04" in cause["summary"] and "4.43e+05" in cause["summary"]
    assert "logit" not in cause["summary"] and "input input" not in cause["summary"]


def test_a_rate_too_high_on_unit_scale_data_stays_growth_overflow():
    cause = causes.diagnose(
        record(4, unit_scale_growth, incident(3, "forward", "dense_2", tensor="output of dense_2"))
    )
    assert cause["id"] == "growth_overflow", cause
    assert cause["remedy_ids"][0] == "lower_lr"
    assert "normalize_inputs" not in cause["remedy_ids"]  # the data is of unit scale
    assert "scale_targets" not in cause["remedy_ids"]


def test_large_data_with_an_ordinary_first_loss_is_growth_with_the_data_remedies_last():
    def edit(schema, step, vector):
        unit_scale_growth(schema, step, vector)
        put(schema, vector, "input", "input", "input", min=0.0, max=255.0)
        vector[schema.header_index("loss")] = [2.3, 2.9e6, 1.4e29, math.inf][step]

    cause = causes.diagnose(
        record(4, edit, incident(3, "forward", "dense_2", tensor="output of dense_2"))
    )
    assert cause["id"] == "growth_overflow", cause
    assert cause["remedy_ids"][0] == "lower_lr" and cause["remedy_ids"][-1] == "normalize_inputs"
    assert "scale_targets" not in cause["remedy_ids"]  # the targets are of unit scale


def test_integer_id_inputs_are_no_scale_evidence():
    def edit(schema, step, vector):
        raw_house_prices(schema, step, vector)
        put(schema, vector, "input", "input", "target", min=-1.0, max=1.0)

    ids = {"input_dtypes": {"input": "int32"}}
    cause = causes.diagnose(record(2, edit, HOUSE, ids))
    assert cause["id"] != "unscaled_data"
    assert "normalize_inputs" not in cause["remedy_ids"]
    as_values = causes.diagnose(record(2, edit, HOUSE, {"input_dtypes": {"input": "float32"}}))
    assert as_values["id"] == "unscaled_data"
    assert as_values["remedy_ids"][0] == "normalize_inputs"
    assert "scale_targets" not in as_values["remedy_ids"]


def test_a_late_incident_without_growth_is_not_blamed_on_the_data():
    def edit(schema, step, vector):
        put(schema, vector, "input", "input", "input", min=500.0, max=2e4)
        vector[schema.header_index("loss")] = 5e4 if step == 0 else 10.0
        if step == 199:
            put(schema, vector, "forward", "activation", "dense_1", nan=3, min=math.nan)

    cause = causes.diagnose(
        record(
            200, edit, incident(199, "forward", "dense_1", kind="nan", tensor="output of dense_1")
        )
    )
    assert cause["id"] == "forward_math", cause


# -- outputs and inputs named as they are ------------------------------------------------


@pytest.mark.parametrize(
    ("summary", "probabilities", "word"),
    [({}, False, "outputs"), ({"loss_from_logits": True}, False, "logits"), ({}, True, "logits")],
)
def test_outputs_are_logits_only_before_a_softmax_or_a_from_logits_loss(
    summary, probabilities, word
):
    def edit(schema, step, vector):
        size = [2.0, 2e3, 2e6, 2e9, 2e12][step]
        put(schema, vector, "forward", "logits", "out", min=-size, max=size)
        if step == 4:
            put(schema, vector, "loss", "loss", None, inf=1, value=math.inf)

    rec = record(
        5, edit, incident(4, "loss", tensor="total loss"), summary, probabilities=probabilities
    )
    cause = causes.diagnose(rec)
    assert cause["id"] == "growth_overflow", cause
    assert cause["evidence"]["signal"] == word
    assert cause["summary"].startswith(f"The {word} grew")
    other = "logits" if word == "outputs" else "outputs"
    assert other not in cause["summary"]


def test_the_origin_layer_is_judged_by_its_own_input_not_the_model_input():
    def edit(schema, step, vector):
        put(schema, vector, "input", "input", "input", min=-40.0, max=50.0)  # ordinary
        put(schema, vector, "forward", "activation", "dense_0", min=0.0, max=3.0)
        if step == 9:
            put(schema, vector, "forward", "activation", "dense_1", nan=4, min=math.nan)

    cause = causes.diagnose(
        record(10, edit, incident(9, "forward", "dense_1", kind="nan", tensor="output of dense_1"))
    )
    assert cause["id"] == "forward_math", cause
    assert cause["evidence"]["input_tensor"] == "output of dense_0"
    assert cause["evidence"]["input_max_abs"] == 3.0
    assert "output of dense_0, largest |x| 3" in cause["summary"]
    assert "50" not in cause["summary"] and "model input" not in cause["summary"]


@pytest.mark.parametrize(
    ("name", "words"), [("input", "the model input"), ("price", "model input 'price'")]
)
def test_a_model_input_is_never_input_input(name, words):
    def edit(schema, step, vector):
        if step == 5:
            put(schema, vector, "input", "input", name, nan=2)

    tensor = f"model input {name}"
    rec = record(6, edit, incident(5, "input", name, kind="nan", tensor=tensor), input_name=name)
    cause = causes.diagnose(rec)
    assert cause["id"] == "input_data"
    assert cause["evidence"]["tensor"] == words
    assert words in cause["summary"]
    hints = {h["id"]: h for h in causes.compute_hints(rec)}
    everything = " ".join([cause["summary"], *texts(cause), hints["input_nonfinite"]["text"]])
    assert "input input" not in everything and words in hints["input_nonfinite"]["text"].lower()


# -- remedies that cannot apply are not offered --------------------------------------------


def layer_nan(schema, step, vector):
    if step == 9:
        put(schema, vector, "forward", "activation", "dense_1", nan=4, min=math.nan)


LAYER_NAN = incident(9, "forward", "dense_1", kind="nan", tensor="output of dense_1")


def test_masking_advice_only_for_a_model_with_attention():
    plain = causes.diagnose(record(10, layer_nan, LAYER_NAN, {"has_attention": False}))
    assert plain["id"] == "forward_math" and "fix_code" in plain["remedy_ids"]
    assert not any("mask" in text or "-1e9" in text for text in texts(plain))
    attention = causes.diagnose(record(10, layer_nan, LAYER_NAN, {"has_attention": True}))
    assert any("mask attention" in text and "-1e9" in text for text in texts(attention))


def test_no_replay_advice_once_the_op_is_named():
    replay = "enable_check_numerics"
    unnamed = causes.diagnose(record(10, layer_nan, LAYER_NAN))
    assert any(replay in text for text in texts(unnamed))
    op = {
        "type": "Log",
        "name": "sequential/dense_1/Log",
        "source": "model.py:12",
        "reproduced": True,
    }
    named = causes.diagnose(record(10, layer_nan, {**LAYER_NAN, "op": op}))
    assert not any(replay in text for text in texts(named))
    assert any("Log (sequential/dense_1/Log) at model.py:12" in text for text in texts(named))
    # An op record without a type or a name names nothing: the replay advice stays.
    empty = {**LAYER_NAN, "op": {"type": "", "name": "", "source": None}}
    assert any(replay in text for text in texts(causes.diagnose(record(10, layer_nan, empty))))


def regression_loss_inf(schema, step, vector):
    if step == 6:
        put(schema, vector, "loss", "loss", None, inf=1, value=math.inf)
        vector[schema.header_index("loss")] = math.inf


LOSS_INF = incident(6, "loss", tensor="total loss")


def test_probability_remedies_only_when_the_outputs_are_probabilities():
    regression = causes.diagnose(record(7, regression_loss_inf, LOSS_INF))
    assert regression["id"] == "loss_math"
    assert not {"from_logits", "clip_predictions"} & set(regression["remedy_ids"])
    assert regression["remedies"]  # still something to try
    assert "logit" not in regression["summary"]
    softmax = causes.diagnose(record(7, regression_loss_inf, LOSS_INF, probabilities=True))
    assert {"from_logits", "clip_predictions"} <= set(softmax["remedy_ids"])


def test_clip_gradients_is_not_offered_to_an_optimizer_that_already_clips():
    def edit(schema, step, vector):
        unit_scale_growth(schema, step, vector)

    inc = incident(3, "forward", "dense_2", tensor="output of dense_2")
    for settings, offered in (({"clipnorm": 1.0}, False), ({"global_clipnorm": 0.5}, False)):
        cause = causes.diagnose(record(4, edit, inc, {"optimizer_settings": settings}))
        assert ("clip_gradients" in cause["remedy_ids"]) is offered, settings
    loose = causes.diagnose(record(4, edit, inc, {"optimizer_settings": {"clipnorm": 10.0}}))
    text = dict(zip(loose["remedy_ids"], texts(loose), strict=True))["clip_gradients"]
    assert "clips at 10" in text and "1.0" in text
    never = causes.diagnose(record(4, edit, inc, {"optimizer_settings": {"clipnorm": None}}))
    assert (
        "clipnorm=1.0"
        in dict(zip(never["remedy_ids"], texts(never), strict=True))["clip_gradients"]
    )


def update_nan(schema, step, vector):
    if step == 3:
        put(schema, vector, "update", "weights", "dense_0", nan=5)


UPDATE_NAN = incident(3, "update", "dense_0", kind="nan", tensor="dense_0/kernel after update")


@pytest.mark.parametrize(
    ("summary", "offered"),
    [
        ({"optimizer": "RMSprop", "optimizer_settings": {"epsilon": 0.0}}, True),
        ({"optimizer": "Custom", "optimizer_settings": {"epsilon": None}}, False),
        ({"optimizer": "SGD"}, False),  # not recorded: judged by the type name
        ({"optimizer": "Adam"}, True),
    ],
)
def test_raise_epsilon_only_for_an_optimizer_with_an_epsilon(summary, offered):
    cause = causes.diagnose(record(4, update_nan, UPDATE_NAN, summary))
    assert cause["id"] == "optimizer_update"
    assert ("raise_epsilon" in cause["remedy_ids"]) is offered
    if summary.get("optimizer_settings", {}).get("epsilon") == 0.0:
        assert "(it is 0)" in texts(cause)[0]


# -- one remedy, one home: the record side reads each entry's change ------------------


def recorded_batches():
    """Two float batches far from unit scale, one row holding a NaN."""
    x = np.random.RandomState(0).uniform(500, 4000, (16, 3)).astype("float32")
    y = np.random.RandomState(1).uniform(1e5, 2e5, (16, 1)).astype("float32")
    x[3, 1] = np.nan
    return [[x[:8], y[:8]], [x[8:], y[8:]]]


def test_every_entry_declares_a_change_the_record_side_reads():
    for remedy in remedies.CATALOGUE.values():
        if remedy.trial is None:
            assert not remedy.live, remedy.id  # advice: nothing to set either
            assert trial_remedies.is_advice(remedy.id)
            continue
        assert isinstance(remedy.trial, changes.KINDS), remedy.id
        assert trial_remedies.can_try(remedy.trial), remedy.id
        assert not remedy.live or live_remedies.can_set(remedy.trial), remedy.id
        partner = trial_remedies.partner(remedy.id)
        assert partner is None or remedies.CATALOGUE[partner].trial is not None


def test_the_readers_of_the_changes_name_no_remedy():
    """The record side reads the kind of change, never a remedy's id."""
    wing = Path(trials.__file__).parent
    for name in ("trial_remedies", "live_remedies", "trials", "recovery", "follow_up"):
        tree = ast.parse((wing / f"{name}.py").read_text(encoding="utf-8"))
        named = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)}
        assert not named & set(remedies.CATALOGUE), name


def test_every_trial_builds_and_every_live_change_sets_what_its_trial_found():
    recorded = trial_remedies.Recorded(
        recorded_batches(), rate_before=1e-3, warmup_steps=4, layer="dense"
    )
    live = []
    for remedy in remedies.CATALOGUE.values():
        if remedy.trial is None:
            continue
        variants = trial_remedies.variants(remedy.id, recorded)
        assert variants and all(v.setting for v in variants), remedy.id
        if not remedy.live:
            continue
        live.append(remedy.id)
        optimizer = keras.optimizers.Adam(0.01)
        trial = Trial(remedy.id, "fixed", setting=variants[-1].setting)
        change = live_remedies.plan(remedy.id, trial, optimizer, {"evidence": {}})
        change.apply()
        assert change.remedy == remedy.id and change.setting.startswith(variants[-1].setting)
        assert optimizer.get_config() != keras.optimizers.Adam(0.01).get_config(), remedy.id
    assert live == ["lower_lr", "fix_schedule", "clip_gradients", "raise_epsilon"]
    not_live = Trial("drop_bad_rows", "fixed", setting="rows holding NaN/Inf dropped")
    with pytest.raises(live_remedies.NotLive, match="changes more than the optimizer"):
        live_remedies.plan("drop_bad_rows", not_live, keras.optimizers.Adam())


def test_the_changes_of_the_catalogue_are_its_constants():
    clip = remedies.CATALOGUE["clip_gradients"].trial
    assert clip.settings == (("clipnorm", remedies.CLIP_NORM), ("global_clipnorm", None))
    assert clip.words == "clipnorm=1.0"
    assert remedies.CATALOGUE["raise_epsilon"].trial.words == "epsilon=0.0001"
    assert remedies.CATALOGUE["lower_lr"].trial.factors == (10, 100, 1000)
    with pytest.raises(ValueError, match="unknown data transform"):
        changes.DataTransform("rescale_everything")


def test_a_new_remedy_is_one_catalogue_entry_tried_and_set_live(monkeypatch):
    """A remedy that makes known kinds of change: its entry alone, no record/ code."""
    fake = remedies.Remedy(
        "soft_clip",
        "Clip gradients softly",
        lambda facts: "Clip gradients at 0.5.",
        trial=changes.OptimizerSettings((("clipnorm", 0.5), ("global_clipnorm", None))),
        live=True,
    )
    dropping = remedies.Remedy(
        "skip_nan_rows",
        "Skip the rows holding NaN",
        lambda facts: "Skip them.",
        trial=changes.DataTransform("drop_nonfinite_rows"),
    )
    monkeypatch.setitem(remedies.CATALOGUE, fake.id, fake)
    monkeypatch.setitem(remedies.CATALOGUE, dropping.id, dropping)
    x = np.random.RandomState(0).normal(size=(8, 3)).astype("float32")
    x[2, 1] = np.nan
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    weights = {v.path: v.numpy() for v in model.trainable_weights}
    saved = ReproBundle(3, [x, np.ones((8, 1), "float32")], weights, {"exact": True})
    cause = {"id": "input_data", "remedy_ids": ["soft_clip", "skip_nan_rows"], "evidence": {}}
    found = run_trials(model, cause, trials.TrialData(bundle=saved))
    by_id = {t.remedy: t for t in found}
    assert by_id["skip_nan_rows"].outcome == "fixed"
    assert by_id["skip_nan_rows"].setting == "rows holding NaN/Inf dropped"
    assert by_id["soft_clip"].outcome == "not_fixed"  # a NaN row stays NaN at any clip
    assert by_id["soft_clip"].setting == "clipnorm=0.5"
    optimizer = keras.optimizers.Adam(global_clipnorm=2.0)
    change = live_remedies.plan("soft_clip", by_id["soft_clip"], optimizer)
    change.apply()
    assert (change.setting, change.retrace) == ("clipnorm=0.5", True)
    assert (optimizer.clipnorm, optimizer.global_clipnorm) == (0.5, None)


# -- the schedules a live change sets load from run dirs of any version -----------------

OLD_MODULES = (
    "tb_nanwatch.record.live_remedies",
    "tb_nanwatch.record.after_incident.live_remedies",
)


@pytest.mark.parametrize("module", OLD_MODULES)
def test_a_schedule_saved_under_an_old_module_path_loads(module):
    decay = {
        "module": "keras.optimizers.schedules",
        "class_name": "ExponentialDecay",
        "config": {"initial_learning_rate": 0.1, "decay_steps": 10, "decay_rate": 0.5},
        "registered_name": None,
    }
    scaled = {
        "module": module,
        "class_name": "ScaledSchedule",
        "registered_name": "tb_nanwatch>ScaledSchedule",
        "config": {"schedule": decay, "scale": 0.1},
    }
    held = {
        "module": module,
        "class_name": "HeldRate",
        "registered_name": "tb_nanwatch>HeldRate",
        "config": {"rate": 0.001},
    }
    loaded = keras.optimizers.schedules.deserialize(scaled)
    assert isinstance(loaded, schedules.ScaledSchedule) and loaded.scale == 0.1
    assert float(loaded(0)) == pytest.approx(0.01)
    loaded = keras.saving.deserialize_keras_object(held)
    assert isinstance(loaded, schedules.HeldRate) and loaded.rate == 0.001


def test_a_saved_model_naming_the_old_module_loads_in_a_fresh_process(tmp_path):
    """A bundle's model.keras whose optimizer holds a ScaledSchedule (a rewind
    on a schedule), its config naming the pre-move module: ``bundle.load_model``
    in a new interpreter (``tb-nanwatch replay``) gets the class."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    decay = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    model.compile(optimizer=keras.optimizers.SGD(schedules.ScaledSchedule(decay, 0.1)), loss="mse")
    model.optimizer.build(model.trainable_variables)
    directory = tmp_path / "run" / "repro" / "step_0"
    directory.mkdir(parents=True)
    saved = str(tmp_path / "new.keras")
    model.save(saved)
    with zipfile.ZipFile(saved) as source, zipfile.ZipFile(directory / "model.keras", "w") as out:
        for item in source.infolist():
            body = source.read(item.filename)
            if item.filename == "config.json":
                text = body.decode("utf-8")
                assert schedules.__name__ in text
                body = text.replace(schedules.__name__, OLD_MODULES[0]).encode("utf-8")
            out.writestr(item, body)
    info = {"model": "model.keras"}
    script = (
        "from tb_nanwatch.record.after_incident import bundle\n"
        f"holder = bundle.ReproBundle(0, None, {{}}, {info!r}, {str(directory)!r})\n"
        "model, _ = bundle.load_model(holder)\n"
        "rate = model.optimizer._learning_rate\n"
        "print(type(rate).__module__, type(rate).__name__, rate.scale)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [schedules.__name__, "ScaledSchedule", "0.1"]
