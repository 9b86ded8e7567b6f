"""causes: the cause verdict on runs whose cause is fixed by construction.

Every run goes through the real journal, the event files, TensorBoard's loader
and the reader, then :func:`tb_nanwatch.evidence.causes.diagnose`. Each cause id has a
scenario where it is right and a near miss where it must not be given.
"""

from __future__ import annotations

import ast
import math
import os
import subprocess
import sys
from pathlib import Path

import nanwatch_testlib as lib
import numpy as np
import pytest

from tb_nanwatch.board import reader
from tb_nanwatch.evidence import causes, remedies
from tb_nanwatch.evidence.options import WatchOptions
from tb_nanwatch.evidence.recorded import Record
from tb_nanwatch.evidence.schema import BEFORE_FINAL_ACTIVATION, Schema
from tb_nanwatch.record.writing.journal import RunJournal

LAYERS = ["dense_0", "dense_1", "dense_2", "dense_3"]
CLEAN_START = {"weights_at_start": {"checked": 8, "nonfinite": []}}


def make_schema(layers=LAYERS, probabilities: bool = False) -> Schema:
    schema = Schema()
    schema.add("header", "header", None, "step header")
    schema.add("input", "input", "x", "model input x")
    schema.add("input", "input", "target/y", "target target/y")
    for name in layers:
        schema.add("forward", "activation", name, f"output of {name}")
    # The recorder's own texts (tb_nanwatch.record.in_step.phase_stats.PhaseStatistics.forward).
    what = f"logits of model output out {BEFORE_FINAL_ACTIVATION}"
    schema.add("forward", "logits", "out", what if probabilities else "model output out")
    schema.add("loss", "loss", None, "total loss")
    for name in reversed(layers):
        schema.add("backward", "grad_out", name, f"gradient w.r.t. output of {name}")
        schema.add("backward", "grad_var", name, f"gradient of {name}/kernel")
        schema.add("backward", "grad_in", name, f"gradient w.r.t. input of {name}")
    for name in layers:
        schema.add("update", "weights", name, f"{name}/kernel after update")
    return schema


class Step:
    """Edits one step's vector by entry name."""

    def __init__(self, schema: Schema, vector: np.ndarray) -> None:
        self.schema, self.vector = schema, vector

    def put(self, phase: str, kind: str, layer, **fields: float) -> None:
        entry = next(
            e for e in self.schema.entries if (e.phase, e.kind, e.layer) == (phase, kind, layer)
        )
        for name, value in fields.items():
            self.vector[entry.index(name)] = value

    def size(self, layer: str, magnitude: float) -> None:
        self.put("forward", "activation", layer, min=-magnitude, max=magnitude)

    def header(self, **fields: float) -> None:
        for name, value in fields.items():
            self.vector[self.schema.header_index(name)] = value


def write_run(root, name, steps, edit, run_info=None, **schema_options) -> None:
    """Records ``steps`` steps through the real journal; stops at the incident."""
    schema = make_schema(**schema_options)
    info = {"model": name, "optimizer": "Adam", **(run_info or {})}
    # The loss-scale floor off: scaler_streak's scale halves below 1 before
    # its skip streak is long enough, and the streak rule is what it shows.
    options = WatchOptions(flush_secs=1e9, min_loss_scale=0.0)
    journal = RunJournal(os.path.join(root, name), schema, info, options)
    status = "finished"
    for step in range(steps):
        vector = lib.base_vector(schema, step)
        edit(step, Step(schema, vector))
        if journal.record(step, 0, step, vector) is not None:
            status = "stopped"
            break
    journal.close(status)


# -- the scenarios ---------------------------------------------------------------


def lr_too_high(step, s):
    """Loss 1.4e3 -> 2.9e6 -> 1.4e29 -> Inf; dense_2 already 1e24; Inf born in dense_3."""
    s.header(loss=[1.4e3, 2.9e6, 1.4e29, math.inf][step], lr=0.5)
    for i, layer in enumerate(LAYERS[:3]):
        s.size(layer, [3.0, 3e3, 1e12, 1e24 if i == 2 else 1e20][step] * (i + 1))
    if step == 3:
        s.put("forward", "activation", "dense_3", inf=7, min=-math.inf, max=math.inf)


def slow_logit_climb(step, s):
    """|logit| climbs 2 -> 40 over a hundred steps; then log(0) in the loss."""
    logit = 2.0 + 0.3 * step
    s.put("forward", "logits", "out", min=-logit, max=logit)
    if step == 127:
        s.put("loss", "loss", None, inf=1, value=math.inf)
        s.header(loss=math.inf)


