"""Frontend helpers run in node (marker labels in rows that never overlap,
counts with their noun, the CSV download's cells) and the build's npm
configuration (``npm ci`` prints no warning about esbuild's install script)."""

from __future__ import annotations

import json
from pathlib import Path

from nanwatch_testlib import run_node_module

FRONTEND = Path(__file__).resolve().parents[1] / "frontend"


def _overlap(a: dict, b: dict, height: float = 1.0) -> bool:
    """Whether two placed labels (left, width, row) share any pixel."""
    same_row = abs(a["row"] - b["row"]) < height
    return same_row and a["left"] < b["left"] + b["width"] and b["left"] < a["left"] + a["width"]


def test_marker_labels_never_overlap():
    cases = [
        [{"x": 100, "width": 140}, {"x": 104, "width": 160}],  # two steps apart
        [{"x": 300, "width": 120}, {"x": 300, "width": 120}],  # the same step
        [{"x": 590, "width": 150}, {"x": 595, "width": 150}],  # at the right edge
        [{"x": 10, "width": 50}, {"x": 400, "width": 50}],  # far apart: one row
    ]
    script = (
        'import { placeLabels } from "./src/timeline_plot.js";\n'
        f"const cases = {json.dumps(cases)};\n"
        "console.log(JSON.stringify(cases.map((c) => placeLabels(c, 600))));"
    )
    placed = run_node_module(script)
    for labels, spots in zip(cases, placed, strict=True):
        boxes = [{**s, "width": label["width"]} for label, s in zip(labels, spots, strict=True)]
        assert not _overlap(*boxes), boxes
        for box in boxes:
            assert 0 <= box["left"] and box["left"] + box["width"] <= 600, box
    assert [s["row"] for s in placed[3]] == [0, 0]
    # At the right edge a label sits left of its line.
    assert placed[2][0]["left"] + 150 <= 590


def test_counts_and_csv_cells():
    out = run_node_module("""
      import { counted } from "./src/format.js";
      import { timelineCsv } from "./src/download.js";
      const tl = { steps: [0], bucket: 1, end: 1, columns: { "=cmd|' /c calc'!A0": [-1.5] } };
      console.log(JSON.stringify({
        counts: [counted(1, "step"), counted(2, "step"), counted(0, "run"), counted(1, "tensor")],
        csv: timelineCsv(tl),
      }));
    """)
    assert out["counts"] == ["1 step", "2 steps", "0 runs", "1 tensor"]
    header, row = out["csv"].splitlines()
    assert header == "step,'=cmd|' /c calc'!A0"  # a formula is written as text
    assert row == "0,-1.5"  # a negative number stays a number


def test_every_install_script_of_the_lock_is_allowed_or_denied():
    """npm 11 warns about dependencies whose install scripts package.json does
    not mention (`allowScripts`); esbuild's postinstall is the one there is."""
    package = json.loads((FRONTEND / "package.json").read_text())
    lock = json.loads((FRONTEND / "package-lock.json").read_text())
    with_scripts = {
        path.rsplit("node_modules/", 1)[-1]
        for path, entry in lock["packages"].items()
        if path and entry.get("hasInstallScript")
    }
    assert with_scripts == {"esbuild"}, with_scripts
    allowed = package.get("allowScripts", {})
    assert all(name in allowed for name in with_scripts), allowed


def test_the_right_axis_says_outputs_for_a_regression_and_logits_otherwise():
    script = (
        'import { outputWords } from "./src/timeline_plot.js";\n'
        'console.log(JSON.stringify(["outputs", "logits", undefined].map(outputWords)));'
    )
    outputs, logits, unknown = run_node_module(script)
    assert outputs["right"] == "output min, max (symlog)"
    assert (
        "output max (right)" in outputs["series"] and "logit max (right)" not in outputs["series"]
    )
    assert logits["right"] == "logit min, max (symlog)" and "logit min (right)" in logits["series"]
    assert unknown == logits  # a run written before the route said: as before
