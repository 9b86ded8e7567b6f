"""Limits, checked before the work: a small file never costs a large amount of
memory or time, and one run beyond a limit never hides the others.

Each attack is a run dir written by the project's own writers, then tampered
with; ``tb-nanwatch`` opens it in a guarded interpreter (closed_box_lib) that
measures the peak memory of each command. The limits are those of
``tb_nanwatch.evidence.limits``, stated in docs/reference/limits.md (checked
here against the code).
"""

from __future__ import annotations

import json
import os
import shutil
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from closed_box_lib import (
    MEMORY_BOUND_MB,
    REPORT_PEAK_MB,
    assert_contained,
    edit_bundle_json,
    good_runs,
    guarded_cli,
    input_incident,
    override_summary,
    refusal_lines,
    write_npz_bomb,
)
from nanwatch_testlib import PLUGIN, data_server_provider, get_json, make_client, route_client
from tensorboard.compat.proto import tensor_pb2, tensor_shape_pb2, types_pb2

from tb_nanwatch.board import reader
from tb_nanwatch.evidence import limits, metadata
from tb_nanwatch.record.after_incident import bundle
from tb_nanwatch.record.writing.event_writer import RunWriter, _string_tensor, json_dumps
from tb_nanwatch.record.writing.synthetic import write_synthetic_run

BUNDLE = "repro/step_000000008"
LIMITS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "reference" / "limits.md"


@pytest.fixture(scope="module")
def npz_bomb(tmp_path_factory) -> str:
    """A 1 MB ``.npz`` whose array ``batch/0`` inflates to 1 GiB."""
    path = str(tmp_path_factory.mktemp("bomb") / "bundle.npz")
    write_npz_bomb(path, "batch/0", gib=1.0)
    assert os.path.getsize(path) < 2 * 2**20
    return path


def _bundle_of_input_incident(run_dir: str, steps: int = 12) -> str:
    """A run whose incident is born in the input (the report reads the
    bundle's batch then) with its bundle, as the project writes them."""
    override_summary(run_dir, {"first_nonfinite": input_incident(), "repro_bundle": BUNDLE})
    batch = [np.ones((2, 3), np.float32), np.ones((2, 1), np.float32)]
    weights = {"sequential/big/kernel": np.ones((3, 4), np.float32)}
    bundle.save_bundle(run_dir, 8, weights, batch, [0, 0], {"incident": input_incident()})
    return os.path.join(run_dir, BUNDLE)


def _json_runs(result: dict) -> dict[str, dict]:
    return {run["run"]: run for run in json.loads(result["out"])["runs"]}


def _bounded_report(result: dict) -> None:
    assert_contained(result)
    assert result["code"] == 0 and result["peak_mb"] < REPORT_PEAK_MB, result


# -- report --------------------------------------------------------------------------------


def test_an_npz_bomb_in_a_bundle_is_not_inflated_by_report(tmp_path, npz_bomb):
    logdir = str(tmp_path / "logs")
    good = good_runs(logdir)
    directory = _bundle_of_input_incident(os.path.join(logdir, "bomb"))
    shutil.copy(npz_bomb, os.path.join(directory, "bundle.npz"))
    text, as_json = guarded_cli([["report", logdir], ["report", logdir, "--json"]], [])
    for result in (text, as_json):
        _bounded_report(result)
    assert len(refusal_lines(text, "'bomb'", "bundle not read", "512 MB")) == 1, text["err"]
    runs = _json_runs(as_json)
    assert {name: runs[name]["steps"] for name in good} == good
    assert runs["bomb"]["first_nonfinite"]["phase"] == "input"


def _declared_series(run_dir: str, rows: int) -> int:
    """Appends a series chunk that declares ``rows`` rows of one value (what
    make_ndarray would expand); returns the bytes appended to the event file."""
    columns = len(
        write_synthetic_run(run_dir, 40, num_layers=2, incident_step=30)["series_columns"]
    )
    before = sum(os.path.getsize(os.path.join(run_dir, f)) for f in os.listdir(run_dir))
    tensor = tensor_pb2.TensorProto(
        dtype=types_pb2.DT_FLOAT,
        tensor_shape=tensor_shape_pb2.TensorShapeProto(
            dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=s) for s in (rows, columns)]
        ),
        float_val=[1.0],
    )
    writer = RunWriter(run_dir)
    writer._add(metadata.series_tag(0), metadata.KIND_SERIES, 0, tensor)
    writer.close()
    return sum(os.path.getsize(os.path.join(run_dir, f)) for f in os.listdir(run_dir)) - before