def nan_target_then_loss(step, s):
    """Near miss of loss_math: the loss broke because the target held NaN."""
    if step == 12:
        s.put("input", "input", "target/y", nan=3)
        s.put("loss", "loss", None, nan=1, value=math.nan)


def explosion_at_step_1(step, s):
    s.put("forward", "logits", "out", min=-1e8, max=1e8 if step else 3.0)
    if step == 0:
        s.put("forward", "logits", "out", min=-3.0)


def explosion_at_the_end(step, s):
    s.header(loss={100: 17.0, 101: 61.0, 102: 1.2e4, 103: 8e11}.get(step, 0.4))


def steady_large_logits(step, s):
    s.put("forward", "logits", "out", min=-3e4, max=3e4 * (1 + 0.1 * math.sin(step)))


def nan_in_embedding(step, s):
    if step == 0:
        s.put("forward", "activation", "embedding", nan=64, min=math.nan, max=math.nan)


def nan_in_backbone(step, s):
    if step == 0:
        s.put("forward", "activation", "backbone/block1/conv", nan=9)


def fp16_layer_overflow(step, s):
    s.size("dense_1", 3.1e4 * (1 + 0.01 * (step % 3)))
    s.header(loss_scale=32768.0)
    if step == 30:
        s.put("forward", "activation", "dense_2", inf=2, max=math.inf)


def small_values_then_inf(step, s):
    if step == 30:
        s.put("forward", "activation", "dense_2", inf=2, max=math.inf)


def masked_softmax(step, s):
    if step == 20:
        s.put("forward", "activation", "attention/softmax", nan=16, min=math.nan, max=math.nan)


def nan_input(step, s):
    if step == 7:
        s.put("input", "input", "x", nan=5)


def first_layer_nan(step, s):
    if step == 7:
        s.put("forward", "activation", "dense_0", nan=5)


def sqrt_backward(step, s):
    if step == 25:
        s.put("backward", "grad_in", "dense_1", nan=4)


def scaler_streak(step, s):
    s.header(loss_scale=2.0 ** (15 - step), skipped=1.0, grad_norm=math.inf)


def lr_spike_update(step, s):
    s.header(lr=1e2 if step == 40 else 1e-3)
    if step == 40:
        s.put("update", "weights", "dense_0", nan=12)


def update_nan_at_step_0(step, s):
    if step == 0:
        s.put("update", "weights", "dense_0", nan=12)


def huge_input_to_origin(step, s):
    """dense_2 steady at 1e20 (no growth): a forward NaN after it is not ordinary math."""
    s.size("dense_2", 1e20)
    if step == 15:
        s.put("forward", "activation", "dense_3", nan=1)


def healthy_noisy(step, s):
    rng = np.random.default_rng(step)
    s.header(loss=2.0 * math.exp(-step / 80) * rng.lognormal(0, 0.3), grad_norm=rng.lognormal())
    s.put("forward", "logits", "out", min=-5 * rng.lognormal(0, 0.2), max=5.0)


def spikes_that_recover(step, s):
    s.header(loss=1e4 if step in (30, 31, 90) else 0.5, grad_norm=1e6 if step == 60 else 1.0)


EMBED = ["embedding", "dense"]
BACKBONE = ["backbone/block0/conv", "backbone/block1/conv", "head"]
ATTENTION = ["query", "attention/softmax", "dense"]
MIXED = {"dtype_policy": "mixed_float16", **CLEAN_START}

