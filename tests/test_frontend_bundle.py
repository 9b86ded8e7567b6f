"""The committed frontend bundle (tb_nanwatch/board/static/) is fresh and self-contained.

Freshness: when npm and frontend/node_modules exist, the build is run into a
temporary directory and compared byte-for-byte with the committed files. CI
runs ``npm ci`` first and sets ``NANWATCH_REQUIRE_NPM=1``, which turns a
missing toolchain into a failure instead of a skip.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from nanwatch_testlib import run_node_module

ROOT = Path(__file__).resolve().parents[1]
FRONTEND = ROOT / "frontend"
STATIC = ROOT / "tb_nanwatch" / "board" / "static"
BUNDLE_FILES = ("index.js", "style.css")


def _require_npm() -> bool:
    return os.environ.get("NANWATCH_REQUIRE_NPM", "") not in ("", "0")


def _missing_toolchain() -> str | None:
    if shutil.which("npm") is None:
        return "npm is not on PATH"
    if not (FRONTEND / "node_modules" / "esbuild").is_dir():
        return "frontend/node_modules is missing: run `cd frontend && npm ci`"
    return None


def test_bundle_files_exist():
    for name in BUNDLE_FILES:
        path = STATIC / name
        assert path.is_file(), f"{path} missing: run `cd frontend && npm ci && npm run build`"
        assert path.stat().st_size > 0


def test_bundle_is_not_stale(tmp_path):
    missing = _missing_toolchain()
    if missing:
        if _require_npm():
            pytest.fail(f"NANWATCH_REQUIRE_NPM=1 but {missing}")
        pytest.skip(missing)
    out = tmp_path / "static"
    result = subprocess.run(
        ["npm", "run", "--silent", "build", "--", str(out)],
        cwd=FRONTEND,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"npm run build failed:\n{result.stdout}\n{result.stderr}"
    for name in BUNDLE_FILES:
        built = (out / name).read_bytes()
        committed = (STATIC / name).read_bytes()
        assert built == committed, (
            f"tb_nanwatch/board/static/{name} is stale: rebuild with "
            "`cd frontend && npm ci && npm run build` and commit the result"
        )


def test_lockfile_pins_exact_versions():
    package = json.loads((FRONTEND / "package.json").read_text())
    assert (FRONTEND / "package-lock.json").is_file()
    for section in ("dependencies", "devDependencies"):
        for name, version in package.get(section, {}).items():
            assert re.fullmatch(r"\d+\.\d+\.\d+", version), (
                f"{name}@{version} is not pinned exactly"
            )
    assert "uplot" in package["dependencies"]
    assert "esbuild" in package["devDependencies"]


# A URL the browser would fetch at runtime: in a string literal, a CSS url(),
# an import, or a src/href. Plain mentions inside comments are not in the
# minified bundle, so any http(s) URL at all is treated as suspect.
_REMOTE_URL = re.compile(rb"https?://", re.IGNORECASE)
_ABSOLUTE_DATA = re.compile(rb"""["'`(]\s*/data/""")
_PROTOCOL_RELATIVE = re.compile(rb"""(?:url\(|["'`])\s*//[A-Za-z0-9]""")


@pytest.mark.parametrize("name", BUNDLE_FILES)
def test_bundle_fetches_nothing_remote(name):
    data = (STATIC / name).read_bytes()
    found = [m.group(0) + data[m.end() : m.end() + 60] for m in _REMOTE_URL.finditer(data)]
    assert not found, f"{name} mentions remote URLs (CDN?): {found[:5]}"
    assert not _PROTOCOL_RELATIVE.search(data), f"{name} has a protocol-relative URL"


@pytest.mark.parametrize("name", BUNDLE_FILES)
def test_bundle_uses_relative_data_urls(name):
    data = (STATIC / name).read_bytes()
    assert not _ABSOLUTE_DATA.search(data), (
        f"{name} has an absolute /data/ URL (breaks --path_prefix)"
    )


