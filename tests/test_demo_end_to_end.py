"""The demo runs, end to end: written by the real callback, diagnosed by the
report CLI, served by a real TensorBoard and shown in headless Chromium.

Ground truth comes from how each demo was built (see each demo's docstring):
seed 000 pads batch 37 with all-zero images inside a nested base model, seed 002
raises its learning rate past stability at step 60 and never goes non-finite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from nanwatch_testlib import canvas_ink
from test_browser import (
    Watched,
    _get_json,
    browser,  # noqa: F401 (a fixture this module uses)
    tensorboard,
)

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def demo_logs(tmp_path_factory) -> Path:
    logdir = tmp_path_factory.mktemp("demo_logs")
    subprocess.run(
        [
            sys.executable,
            "demo/run_all.py",
            "--logdir",
            str(logdir),
            "--only",
            "seed000_nested_sigmoid_bce",
            "seed002_explosion_no_nan",
            "healthy",
        ],
        cwd=ROOT,
        check=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    return logdir


def test_report_diagnoses_the_demo_runs(demo_logs):
    out = subprocess.run(
        [sys.executable, "-m", "tb_nanwatch.cli", "report", str(demo_logs), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    runs = {r["run"]: r for r in json.loads(out.stdout)["runs"]}
    seed000 = runs["seed000_nested_sigmoid_bce"]["first_nonfinite"]
    assert (seed000["step"], seed000["phase"], seed000["layer"], seed000["kind"]) == (
        37,
        "forward",
        "base_model/per_image_std",
        "nan",
    )
    seed002 = runs["seed002_explosion_no_nan"]
    assert seed002["first_nonfinite"] is None
    assert 60 <= seed002["explosion"]["step"] <= 75
    assert runs["healthy"]["first_nonfinite"] is None and runs["healthy"]["explosion"] is None


def test_tensorboard_and_browser_show_the_demo_incident(browser, demo_logs, tmp_path):  # noqa: F811
    watched = Watched(browser)
    try:
        with tensorboard(demo_logs, tmp_path, want_runs=3) as base:
            listing = _get_json(f"{base}/data/plugins_listing")
            assert listing["nanwatch"]["enabled"] is True
            frame = watched.open_tab(base)
            panel = frame.locator('.run-panel[data-run="seed000_nested_sigmoid_bce"]')
            panel.wait_for(timeout=30000)
            card = panel.locator(".incident-card")
            card.locator("[data-field=step]").wait_for(timeout=30000)
            assert card.locator("[data-field=step]").inner_text().strip() == "37"
            assert (
                card.locator("[data-field=layer]").inner_text().strip()
                == "base_model/per_image_std"
            )
            heatmap = panel.locator(".heatmap")
            heatmap.locator("canvas").first.wait_for(timeout=30000)
            assert heatmap.get_attribute("data-origin-step") == "37"
            assert heatmap.get_attribute("data-origin-layer") == "base_model/per_image_std"
            assert canvas_ink(panel, ".timeline canvas") > 1000
            os.makedirs(ROOT / "test-artifacts", exist_ok=True)
            watched.page.screenshot(path=str(ROOT / "test-artifacts" / "demo.png"), full_page=True)
        assert watched.errors == []
    finally:
        watched.close()