# name: (steps, edit, run info, schema options, expected cause id)
SCENARIOS = {
    "lr_too_high": (10, lr_too_high, CLEAN_START, {}, "growth_overflow"),
    "slow_logit_climb": (200, slow_logit_climb, CLEAN_START, {"probabilities": True}, "loss_math"),
    "nan_target_then_loss": (30, nan_target_then_loss, {}, {}, "input_data"),
    "explosion_at_step_1": (20, explosion_at_step_1, {}, {}, "explosion"),
    "explosion_at_the_end": (104, explosion_at_the_end, {}, {}, "explosion"),
    "steady_large_logits": (100, steady_large_logits, {}, {}, None),
    "nan_embedding_row": (
        5,
        nan_in_embedding,
        {"weights_at_start": {"checked": 3, "nonfinite": ["embedding/embeddings"]}},
        {"layers": EMBED},
        "nonfinite_weights",
    ),
    "clean_embedding_nan_output": (
        5,
        nan_in_embedding,
        CLEAN_START,
        {"layers": EMBED},
        "forward_math",
    ),
    "nan_kernel_in_backbone": (
        5,
        nan_in_backbone,
        {"weights_at_start": {"checked": 6, "nonfinite": ["backbone/block1/conv/kernel"]}},
        {"layers": BACKBONE},
        "nonfinite_weights",
    ),
    "fp16_overflow": (40, fp16_layer_overflow, MIXED, {}, "fp16_overflow"),
    "fp32_same_values": (
        40,
        fp16_layer_overflow,
        {"dtype_policy": "float32", **CLEAN_START},
        {},
        "forward_math",
    ),
    "fp16_small_values": (40, small_values_then_inf, MIXED, {}, "forward_math"),
    "masked_softmax": (30, masked_softmax, {}, {"layers": ATTENTION}, "forward_math"),
    "nan_input": (20, nan_input, {}, {}, "input_data"),
    "first_layer_nan": (20, first_layer_nan, {}, {}, "forward_math"),
    "sqrt_backward": (30, sqrt_backward, {}, {}, "backward_math"),
    "scaler_streak_fp16": (
        30,
        scaler_streak,
        {"dtype_policy": "mixed_float16"},
        {},
        "fp16_overflow",
    ),
    "lr_spike_update": (50, lr_spike_update, {}, {}, "optimizer_update"),
    "update_nan_at_step_0_unknown_start": (5, update_nan_at_step_0, {}, {}, "unknown"),
    "update_nan_at_step_0_clean_start": (
        5,
        update_nan_at_step_0,
        CLEAN_START,
        {},
        "optimizer_update",
    ),
    "update_nan_with_broken_start": (
        5,
        update_nan_at_step_0,
        {"weights_at_start": {"checked": 8, "nonfinite": ["dense_0/kernel"]}},
        {},
        "nonfinite_weights",
    ),
    "huge_input_to_origin": (30, huge_input_to_origin, CLEAN_START, {}, "unknown"),
    "healthy_noisy": (400, healthy_noisy, CLEAN_START, {}, None),
    "spikes_that_recover": (150, spikes_that_recover, {}, {}, None),
}


def texts(cause: dict) -> list[str]:
    """The texts of a cause's remedies, in rank order."""
    return [remedy["text"] for remedy in cause["remedies"]]


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    """Writes every scenario, reads the log dir back: name -> (cause, run, record)."""
    root = str(tmp_path_factory.mktemp("causes"))
    for name, (steps, edit, info, options, _) in SCENARIOS.items():
        write_run(root, name, steps, edit, info, **options)
    source = reader.Source(lib.multiplexer_provider(root), lib.CTX, "")
    found = {}
    for name, run in source.runs().items():
        record = reader.run_record(
            run, source.incident(run), source.series(run), source.flight(run)
        )
        found[name] = (causes.diagnose(record), run, record)
    return found


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_cause_is_the_one_built_in(verdicts, name):
    cause, run, _ = verdicts[name]
    expected = SCENARIOS[name][-1]
    assert (cause and cause["id"]) == expected, cause
    if expected is None:
        assert run.summary["explosion"] is None and run.summary["first_nonfinite"] is None
        return
    assert set(cause) == causes.VERDICT_KEYS
    assert cause["id"] in causes.CAUSE_IDS
    assert cause["summary"].count(". ") == 0 and cause["summary"].endswith(".")
    assert cause["remedies"] and all(
        set(r) == {"id", "text", "code", "trial"} for r in cause["remedies"]
    )
    assert all(isinstance(r["text"], str) and r["text"] for r in cause["remedies"])
    assert all(r["trial"] is None for r in cause["remedies"])  # no trials recorded
    assert [r["id"] for r in cause["remedies"]] == cause["remedy_ids"]
    assert len(cause["remedy_ids"]) == len(set(cause["remedy_ids"]))
    assert set(cause["remedy_ids"]) <= set(remedies.REMEDY_LABELS)
    assert all(isinstance(v, (int, float, str, list, bool)) for v in cause["evidence"].values())
    line = causes.describe(cause)
    assert "\n" not in line and cause["id"] in line and texts(cause)[0] in line


