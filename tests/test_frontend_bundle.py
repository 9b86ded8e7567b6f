"""The committed frontend bundle (tb_nanwatch/board/static/) is fresh and
self-contained, and the frontend renders the vocabulary Python sends.

Freshness: when npm and frontend/node_modules exist, the build is run into a
temporary directory and compared byte-for-byte with the committed files. CI
runs ``npm ci`` first and sets ``NANWATCH_REQUIRE_NPM=1``, which turns a
missing toolchain into a failure instead of a skip.

Vocabulary: the labels, the JSON keys that hold text and the non-finite words
come from ``tb_nanwatch.evidence.vocabulary`` (the ``vocabulary`` route); the
frontend's modules are driven in node with that vocabulary, and with altered
ones, to show that what they print follows what they are given.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from nanwatch_testlib import PLUGIN, get_json, make_client, multiplexer_provider, run_node_module

from tb_nanwatch.evidence import causes, remedies
from tb_nanwatch.evidence.vocabulary import vocabulary

ROOT = Path(__file__).resolve().parents[1]
FRONTEND = ROOT / "frontend"
STATIC = ROOT / "tb_nanwatch" / "board" / "static"
BUNDLE_FILES = ("index.js", "style.css")
# What the tab may weigh: uPlot (about 50 KB minified), the viridis scale of
# d3-scale-chromatic (about 6 KB) and the tab's own modules.
BUNDLE_BUDGET = {"index.js": 128 * 1024, "style.css": 32 * 1024}


def _require_npm() -> bool:
    return os.environ.get("NANWATCH_REQUIRE_NPM", "") not in ("", "0")


def _missing_toolchain() -> str | None:
    if shutil.which("npm") is None:
        return "npm is not on PATH"
    if not (FRONTEND / "node_modules" / "esbuild").is_dir():
        return "frontend/node_modules is missing: run `cd frontend && npm ci`"
    return None


def test_bundle_files_exist_within_budget():
    for name in BUNDLE_FILES:
        path = STATIC / name
        assert path.is_file(), f"{path} missing: run `cd frontend && npm ci && npm run build`"
        assert 0 < path.stat().st_size <= BUNDLE_BUDGET[name], (name, path.stat().st_size)


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
    assert "[WARNING]" not in result.stdout + result.stderr, "esbuild warned:\n" + result.stderr
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


def _node_with_vocabulary(vocab: dict, body: str):
    """Runs ``body`` in node after ``useVocabulary(VOCAB)``; returns what it printed."""
    script = (
        'import { useVocabulary } from "./src/vocabulary.js";\n'
        f"const VOCAB = {json.dumps(vocab)};\n"
        "useVocabulary(VOCAB);\n"
    )
    return run_node_module(script + body)


REVIVE = """
  import { revive } from "./src/api.js";
  const out = revive({
    columns: { loss: [1, "NaN", "Infinity", "-Infinity", "nan!"] },
    run: "NaN", layers: ["Infinity"], hints: [{ title: "NaN", evidence: { x: "NaN" } }],
    fresh_key: "NaN",
  });
  console.log(JSON.stringify({
    loss: out.columns.loss.map((v) => [typeof v, String(v)]), run: out.run, layers: out.layers,
    title: out.hints[0].title, evidence: String(out.hints[0].evidence.x),
    fresh: [typeof out.fresh_key, String(out.fresh_key)],
  }));
"""


def test_revive_restores_the_vocabularys_non_finite_words_but_not_names():
    """api.js: the words Python sends become numbers, except under its text keys."""
    out = _node_with_vocabulary(vocabulary(), REVIVE)
    assert out["loss"] == [
        ["number", "1"],
        ["number", "NaN"],
        ["number", "Infinity"],
        ["number", "-Infinity"],
        ["string", "nan!"],
    ]
    assert (out["run"], out["layers"], out["title"]) == ("NaN", ["Infinity"], "NaN")
    assert out["evidence"] == "NaN"  # evidence values are numbers or text: revived
    assert out["fresh"] == ["number", "NaN"]


def test_revive_follows_a_changed_vocabulary():
    """A new text key keeps its "NaN"; new non-finite words are the ones revived."""
    vocab = vocabulary()
    vocab["text_keys"] = [*vocab["text_keys"], "fresh_key"]
    vocab["non_finite"] = {**vocab["non_finite"], "nan": "nan!"}
    out = _node_with_vocabulary(vocab, REVIVE)
    assert out["fresh"] == ["string", "NaN"]
    assert out["loss"][1] == ["string", "NaN"]  # no longer the word for NaN
    assert out["loss"][4] == ["number", "NaN"]
    assert out["run"] == "NaN"


def test_labels_are_the_vocabularys():
    """Cause, incident-kind and phase labels, and the run list's cause line, as sent."""
    vocab = vocabulary()
    vocab["causes"]["brand_new_cause"] = "A cause only the vocabulary knows"
    vocab["causes"]["growth_overflow"] = "Relabelled by Python"
    vocab["incident_kinds"]["nan"] = "Not a Number"
    vocab["phases"]["forward"] = "forward pass"
    body = """
      import { causeLabel, causeLine } from "./src/cause.js";
      import { runStatus } from "./src/run_selector.js";
      import { kindLabel } from "./src/vocabulary.js";
      console.log(JSON.stringify({
        fresh: causeLabel("brand_new_cause"), relabelled: causeLabel("growth_overflow"),
        outside: causeLabel("not_in_the_vocabulary"),
        line: causeLine({ id: "brand_new_cause", summary: "it grew" }),
        kind: kindLabel("nan"),
        status: runStatus({ run: "r", steps: 9, status: "stopped", skipped_count: 0,
                            first_nonfinite: { kind: "nan", step: 3, phase: "forward", layer: "d" } }).text,
      }));
    """
    out = _node_with_vocabulary(vocab, body)
    assert out["fresh"] == "A cause only the vocabulary knows"
    assert out["relabelled"] == "Relabelled by Python"
    assert out["outside"] == "not_in_the_vocabulary"
    assert out["line"] == "A cause only the vocabulary knows: it grew"
    assert out["kind"] == "Not a Number"
    assert out["status"].startswith("first Not a Number at step 3 (forward pass in d)")


