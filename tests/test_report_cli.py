"""``tb-nanwatch report``: JSON shape, human output, exit codes."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys

import nanwatch_testlib as lib
import pytest

from tb_nanwatch import cli
from tb_nanwatch.evidence import causes
from tb_nanwatch.record.writing.synthetic import write_synthetic_run

RUN_KEYS = {
    "run",
    "steps",
    "first_nonfinite",
    "explosion",
    "skipped_steps",
    "cause",
    "recoveries",
    "warnings",
}
INCIDENT_KEYS = {"step", "phase", "layer", "tensor", "kind", "op"}
CAUSE_KEYS = causes.VERDICT_KEYS


def _skips(step, vector, schema):
    vector[schema.header_index("loss_scale")] = 1024.0
    if step in (5, 6, 7, 12):
        vector[schema.header_index("skipped")] = 1.0  # by the loss scaler
        vector[schema.header_index("grad_norm")] = float("inf")  # of the scaled gradients


def _explodes(step, vector, schema):
    if step >= 100:
        vector[schema.header_index("loss")] = 1e5


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("report_logs")
    write_synthetic_run(str(root / "a" / "big"), 300, incident_step=250, incident_layer=3)
    write_synthetic_run(str(root / "healthy"), 50, num_layers=2)
    lib.write_vector_run(str(root / "skips"), 40, _skips)
    lib.write_vector_run(str(root / "explodes"), 130, _explodes)
    return str(root)


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_json_is_exactly_one_object_of_the_documented_shape(logdir):
    code, out, _ = run_cli("report", logdir, "--json")
    assert code == 0
    body = json.loads(out)  # the whole stdout is one JSON document
    assert out.count("\n") == 1
    assert set(body) == {"runs"}
    by_name = {r["run"]: r for r in body["runs"]}
    assert [r["run"] for r in body["runs"]] == ["a/big", "explodes", "healthy", "skips"]
    for run in body["runs"]:
        assert set(run) == RUN_KEYS
        assert isinstance(run["steps"], int)
        assert isinstance(run["skipped_steps"], list)
    big_cause = by_name["a/big"].pop("cause")
    assert set(big_cause) == CAUSE_KEYS and big_cause["id"] == "forward_math"
    assert big_cause["evidence"]["layer"] == "model/block0/layer3"
    assert by_name["a/big"] == {
        "run": "a/big",
        "steps": 251,
        "first_nonfinite": {
            "step": 250,
            "phase": "forward",
            "layer": "model/block0/layer3",
            "tensor": "output of model/block0/layer3",
            "kind": "nan",
            "op": None,
        },
        "explosion": None,
        "skipped_steps": [],
        "recoveries": [],
        "warnings": [],
    }
    assert set(by_name["a/big"]["first_nonfinite"]) == INCIDENT_KEYS
    assert by_name["healthy"] == {
        "run": "healthy",
        "steps": 50,
        "first_nonfinite": None,
        "explosion": None,
        "skipped_steps": [],
        "cause": None,
        "recoveries": [],
        "warnings": [],
    }
    assert by_name["skips"]["cause"] is None
    assert by_name["explodes"]["cause"]["id"] == "explosion"
    assert by_name["explodes"]["cause"]["evidence"]["onset_step"] == 100
    assert by_name["skips"]["skipped_steps"] == [5, 6, 7, 12]
    assert by_name["skips"]["first_nonfinite"] is None
    assert by_name["explodes"]["explosion"] == {"step": 100, "signal": "loss"}
    assert by_name["explodes"]["first_nonfinite"] is None


def test_a_logdir_that_is_itself_a_run_is_reported_as_dot(logdir):
    code, out, _ = run_cli("report", os.path.join(logdir, "healthy"), "--json")
    assert code == 0
    assert [r["run"] for r in json.loads(out)["runs"]] == ["."]


def test_human_output(logdir):
    code, out, _ = run_cli("report", logdir)
    assert code == 0
    blocks = {block.split(":")[0]: block for block in out.strip().split("\n\n")}
    assert set(blocks) == {"run a/big", "run explodes", "run healthy", "run skips"}
    big = blocks["run a/big"]
    assert "first non-finite: NaN at step 250 (epoch 0, batch 250)" in big
    assert "phase forward, layer model/block0/layer3" in big
    assert "output of model/block0/layer3" in big
    assert "skipped steps: 0" in big
    assert "healthy: no NaN/Inf recorded" in blocks["run healthy"]
    assert "explosion onset: none" in blocks["run healthy"]
    assert "explosion onset: step 100 (loss)" in blocks["run explodes"]
    assert "healthy" not in blocks["run explodes"]
    explodes = blocks["run explodes"].split("\n")
    assert (
        explodes[1] == "  Explosion from step 100: the loss started to blow up, no NaN or Inf yet"
    )
    assert explodes[2].startswith("  cause (explosion): The loss exploded")
    assert big.split("\n")[1] == (
        "  First NaN at step 250, born in the forward phase at layer model/block0/layer3"
    )
    assert big.split("\n")[2].startswith("  cause (forward_math): model/block0/layer3 turned")
    assert "    remedy 1: " in big and "  evidence: layer=model/block0/layer3" in big
    assert "cause" not in blocks["run healthy"]
    assert "hint: Training is exploding" in blocks["run explodes"]
    assert "skipped steps: 4" in blocks["run skips"]


def test_empty_logdir_reads_fine(tmp_path):
    code, out, _ = run_cli("report", str(tmp_path))
    assert code == 0 and "no NaN Watch runs" in out
    code, out, _ = run_cli("report", str(tmp_path), "--json")
    assert code == 0 and json.loads(out) == {"runs": []}


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_bad_path_exits_2_with_a_message(tmp_path, kind):
    path = tmp_path / "nope"
    if kind == "file":
        path.write_text("not a directory")
    code, out, err = run_cli("report", str(path), "--json")
    assert code == 2
    assert out == ""
    assert str(path) in err
    assert ("does not exist" if kind == "missing" else "not a directory") in err


def test_usage_errors_exit_2():
    with pytest.raises(SystemExit) as raised:
        cli.main([], out=io.StringIO(), err=io.StringIO())
    assert raised.value.code == 2


def test_console_script(logdir, tmp_path):
    script = shutil.which("tb-nanwatch")
    command = [script] if script else [sys.executable, "-m", "tb_nanwatch.cli"]
    done = subprocess.run(
        [*command, "report", logdir, "--json"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["runs"]) == 4
    done = subprocess.run(
        [*command, "report", str(tmp_path / "missing")],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "does not exist" in done.stderr and done.stdout == ""


def test_op_and_bad_rows_of_an_input_incident(tmp_path):
    """The op line under the layer, and the bundle's bad rows, when recorded."""
    import numpy as np

    from tb_nanwatch.evidence.options import WatchOptions
    from tb_nanwatch.record.writing.journal import RunJournal
    from tb_nanwatch.record.writing.synthetic import build_schema

    run_dir = tmp_path / "run"
    schema = build_schema(2)
    journal = RunJournal(str(run_dir), schema, {"model": "m"}, WatchOptions(flush_secs=1e9))
    for step in range(4):
        vector = lib.base_vector(schema, step)
        if step == 3:
            vector[schema.find(kind="input")[0].index("inf")] = 2
        incident = journal.record(step, 0, step, vector)
    incident["op"] = {"type": "Cast", "name": "cast_1", "source": "train.py:12", "reproduced": True}
    journal.first_nonfinite = incident
    bundle = run_dir / "repro" / "step_000000003"
    bundle.mkdir(parents=True)
    x = np.ones((6, 2), np.float32)
    x[4] = np.inf
    np.savez(bundle / "bundle.npz", **{"batch/0": x, "batch/1": np.ones((6, 1))})
    journal.repro_bundle = "repro/step_000000003"  # as the bundle hook records it
    journal.close("stopped")

    code, out, _ = run_cli("report", str(tmp_path), "--json")
    (run,) = json.loads(out)["runs"]
    assert run["first_nonfinite"]["op"] == incident["op"]
    assert run["cause"]["id"] == "input_data"
    assert run["cause"]["evidence"]["rows"] == [
        {"tensor": "batch/0", "rows": [4], "rows_count": 1, "values": 2}
    ]
    best = run["cause"]["remedies"][0]  # an Inf input: the float64 cast first
    assert best["id"] == "normalize_inputs" and "float32" in best["text"]
    assert best["trial"] is None  # no remedy trials in this run dir
    code, out, _ = run_cli("report", str(tmp_path))
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if "first non-finite" in line)
    assert lines[first + 1] == ("    op: Cast 'cast_1' at train.py:12 (reproduced by replay)")
    assert lines[1] == "  First Inf at step 3, born in the input phase at layer input_0"
    assert lines[2].startswith("  cause (input_data): The batch of step 3 held Inf")