def test_learning_rate_too_high_blames_the_growth_not_the_last_layer(verdicts):
    cause, run, _ = verdicts["lr_too_high"]
    incident = run.summary["first_nonfinite"]
    assert (incident["phase"], incident["layer"], incident["step"]) == ("forward", "dense_3", 3)
    evidence = cause["evidence"]
    assert evidence["onset_step"] == 1 and evidence["signal"] == "loss"
    assert evidence["growth_factor"] == pytest.approx(1.4e29 / 1.4e3, rel=1e-3)
    assert evidence["largest_layer"] == "dense_2" and evidence["largest_max_abs"] == pytest.approx(
        3e24
    )
    assert evidence["first_nonfinite_step"] == 3
    assert "learning rate" in texts(cause)[0] and "0.5" in texts(cause)[0]
    assert "clipnorm" in texts(cause)[1]
    assert "dense_3" in cause["summary"] and "dense_2" in cause["summary"]
    assert not cause["summary"].startswith("dense_3")


def test_loss_math_says_the_output_saturated_and_suggests_from_logits(verdicts):
    cause, _, _ = verdicts["slow_logit_climb"]
    evidence = cause["evidence"]
    assert evidence["saturated"] is True and evidence["max_abs_logit"] == pytest.approx(40.1)
    assert evidence["outputs_probabilities"] is True
    assert evidence["from_logits"] == "not recorded"
    assert "from_logits=True" in texts(cause)[0]


def test_explosions_give_their_onset_and_signal(verdicts):
    first, run, _ = verdicts["explosion_at_step_1"]
    assert run.summary["explosion"]["step"] == 1
    # A plain output and no from-logits loss: the outputs are no logits.
    assert first["evidence"]["onset_step"] == 1 and first["evidence"]["signal"] == "outputs"
    assert "logit" not in first["summary"]
    last, run, _ = verdicts["explosion_at_the_end"]
    assert run.summary["explosion"]["step"] == 100
    assert last["evidence"]["growth_factor"] == pytest.approx(8e11 / 0.4, rel=1e-3)


def test_nonfinite_weights_names_the_variables(verdicts):
    cause, _, _ = verdicts["nan_kernel_in_backbone"]
    assert cause["evidence"]["variables"] == ["backbone/block1/conv/kernel"]
    assert cause["evidence"]["checked"] == 6
    assert "backbone/block1/conv/kernel" in texts(cause)[0]


def test_fp16_overflow_shows_the_magnitude_near_65504(verdicts):
    cause, _, _ = verdicts["fp16_overflow"]
    assert cause["evidence"]["largest_max_abs"] >= 3.1e4
    assert cause["evidence"]["largest_tensor"] == "output of dense_1"
    assert cause["evidence"]["float16_max"] == 65504.0
    streak, _, _ = verdicts["scaler_streak_fp16"]
    assert "consecutive" in streak["evidence"]["note"]


def test_optimizer_update_shows_the_learning_rate_against_the_steps_before(verdicts):
    cause, _, _ = verdicts["lr_spike_update"]
    evidence = cause["evidence"]
    assert evidence["lr"] == pytest.approx(100.0) and evidence["lr_before"] == pytest.approx(1e-3)
    assert evidence["lr_ratio"] == pytest.approx(1e5, rel=1e-3)
    assert "schedule" in texts(cause)[0]
    clean, _, _ = verdicts["update_nan_at_step_0_clean_start"]
    assert "epsilon" in texts(clean)[0]  # no lr spike: epsilon first


def test_forward_math_reads_ordinary_inputs(verdicts):
    cause, _, _ = verdicts["masked_softmax"]
    evidence = cause["evidence"]
    assert evidence["layer"] == "attention/softmax" and evidence["nonfinite_values"] == 16
    assert evidence["input_max_abs"] == 1.0
    assert "-1e9" in " ".join(texts(cause))


def test_unknown_shows_what_was_seen(verdicts):
    cause, _, _ = verdicts["huge_input_to_origin"]
    assert cause["evidence"]["largest_layer"] == "dense_2"
    assert cause["evidence"]["largest_max_abs"] == pytest.approx(1e20)
    assert cause["evidence"]["layer"] == "dense_3"


def test_input_data_names_the_rows_of_the_bundle_batch(verdicts):
    _, _, record = verdicts["nan_input"]
    x = np.ones((8, 3), np.float32)
    x[2, 1] = x[5, 0] = x[5, 2] = np.nan
    y = np.ones((8, 1), np.float64)
    cause = causes.diagnose(record, {"batch/0": x, "batch/1": y})
    assert cause["evidence"]["tensor"] == "model input 'x'"
    assert cause["evidence"]["nonfinite_values"] == 5
    assert cause["evidence"]["rows"] == [
        {"tensor": "batch/0", "rows": [2, 5], "rows_count": 2, "values": 3}
    ]
    assert "[2, 5]" in texts(cause)[0]