def test_vocabulary_route_answers_every_cause_and_remedy(tmp_path):
    """The plugin serves the vocabulary as JSON: every cause id of causes.py in
    its order, every remedy, and the words TensorBoard writes for NaN/±Inf."""
    from tensorboard.backend import json_util

    logdir = str(tmp_path)
    body = get_json(make_client(multiplexer_provider(logdir), logdir), f"{PLUGIN}/vocabulary")
    assert body == json.loads(json.dumps(vocabulary()))
    assert list(body["causes"]) == list(causes.CAUSE_LABELS)
    assert body["causes"] == causes.CAUSE_LABELS
    assert body["remedies"] == remedies.REMEDY_LABELS
    cleansed = json_util.Cleanse([math.nan, math.inf, -math.inf])
    words = body["non_finite"]
    assert cleansed == [words["nan"], words["posinf"], words["neginf"]]
    assert {"run", "layer", "tensor", "phase"} <= set(body["text_keys"])


def _strings_outside_text_keys(value, vocab: dict, where: str = "") -> list[str]:
    """Where a string sits that the frontend would not keep as text: outside
    every text key and not a non-finite word (free-form evidence excepted)."""
    if isinstance(value, str):
        return [] if value in vocab["non_finite"].values() else [f"{where}={value!r}"]
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return []
    found = []
    for key, item in items:
        if key in vocab["text_keys"] or key == "evidence":
            continue
        found += _strings_outside_text_keys(item, vocab, f"{where}/{key}")
    return found


def test_text_keys_cover_every_string_of_the_routes(tmp_path):
    """Every string the routes answer for a broken and a healthy run sits
    under a text key, so a name that reads "NaN" is never turned into NaN."""
    from tb_nanwatch.record.writing.synthetic import write_synthetic_run

    write_synthetic_run(str(tmp_path / "broken"), 60, incident_step=40, snapshot_every=20)
    write_synthetic_run(str(tmp_path / "healthy"), 30, num_layers=2)
    client = make_client(multiplexer_provider(str(tmp_path)), str(tmp_path))
    vocab = get_json(client, f"{PLUGIN}/vocabulary")
    answers = [get_json(client, f"{PLUGIN}/runs")]
    for run in ("broken", "healthy"):
        answers.append(get_json(client, f"{PLUGIN}/timeline?run={run}"))
        answers.append(get_json(client, f"{PLUGIN}/incident?run={run}"))
    answers.append(get_json(client, f"{PLUGIN}/step?run=broken&step=40"))
    assert answers[2]["incident"]["kind"]  # the broken run has an incident, with a cause
    assert answers[2]["cause"]["id"] in vocab["causes"]
    assert _strings_outside_text_keys(answers, vocab) == []


def _listed_ids(text: str, ids) -> list[str]:
    return [i for i in ids if re.search(rf"(?<![A-Za-z0-9_]){re.escape(i)}(?![A-Za-z0-9_])", text)]


def test_no_frontend_module_lists_cause_or_remedy_ids():
    """The frontend keeps no vocabulary: no module names three or more cause
    (or remedy) ids; one or two (e.g. "unknown") may be special-cased."""
    vocab = vocabulary()
    sources = sorted((FRONTEND / "src").rglob("*.js"))
    assert sources
    for table in ("causes", "remedies"):
        ids = list(vocab[table])
        assert ids, table
        for path in sources:
            found = _listed_ids(path.read_text(encoding="utf-8"), ids)
            assert len(found) < 3, (
                f"{path.name} lists {table} ids {found}: take them from the vocabulary"
            )


def test_the_id_scan_would_catch_a_list():
    """The scan above finds a hard-coded table like the one cause.js used to hold."""
    table = "const LABELS = {\n" + "".join(f'  {i}: "x",\n' for i in causes.CAUSE_LABELS) + "};"
    assert len(_listed_ids(table, causes.CAUSE_LABELS)) == len(causes.CAUSE_LABELS)


def test_pure_view_helpers():
    """heatmap/download/run_selector/step_table helpers, run in node."""
    script = """
      import { colorAt, initialMetric, labelledColumns } from "./src/heatmap.js";
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
        colors: [-1, 0, 0.5, 1, 2].map(colorAt),
      }));
    """
    out = _node_with_vocabulary(vocabulary(), script)
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
    # Viridis, clamped at both ends: dark purple, teal, yellow.
    low, zero, mid, high, over = out["colors"]
    assert (low, zero, high, over) == ("#440154", "#440154", "#fde725", "#fde725")
    assert mid == "#21918c"


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