def test_a_log_dir_that_is_itself_the_run_is_named_by_its_directory(tmp_path):
    run_dir = tmp_path / "my_experiment"
    write_synthetic_run(str(run_dir), 1, num_layers=2)
    code, out, _ = run_cli("report", str(run_dir))
    assert code == 0
    assert out.splitlines()[0].startswith("run my_experiment: 1 step, ")  # not "run .: 1 steps"


TRIED = {
    "id": "growth_overflow",
    "summary": "The loss grew 1e26 times before it overflowed.",
    "evidence": {"onset_step": 33, "growth_factor": 1e26},
    "remedies": [
        {
            "id": "clip_gradients",
            "text": "Clip the gradients",
            "code": "keras.optimizers.SGD(..., clipnorm=1.0)",
            "trial": {"outcome": "fixed", "text": "Tried: clipnorm=1.0 kept 40 steps finite"},
        },
        {"id": "lr_warmup", "text": "Warm up", "trial": {"outcome": "not_tried", "text": "n"}},
        {"id": "lower_lr", "text": "Lower the lr", "trial": {"outcome": "not_fixed", "text": "d"}},
    ],
}


def test_the_text_reads_in_the_cards_order(logdir):
    """Headline, cause, the remedy shown to work with its trial and code, the
    other remedies, the evidence, then the incident's details (issue 56)."""
    from tb_nanwatch.board import report

    provider = report.load_provider(logdir)
    runs = report.load_runs(provider)
    lines = report.format_run(runs["a/big"], [], TRIED).splitlines()
    order = [
        "  First NaN at step 250, born in the forward phase at layer model/block0/layer3",
        "  cause (growth_overflow): The loss grew 1e26 times before it overflowed.",
        "  Shown to work on a re-run of your steps:",
        "    remedy 1: Clip the gradients",
        "      Tried: clipnorm=1.0 kept 40 steps finite",
        "      code:",
        "        keras.optimizers.SGD(..., clipnorm=1.0)",
        "  Other things we tried (2):",
        "    remedy 2: Warm up",
    ]
    assert lines[1 : 1 + len(order)] == order
    at = {
        name: next(i for i, line in enumerate(lines) if line.startswith(name))
        for name in (
            "    remedy 3: ",
            "  evidence: ",
            "  first non-finite: ",
            "  explosion onset: ",
        )
    }
    assert list(at.values()) == sorted(at.values()), at
    nothing = {**TRIED, "remedies": TRIED["remedies"][2:] + TRIED["remedies"][1:2]}
    lines = report.format_cause(nothing)
    assert lines[1:3] == [
        "  Nothing we tried fixed the run; what to try first:",
        "    remedy 1: Lower the lr",
    ]
    assert "  Other things to try (1):" in lines  # the one left was not tried