def test_a_tensor_declaring_a_gigabyte_is_never_expanded(tmp_path):
    logdir = str(tmp_path / "logs")
    good = good_runs(logdir)
    appended = _declared_series(os.path.join(logdir, "one_gb"), 22_369_622)  # 1 GiB declared
    appended += _declared_series(os.path.join(logdir, "rows_1e8"), 100_000_000)
    assert appended < 2 * 4096  # a few kilobytes
    text, as_json = guarded_cli([["report", logdir], ["report", logdir, "--json"]], [])
    for result in (text, as_json):
        _bounded_report(result)
    for name in ("one_gb", "rows_1e8"):
        assert len(refusal_lines(text, f"'{name}'", "declares", "not read")) == 1, text["err"]
    runs = _json_runs(as_json)
    assert {name: runs[name]["steps"] for name in good} == good
    for name in ("one_gb", "rows_1e8"):  # the run and its cause are still there
        assert runs[name]["first_nonfinite"]["step"] == 30
        assert runs[name]["cause"] is not None


def test_the_data_server_path_checks_declared_sizes_too(tmp_path, caplog):
    reader.skip_warnings.forget()
    logdir = str(tmp_path / "logs")
    good = good_runs(logdir)
    _declared_series(os.path.join(logdir, "one_gb"), 22_369_622)
    with data_server_provider(logdir, expect_runs=3) as provider:
        client = make_client(provider, logdir)
        tracemalloc.start()
        try:
            listed = get_json(client, f"{PLUGIN}/runs")
            client.get(f"{PLUGIN}/timeline?run=one_gb")
            client.get(f"{PLUGIN}/incident?run=one_gb")
            peak = tracemalloc.get_traced_memory()[1] / 2**20
        finally:
            tracemalloc.stop()
    assert peak < MEMORY_BOUND_MB
    assert type(provider).__name__ == "GrpcDataProvider"
    refused = [r.getMessage() for r in caplog.records if "declares" in r.getMessage()]
    assert len(refused) == 1 and "'one_gb'" in refused[0]
    steps = {run["run"]: run["steps"] for run in listed["runs"]}
    assert {name: steps[name] for name in good} == good and "one_gb" in steps


def test_a_billion_step_skipped_range_is_not_expanded(tmp_path):
    logdir = str(tmp_path / "logs")
    good = good_runs(logdir)
    override_summary(
        os.path.join(logdir, "billion"), {"steps": 10**9, "skipped_ranges": [[0, 10**9 - 1]]}
    )
    as_json, text = guarded_cli([["report", logdir, "--json"], ["report", logdir]], [])
    for result in (text, as_json):
        _bounded_report(result)
    lines = refusal_lines(as_json, "'billion'", "skipped_ranges", str(limits.MAX_SKIPPED_STEPS))
    assert len(lines) == 1, as_json["err"]
    runs = _json_runs(as_json)
    assert {name: run["steps"] for name, run in runs.items()} == good


def _deep_summary(run_dir: str, depth: int) -> None:
    summary = write_synthetic_run(run_dir, 12, num_layers=2)
    text = json_dumps(summary)[:-1] + ',"deep":' + "[" * depth + "]" * depth + "}"
    writer = RunWriter(run_dir)
    writer._add(metadata.TAG_RUN, metadata.KIND_RUN, 10**6, _string_tensor(text))
    writer.close()


def test_a_summary_nested_1e5_deep_hides_no_other_run(tmp_path):
    logdir = str(tmp_path / "logs")
    good = good_runs(logdir)
    _deep_summary(os.path.join(logdir, "deep"), 100_000)
    as_json, text = guarded_cli([["report", logdir, "--json"], ["report", logdir]], [])
    for result in (text, as_json):
        _bounded_report(result)
    assert len(refusal_lines(as_json, "'deep'", "nests", "64")) == 1, as_json["err"]
    assert {name: run["steps"] for name, run in _json_runs(as_json).items()} == good
    # The plugin's run list answers 200 with the good runs.
    reader.skip_warnings.forget()
    listed = get_json(route_client(logdir), f"{PLUGIN}/runs")
    assert {run["run"]: run["steps"] for run in listed["runs"]} == good