def test_bundle_exports_render_and_loads_relative_stylesheet():
    js = (STATIC / "index.js").read_bytes()
    assert re.search(rb"export\s*\{[^}]*\bas render\b|export\s*\{[^}]*\brender\b", js), (
        "index.js must export render()"
    )
    assert b'"style.css"' in js, "index.js must load style.css by a relative URL"
    assert b"innerHTML" not in js, "render text with textContent, never innerHTML"
    css = (STATIC / "style.css").read_bytes()
    assert b".uplot" in css, "style.css must include uPlot's stylesheet"


def test_revive_restores_non_finite_numbers_but_not_names():
    """api.js: "NaN"/"Infinity"/"-Infinity" become numbers, except under name keys."""
    script = """
      import { revive } from "./src/api.js";
      const out = revive({
        columns: { loss: [1, "NaN", "Infinity", "-Infinity"] },
        run: "NaN", layers: ["Infinity"], hints: [{ title: "NaN", evidence: { x: "NaN" } }],
      });
      console.log(JSON.stringify({
        loss: out.columns.loss.map(String), run: out.run, layers: out.layers,
        title: out.hints[0].title, evidence: String(out.hints[0].evidence.x),
      }));
    """
    assert run_node_module(script) == {
        "loss": ["1", "NaN", "Infinity", "-Infinity"],
        "run": "NaN",
        "layers": ["Infinity"],
        "title": "NaN",
        "evidence": "NaN",
    }


def test_pure_view_helpers():
    """heatmap/download/run_selector/step_table helpers, run in node."""
    script = """
      import { initialMetric, labelledColumns } from "./src/heatmap.js";
      import { timelineCsv } from "./src/download.js";
      import { runFilter } from "./src/run_selector.js";
      import { isOriginRow } from "./src/step_table.js";
      const steps = Array.from({ length: 40 }, (_, i) => 10000 + i);
      const cols = labelledColumns(steps, 8, 37);
      const gaps = cols.slice(1).map((c, i) => (c - cols[i]) * 8);
      const tl = { steps: [0, 1], bucket: 1, end: 2,
                   columns: { loss: [0.5, NaN], grad_norm: [Infinity, null] } };
      const inc = { step: 3, phase: "loss", layer: null, tensor: "total loss" };
      console.log(JSON.stringify({
        backward: initialMetric({ phase: "backward" }), forward: initialMetric({ phase: "forward" }),
        none: initialMetric(null), hasOrigin: cols.includes(37), minGap: Math.min(...gaps),
        csv: timelineCsv(tl),
        regex: runFilter("^a|c$").matches("xc"), text: runFilter("b(").matches("ab(c"),
        invalid: runFilter("b(").valid,
        origin: isOriginRow({ phase: "loss", layer: null, tensor: "total loss" }, inc, 3),
        otherStep: isOriginRow({ phase: "loss", layer: null, tensor: "total loss" }, inc, 4),
      }));
    """
    out = run_node_module(script)
    assert (out["backward"], out["forward"], out["none"]) == (
        "grad_norm",
        "forward_max_abs",
        "forward_max_abs",
    )
    assert out["hasOrigin"]
    assert out["minGap"] >= 5 * 6.5  # five-digit labels never overlap
    assert out["csv"] == "step,loss,grad_norm\n0,0.5,Infinity\n1,NaN,\n"
    assert out["regex"] and out["text"] and out["invalid"] is False
    assert out["origin"] and not out["otherStep"]


def test_a_download_joins_exact_windows_and_keeps_non_finite_values():
    """A run longer than the route's cap is downloaded in exact windows."""
    script = """
      import { joinWindows } from "./src/timeline_data.js";
      const part = (start, end, loss) => ({ run: "r", start, end, bucket: 1, total_steps: 5,
        steps: Array.from({ length: end - start }, (_, i) => start + i), columns: { loss } });
      const whole = joinWindows([part(0, 2, [1, NaN]), part(2, 4, [Infinity, 2]), part(4, 5, [3])]);
      console.log(JSON.stringify({ steps: whole.steps, loss: whole.columns.loss.map(String),
                                   start: whole.start, end: whole.end, bucket: whole.bucket }));
    """
    out = run_node_module(script)
    assert out == {
        "steps": [0, 1, 2, 3, 4],
        "loss": ["1", "NaN", "Infinity", "2", "3"],
        "start": 0,
        "end": 5,
        "bucket": 1,
    }
