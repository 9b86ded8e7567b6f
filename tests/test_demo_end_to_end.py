"""The six demo runs, end to end: written by the real callback (run_all.py, as
the README's demo command runs them), diagnosed by the report CLI, served by a
real TensorBoard and shown in headless Chromium.

Ground truth comes from how each demo was built (see each demo's docstring):
seed 000 pads batch PAD_STEP with all-zero images inside a nested base model;
seed 001 sharpens its logits from SHARPEN_FROM on and mislabels batch
MISLABELED_STEP; seed 002 raises its learning rate past stability at JUMP_STEP
and never goes non-finite; seed 003 puts an all-zero row in step ZERO_STEP (in TF2 and
as the seed's own TF1 graph code); the healthy run trains STEPS steps with
nothing wrong.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from statistics import median

import pytest
from nanwatch_testlib import canvas_ink
from test_browser import (
    Watched,
    _get_json,
    browser,  # noqa: F401 (a fixture this module uses)
    tensorboard,
)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from demo import (  # noqa: E402
    healthy_run,
    run_all,
    seed000_nested_sigmoid_bce,
    seed002_explosion_no_nan,
)
from demo import seed001_lstm_attention_log0 as seed001  # noqa: E402
from demo import seed003_custom_loop_autoencoder as seed003  # noqa: E402

SEED000 = "seed000_nested_sigmoid_bce"
SEED001 = "seed001_lstm_attention_log0"
SEED002 = "seed002_explosion_no_nan"
SEED003 = "seed003_custom_loop_autoencoder"
SEED003_TF1 = "seed003_tf1_graph_autoencoder"

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> tuple[Path, str]:
    """All six demos written by run_all.py; (log dir, what it printed)."""
    logdir = tmp_path_factory.mktemp("demo_logs")
    result = subprocess.run(
        [sys.executable, "demo/run_all.py", "--logdir", str(logdir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
        timeout=800,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return logdir, result.stdout


@pytest.fixture(scope="module")
def report(demo_run) -> dict[str, dict]:
    out = subprocess.run(
        [sys.executable, "-m", "tb_nanwatch.cli", "report", str(demo_run[0]), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    return {r["run"]: r for r in json.loads(out.stdout)["runs"]}


@pytest.fixture(scope="module")
def served(demo_run, tmp_path_factory):
    with tensorboard(demo_run[0], tmp_path_factory.mktemp("tb"), want_runs=5) as base:
        yield base


def route(base: str, name: str, run: str, **params) -> dict:
    query = "".join(f"&{key}={value}" for key, value in params.items())
    return _get_json(f"{base}/data/plugin/nanwatch/{name}?run={run}{query}")


def finite(values) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def test_every_demo_is_run_and_said_in_words(demo_run, report):
    printed = demo_run[1]
    assert sorted(report) == sorted(run_all.SCENARIOS)
    for name in run_all.SCENARIOS:
        said = [x for x in printed.splitlines() if f"] {name}: " in x]
        assert said[0].endswith(f"] {name}: starting"), said
        (line,) = [x for x in said[1:] if not re.search(r": step \d+/\d+$", x)]
        assert "{" not in line and "None" not in line, line
    lines = {
        f"{SEED000}: first non-finite at step {seed000_nested_sigmoid_bce.PAD_STEP}, "
        "phase forward, layer base_model/per_image_std (nan)",
        f"{SEED001}: first non-finite at step {seed001.MISLABELED_STEP}, phase loss (inf)",
        f"{SEED003}: first non-finite at step {seed003.ZERO_STEP}, phase backward, "
        "layer code_norm (nan)",
        f"healthy: no NaN/Inf and no explosion in {healthy_run.STEPS} steps",
    }
    for expected in lines:
        assert expected in printed, printed
    assert f"{SEED002}: no NaN/Inf in " in printed


def test_seed000_nan_in_the_nested_layer_at_the_padded_batch(report, served):
    first = report[SEED000]["first_nonfinite"]
    pad = seed000_nested_sigmoid_bce.PAD_STEP
    assert (first["step"], first["phase"], first["layer"], first["kind"]) == (
        pad,
        "forward",
        "base_model/per_image_std",
        "nan",
    )
    columns = route(served, "timeline", SEED000)["columns"]
    for name in ("logit_min", "logit_max", "grad_norm", "loss"):
        assert finite(columns[name][:pad]), name


def test_seed001_the_loss_is_born_inf_after_the_logits_climbed(report, served):
    first = report[SEED001]["first_nonfinite"]
    bad = seed001.MISLABELED_STEP
    assert (first["step"], first["phase"], first["layer"], first["kind"]) == (
        bad,
        "loss",
        None,
        "inf",
    )
    timeline = route(served, "timeline", SEED001)
    assert timeline["bucket"] == 1 and timeline["steps"][:bad] == list(range(bad))
    columns = timeline["columns"]
    for name in ("logit_min", "logit_max", "grad_norm", "loss"):
        assert finite(columns[name][:bad]), name
    logit_max = columns["logit_max"]
    before = median(logit_max[seed001.SHARPEN_FROM - 50 : seed001.SHARPEN_FROM])
    assert logit_max[bad - 1] > 10 * before
    windows = [
        median(logit_max[start : start + 10]) for start in range(seed001.SHARPEN_FROM, bad, 10)
    ]
    assert windows == sorted(windows) and len(set(windows)) == len(windows), windows
    rows = route(served, "step", SEED001, step=bad)["rows"]
    forward = [row for row in rows if row["phase"] == "forward"]
    assert forward and all(row["nan"] == 0 and row["inf"] == 0 for row in forward), forward


def test_seed002_explodes_after_the_learning_rate_jump_without_nan(report, served):
    seed002 = report[SEED002]
    jump = seed002_explosion_no_nan.JUMP_STEP
    assert seed002["first_nonfinite"] is None
    assert jump <= seed002["explosion"]["step"] <= jump + 15
    columns = route(served, "timeline", SEED002)["columns"]
    assert finite(columns["loss"]) and max(columns["loss"]) > 1e6 * columns["loss"][jump - 1]


def test_seed003_nan_is_born_in_the_backward_pass_of_the_zero_row(report):
    first = report[SEED003]["first_nonfinite"]
    truth = seed003.TRUTH
    assert {key: first[key] for key in ("step", "phase", "layer", "tensor", "kind")} == {
        key: truth[key] for key in ("step", "phase", "layer", "tensor", "kind")
    }


def test_seed003_names_the_op_and_its_source_line(report):
    op = report[SEED003]["first_nonfinite"]["op"]  # the demo passes loss_fn: the replay ran
    assert op and op["type"] and op["name"], op
    assert op["source"] and "seed003_custom_loop_autoencoder.py:" in op["source"], op


def test_seed003_as_tf1_graph_code_finds_the_same_origin(report):
    first = report[SEED003_TF1]["first_nonfinite"]
    assert (first["step"], first["phase"], first["layer"]) == (
        seed003.ZERO_STEP,
        "backward",
        "code_norm",
    )


def test_seed002_remedies_were_tried_from_a_rewind_point(report):
    remedies = report[SEED002]["cause"]["remedies"]
    trials = {r["id"]: r["trial"] for r in remedies}
    assert "fix_schedule" in trials, trials  # the rate jump is in the verdict
    assert all(t and t["outcome"] in ("fixed", "not_fixed", "not_tried") for t in trials.values())
    assert any(t["outcome"] == "fixed" for t in trials.values()), trials
    outcomes = [r["trial"]["outcome"] for r in remedies]
    order = {"fixed": 0, "not_tried": 1, "not_fixed": 2}
    assert outcomes == sorted(outcomes, key=order.get), outcomes  # working remedies first


def test_the_healthy_run_is_healthy(report):
    healthy = report["healthy"]
    assert healthy["first_nonfinite"] is None and healthy["explosion"] is None
    assert healthy["warnings"] == []  # no early warning on a healthy run
    assert healthy["steps"] == healthy_run.STEPS


def test_tensorboard_and_browser_show_the_demo_incident(browser, served):  # noqa: F811
    watched = Watched(browser)
    try:
        listing = _get_json(f"{served}/data/plugins_listing")
        assert listing["nanwatch"]["enabled"] is True
        frame = watched.open_tab(served)
        panel = frame.locator(f'.run-panel[data-run="{SEED000}"]')
        panel.wait_for(timeout=30000)
        card = panel.locator(".incident-card")
        card.locator("[data-field=step]").wait_for(timeout=30000)
        pad = str(seed000_nested_sigmoid_bce.PAD_STEP)
        assert card.locator("[data-field=step]").inner_text().strip() == pad
        assert card.locator("[data-field=layer]").inner_text().strip() == "base_model/per_image_std"
        heatmap = panel.locator(".heatmap")
        heatmap.locator("canvas").first.wait_for(timeout=30000)
        assert heatmap.get_attribute("data-origin-step") == pad
        assert heatmap.get_attribute("data-origin-layer") == "base_model/per_image_std"
        assert canvas_ink(panel, ".timeline canvas") > 1000
        os.makedirs(ROOT / "test-artifacts", exist_ok=True)
        watched.page.screenshot(path=str(ROOT / "test-artifacts" / "demo.png"), full_page=True)
        assert watched.errors == []
    finally:
        watched.close()