def test_input_rows_reads_nested_batches():
    y = np.zeros((4,), np.float32)
    y[3] = np.inf
    rows = causes.input_rows([{"a": np.ones((4, 2)), "b": np.ones(4, np.int32)}, y])
    assert rows == [{"tensor": "batch/1", "rows": [3], "rows_count": 1, "values": 1}]
    assert causes.input_rows(None) == []


def test_describe_a_healthy_run():
    assert "none" in causes.describe(None)


def test_causes_needs_no_tensorflow_and_keeps_the_function_limits():
    code = (
        "import sys\nimport tb_nanwatch.evidence.causes\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras')]\n"
        "assert not bad, bad[:5]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    sources = [*Path(causes.__file__).parent.glob("*.py"), Path(remedies.__file__)]
    assert len(sources) > 2  # the engine's package and the catalogue
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                assert node.end_lineno - node.lineno + 1 <= 60, (path.name, node.name)
                assert len([a for a in node.args.args if a.arg != "self"]) <= 6, node.name


def test_the_incident_card_bundle_entry(tmp_path):
    from tb_nanwatch.board import views

    listing = reader.RunListing("exp/run1", {})
    summary = {"steps": 4, "repro_bundle": "repro/step_000000003", "repro_bundle_exact": True}
    entry = views.bundle_entry(reader.Run(listing, summary, Schema()))
    assert entry["path"] == "repro/step_000000003" and entry["exact"] is True
    lines = entry["snippet"].split("\n")
    assert len(lines) == 2
    assert lines[0].startswith("bundle = tb_nanwatch.load_bundle('exp/run1/repro/step_000000003')")
    compile(entry["snippet"], "snippet", "exec")  # valid Python
    older = views.bundle_entry(reader.Run(listing, {"repro_bundle": "repro/x"}, Schema()))
    assert older["exact"] is None
    assert views.bundle_entry(reader.Run(listing, {"repro_bundle": None}, Schema())) is None


def test_the_journal_gives_the_same_cause_at_the_incident(verdicts, tmp_path):
    """What the console message says at the incident is what the card says."""
    for name in ("lr_too_high", "masked_softmax", "lr_spike_update", "explosion_at_the_end"):
        steps, edit, info, options, _ = SCENARIOS[name]
        schema = make_schema(**options)
        journal = RunJournal(
            str(tmp_path / name), schema, {"model": name, **info}, WatchOptions(flush_secs=1e9)
        )
        for step in range(steps):
            vector = lib.base_vector(schema, step)
            edit(step, Step(schema, vector))
            if journal.record(step, 0, step, vector) is not None:
                break
        if journal.first_nonfinite is None:
            journal.close()
        cause = journal.cause()
        journal.close()
        read_back = verdicts[name][0]
        assert (cause["id"], cause["summary"]) == (read_back["id"], read_back["summary"])


@pytest.mark.parametrize(
    "odd",
    [
        {"weights_at_start": "all fine"},
        {"weights_at_start": {"checked": "many", "nonfinite": "dense_0/kernel"}},
        {"dtype_policy": 16, "loss_from_logits": "yes", "explosion_factor": "big"},
        {"optimizer": {"name": "Adam"}, "weights_at_start": {"nonfinite": []}},
    ],
)
def test_odd_summary_keys_read_as_not_known(verdicts, odd):
    _, run, record = verdicts["lr_spike_update"]
    odd_record = Record(
        record.schema,
        record.incident,
        record.explosion,
        record.series,
        record.flight,
        {**run.summary, **odd},
    )
    cause = causes.diagnose(odd_record)
    assert cause["id"] == "optimizer_update"
    assert all(isinstance(v, (int, float, str, list, bool)) for v in cause["evidence"].values())


# -- the engine's table and the remedy catalogue -----------------------------------

REMEDY_IDS = (
    "lower_lr",
    "fix_schedule",
    "clip_gradients",
    "raise_epsilon",
    "from_logits",
    "output_activation",
    "clip_predictions",
    "float32_policy",
    "float32_layer",
    "normalize_inputs",
    "scale_targets",
    "drop_bad_rows",
    "lr_warmup",
    "fix_weights",
    "fix_code",
)


def test_the_engine_has_one_entry_per_id_and_every_remedy_it_names_is_catalogued():
    ids = [rule.id for rule in causes.RULES]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    assert all(rule.verdict or rule.sign for rule in causes.RULES)
    verdicts = [rule for rule in causes.RULES if rule.kind == "verdict"]
    assert causes.CAUSE_IDS == tuple(rule.id for rule in verdicts)
    assert list(causes.CAUSE_LABELS.items()) == [
        ("nonfinite_weights", "Weights already NaN/Inf before the step"),
        ("input_data", "Bad input data"),
        ("logits_as_probabilities", "Loss reads probabilities, got raw logits"),
        ("unscaled_data", "Data far from unit scale"),
        ("growth_overflow", "Overflow after growth"),
        ("fp16_overflow", "float16 overflow"),
        ("forward_math", "Math error in the forward pass"),
        ("loss_math", "Math error in the loss"),
        ("backward_math", "Math error in the backward pass"),
        ("optimizer_update", "Optimizer update broke the weights"),
        ("explosion", "Explosion (no NaN/Inf yet)"),
        ("unknown", "Unknown cause"),
    ]
    assert set(remedies.REMEDY_LABELS) == set(REMEDY_IDS)
    assert all(remedies.REMEDY_LABELS.values())
    assert all(key == remedy.id for key, remedy in remedies.CATALOGUE.items())
    named = {offer.remedy for rule in causes.RULES for offer in rule.remedies}
    assert named <= set(remedies.CATALOGUE), named - set(remedies.CATALOGUE)
    assert named == set(REMEDY_IDS)  # no catalogue entry that no rule offers
    assert all(rule.remedies for rule in verdicts)
    assert not any(rule.remedies for rule in causes.RULES if rule.kind == "sign")


def _with_summary(verdicts, name: str, **summary) -> dict:
    _, run, record = verdicts[name]
    changed = Record(
        record.schema,
        record.incident,
        record.explosion,
        record.series,
        record.flight,
        {**run.summary, **summary},
    )
    return causes.diagnose(changed)


def test_a_loss_that_reads_logits_is_not_told_to_read_logits(verdicts):
    probabilities = _with_summary(verdicts, "slow_logit_climb", loss_from_logits=False)
    assert probabilities["remedy_ids"][:2] == ["from_logits", "clip_predictions"]
    logits = _with_summary(verdicts, "slow_logit_climb", loss_from_logits=True)
    assert logits["id"] == "loss_math" and logits["summary"] == probabilities["summary"]
    assert "from_logits" not in logits["remedy_ids"]
    assert "clip_predictions" not in logits["remedy_ids"]
    assert not any("from_logits=True" in text for text in texts(logits))
    assert logits["remedies"]  # still something to try


def test_remedies_follow_the_recorded_optimizer_and_precision(verdicts):
    adam, _, _ = verdicts["lr_spike_update"]
    assert "raise_epsilon" in adam["remedy_ids"]
    sgd = _with_summary(verdicts, "lr_spike_update", optimizer="SGD")  # no epsilon to raise
    assert sgd["evidence"] == {**adam["evidence"], "optimizer": "SGD"}
    assert "raise_epsilon" not in sgd["remedy_ids"] and "epsilon" not in " ".join(texts(sgd))
    fp16, _, _ = verdicts["fp16_overflow"]
    # The layer that overflowed is named: that one layer in float32 first, then
    # the whole model; each with its code to paste.
    assert fp16["remedy_ids"][:2] == ["float32_layer", "float32_policy"]
    layer = fp16["evidence"]["layer"]
    assert layer and f"Run the layer {layer} in float32" in texts(fp16)[0]
    assert fp16["remedies"][0]["code"] == (
        f'keras.layers.X(..., dtype="float32")  # X: the class of the layer {layer!r}'
    )
    assert "float32" in texts(fp16)[1]
    fp32, _, _ = verdicts["fp32_same_values"]
    assert not {"float32_policy", "float32_layer"} & set(fp32["remedy_ids"])


def test_outputs_are_logits_only_before_a_final_activation_or_a_from_logits_loss():
    from tb_nanwatch.evidence.causes.case import output_word

    regression, classifier = make_schema(), make_schema(probabilities=True)
    assert output_word({}, regression) == "outputs"
    assert output_word({"loss_from_logits": False}, regression) == "outputs"
    assert output_word({"loss_from_logits": True}, regression) == "logits"
    assert output_word({}, classifier) == "logits"