def test_json_depth_is_measured_without_recursion():
    assert limits.json_depth('{"a": [1, {"b": "[[[[ {{ ]]"}], "c": "\\"["}') == 3
    assert limits.json_depth("[" * 300_000 + "]" * 300_000) == 300_000
    with pytest.raises(limits.LimitError, match="nests 65 deep"):
        limits.loads_bounded("[" * 65 + "]" * 65, "a summary")
    assert limits.loads_bounded("[" * 64 + "]" * 64, "a summary") is not None


# -- replay --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def replay_limits(tmp_path_factory, npz_bomb):
    """Bundles beyond a limit, each replayed in one guarded interpreter."""
    logs = str(tmp_path_factory.mktemp("replay_limits") / "logs")
    dirs = {
        name: _bundle_of_input_incident(os.path.join(logs, name))
        for name in ("bomb", "deep_structure", "batch_size", "unknown_weight")
    }
    shutil.copy(npz_bomb, os.path.join(dirs["bomb"], "bundle.npz"))
    edit_bundle_json(dirs["bomb"], weights=[])  # the bomb holds the batch only
    deep = os.path.join(dirs["deep_structure"], "bundle.json")
    with open(deep) as f:
        text = f.read().replace('"batch_structure": [', '"batch_structure": ' + "[" * 100_000, 1)
    with open(deep, "w") as f:
        f.write(text.replace('"batch_size"', "0" + "]" * 100_000 + ', "batch_size"', 1))
    edit_bundle_json(dirs["batch_size"], batch_size=10**8)
    edit_bundle_json(dirs["unknown_weight"], weights=["sequential/big/kernel", "no/such/kernel"])
    names = list(dirs)
    results = guarded_cli([["replay", os.path.join(logs, n)] for n in names], [], tensorflow=True)
    return dict(zip(names, results, strict=True))


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("bomb", "512 MB of arrays"),
        ("deep_structure", "nests"),
        ("batch_size", "batch_size 100000000"),
        ("unknown_weight", "no array 'weights/no/such/kernel'"),
    ],
)
def test_replay_refuses_a_bundle_beyond_a_limit_in_one_line(replay_limits, name, words):
    result = replay_limits[name]
    assert_contained(result)  # no traceback, memory bounded
    assert result["code"] == 2
    lines = [line for line in result["err"].splitlines() if line.strip()]
    assert len(lines) == 1 and words in lines[0], result["err"]


def test_the_bundle_limit_can_be_raised_for_a_trusted_bundle(monkeypatch):
    monkeypatch.setenv(limits.BUNDLE_LIMIT_VARIABLE, "2048")
    assert limits.max_bundle_bytes() == 2048 * 2**20
    monkeypatch.setenv(limits.BUNDLE_LIMIT_VARIABLE, "not a number")
    assert limits.max_bundle_bytes() == limits.MAX_BUNDLE_BYTES


def _table_rows(markdown: str) -> list[list[str]]:
    """The cells of each row of the page's tables (header and rule rows left out)."""
    rows = []
    for line in markdown.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and not set("".join(cells)) <= set("-: "):
            rows.append(cells)
    return rows


def test_the_limits_page_states_the_limits_of_the_code():
    rows = _table_rows(LIMITS_PAGE.read_text())
    stated = {
        "`bundle.npz`": (
            f"{limits.MAX_BUNDLE_BYTES // limits.MB} MB",
            f"`{limits.BUNDLE_LIMIT_VARIABLE}=",
        ),
        "NaN Watch tag": (f"{limits.MAX_TENSOR_BYTES // limits.MB} MB",),
        "JSON text": (
            f"{limits.MAX_JSON_BYTES // limits.MB} MB, nested at most {limits.MAX_JSON_DEPTH} deep",
        ),
        "`skipped_ranges`": (f"{limits.MAX_SKIPPED_STEPS:,}",),
        "`batch_size`": (str(limits.MAX_BATCH_PARTS),),
    }
    for what, words in stated.items():
        limit_cells = [row[1] for row in rows if len(row) == 3 and what in row[0]]
        assert len(limit_cells) == 1, f"one row of {LIMITS_PAGE.name} names {what}"
        for word in words:
            assert word in limit_cells[0], (what, word, limit_cells[0])
