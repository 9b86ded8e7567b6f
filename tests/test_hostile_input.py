"""Hostile and broken input: the plugin and the CLI keep working.

Truncated and corrupted event files, crafted runs with valid framing but
broken contents, thousands of unrelated runs, other format versions and two
processes writing into one log dir. Every route answers 200/400/404 (never
500), ``tb-nanwatch report`` exits 0, and what cannot be read is skipped with
a one-line warning.
"""

from __future__ import annotations

import io
import json
import logging
import os
import random
import struct
import subprocess
import sys
import time
from urllib.parse import quote

import numpy as np
from nanwatch_testlib import (
    PLUGIN,
    data_server_binary,
    data_server_provider,
    make_client,
    route_client,
    strict_json,
    write_named_run,
)
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.record_writer import masked_crc32c

from tb_nanwatch import cli
from tb_nanwatch.board.report import load_provider
from tb_nanwatch.evidence import metadata
from tb_nanwatch.evidence.options import WatchOptions
from tb_nanwatch.record.writing.event_writer import RunWriter, summary_metadata
from tb_nanwatch.record.writing.journal import RunJournal
from tb_nanwatch.record.writing.synthetic import build_schema, write_synthetic_run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OK_STATUSES = {200, 400, 404}


# -- helpers ---------------------------------------------------------------------


def run_report(logdir: str, as_json: bool = True) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(["report", logdir] + (["--json"] if as_json else []), out=out, err=err)
    assert code == 0, err.getvalue()
    return out.getvalue(), err.getvalue()


def get(client, url: str):
    response = client.get(url)
    assert response.status_code in OK_STATUSES, (url, response.status_code, response.data[:500])
    assert response.headers["Content-Type"].startswith("application/json"), url
    return response.status_code, strict_json(response.get_data(as_text=True))


def check_everything(logdir: str, extra_steps=(0, 1), live: bool = False, provider=None) -> dict:
    """Report (JSON and text) and every plugin route of every run: no failure.
    ``live``: runs are being written, the report and the plugin may differ.
    The plugin reads through ``provider``, by default the CLI's loader:
    TensorBoard's own Python loader raises in ``Reload()`` on a record that is
    not an Event proto (its problem; the CLI's loader skips that run)."""
    body, _ = run_report(logdir)
    report = json.loads(body)
    run_report(logdir, as_json=False)
    client = make_client(provider or load_provider(logdir), logdir)
    code, runs = get(client, f"{PLUGIN}/runs")
    assert code == 200
    if not live:
        assert [r["run"] for r in runs["runs"]] == [r["run"] for r in report["runs"]]
    for entry in runs["runs"]:
        run = quote(entry["run"], safe="")
        get(client, f"{PLUGIN}/timeline?run={run}")
        get(client, f"{PLUGIN}/timeline?run={run}&start=1&end=50&max_points=7")
        get(client, f"{PLUGIN}/incident?run={run}")
        steps = set(extra_steps)
        if isinstance(entry.get("first_nonfinite"), dict):
            step = entry["first_nonfinite"].get("step")
            if isinstance(step, int) and step >= 0:
                steps.add(step)
        for step in steps:
            get(client, f"{PLUGIN}/step?run={run}&step={step}")
    return {r["run"]: r for r in runs["runs"]}


def nanwatch_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "nanwatch" in r.getMessage().lower()]


def assert_one_line_warnings(caplog) -> None:
    for record in caplog.records:
        if record.levelno >= logging.WARNING and record.name.startswith("tb_nanwatch"):
            assert "\n" not in record.getMessage(), record.getMessage()


def event_file(run_dir: str) -> str:
    files = [f for f in os.listdir(run_dir) if "tfevents" in f]
    assert len(files) == 1, files
    return os.path.join(run_dir, files[0])


def record_bounds(data: bytes) -> list[int]:
    """Offsets where each TFRecord of an event file starts (and the end)."""
    bounds, offset = [], 0
    while offset + 12 <= len(data):
        bounds.append(offset)
        (length,) = struct.unpack("<Q", data[offset : offset + 8])
        offset += 12 + length + 4
    bounds.append(len(data))
    return bounds


def frame(payload: bytes) -> bytes:
    """A TFRecord with correct CRCs around ``payload``."""
    header = struct.pack("<Q", len(payload))
    return (
        header
        + struct.pack("<I", masked_crc32c(header))
        + payload
        + struct.pack("<I", masked_crc32c(payload))
    )


def write_flushed_run(run_dir: str, steps=400, incident_step=300, flush_every=50) -> dict:
    """A run flushed every ``flush_every`` steps (a summary per flush)."""
    schema = build_schema(3)
    journal = RunJournal(
        run_dir, schema, {"model": "flushed"}, WatchOptions(flush_secs=1e9, snapshot_every=100)
    )
    header = [
        schema.header_index(f)
        for f in ("loss", "grad_norm", "lr", "loss_scale", "skipped", "iterations")
    ]
    activation = schema.find(kind="activation")[1]
    for step in range(steps):
        vector = np.zeros(schema.size, np.float32)
        vector[header] = (1.0 / (step + 1), 1.0, 1e-3, 0.0, 0.0, step)
        if step == incident_step:
            vector[activation.index("nan")] = 2.0
        journal.record(step, 0, step, vector)
        if step % flush_every == flush_every - 1:
            journal.flush()
    journal.close()
    return journal.summary()


# -- truncated and corrupted event files --------------------------------------------


def test_truncated_event_files(tmp_path):
    logdir = str(tmp_path / "logs")
    full = write_flushed_run(os.path.join(logdir, "full"))
    data = open(event_file(os.path.join(logdir, "full")), "rb").read()
    bounds = record_bounds(data)
    rng = random.Random(0)
    cuts = sorted(set(rng.sample(range(1, len(data)), 12) + [b + 5 for b in bounds[1:-1:3]]))
    for i, cut in enumerate(cuts):
        cut_dir = os.path.join(logdir, f"cut_{i:03d}")
        os.makedirs(cut_dir)
        with open(os.path.join(cut_dir, "events.out.tfevents.1.host.1.nanwatch"), "wb") as f:
            f.write(data[:cut])
    runs = check_everything(logdir)
    assert runs["full"]["steps"] == full["steps"] == 400
    # A cut file shows what was flushed before the cut, never more.
    listed = [r for name, r in runs.items() if name.startswith("cut_")]
    assert listed, "some cut points keep a run summary"
    assert all(0 < r["steps"] <= full["steps"] for r in listed)
    assert any(r["first_nonfinite"] for r in listed)


def test_corrupted_and_garbage_event_files(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    logdir = str(tmp_path / "logs")
    write_flushed_run(os.path.join(logdir, "good"))
    data = open(event_file(os.path.join(logdir, "good")), "rb").read()
    rng = random.Random(1)

    def put(name: str, content: bytes) -> None:
        os.makedirs(os.path.join(logdir, name))
        with open(os.path.join(logdir, name, "events.out.tfevents.1.host.2.nanwatch"), "wb") as f:
            f.write(content)

    for i in range(8):  # random byte flips anywhere
        corrupt = bytearray(data)
        for _ in range(1 + i):
            corrupt[rng.randrange(len(corrupt))] ^= 1 << rng.randrange(8)
        put(f"flipped_{i}", bytes(corrupt))
    put("garbage", bytes(rng.randrange(256) for _ in range(4096)))
    put("empty", b"")
    put("huge_length", struct.pack("<Q", 2**62) + b"\0" * 64)
    # Valid framing, payloads that are not Event protos or are nonsense ones.
    put(
        "not_protos",
        b"".join(frame(bytes(rng.randrange(256) for _ in range(n))) for n in (1, 9, 300)),
    )
    weird = event_pb2.Event(
        step=-(2**62),
        wall_time=float("nan"),
        summary=summary_pb2.Summary(
            value=[
                summary_pb2.Summary.Value(tag=metadata.TAG_RUN, metadata=summary_metadata("run"))
            ]
        ),
    )
    put("empty_tensor", frame(weird.SerializeToString()))
    os.makedirs(os.path.join(logdir, "dir_named_like_a_file", "events.out.tfevents.9.h.9.x"))
    runs = check_everything(logdir)
    assert runs["good"]["steps"] == 400
    assert_one_line_warnings(caplog)
    if data_server_binary() is not None:  # TensorBoard's default loader
        with data_server_provider(logdir, expect_runs=1) as provider:
            runs = check_everything(logdir, provider=provider, live=True)
            assert runs["good"]["steps"] == 400


# -- crafted runs: valid event files, broken contents ------------------------------------


def _summary_of_a_real_run(tmp_path) -> dict:
    journal = RunJournal(str(tmp_path / "template"), build_schema(2), {"model": "t"})
    vector = np.zeros(journal.schema.size, np.float32)
    for step in range(3):
        journal.record(step, 0, step, vector)
    journal.close()
    return journal.summary()


BROKEN_SUMMARIES = {
    "not_an_object": lambda s: [1, 2, 3],
    "schema_garbage": lambda s: {**s, "schema": "garbage"},
    "schema_entries_garbage": lambda s: {**s, "schema": [{"phase": 1}]},
    "steps_negative": lambda s: {**s, "steps": -5},
    "steps_text": lambda s: {**s, "steps": "many"},
    "steps_huge": lambda s: {**s, "steps": 10**30},
    "steps_float": lambda s: {**s, "steps": 3.5},
    "incident_step_text": lambda s: {
        **s,
        "first_nonfinite": {"step": "abc", "phase": "forward", "layer": None, "tensor": "t"},
    },
    "incident_empty": lambda s: {**s, "first_nonfinite": {}},
    "incident_step_nan": lambda s: {**s, "first_nonfinite": {"step": float("nan"), "phase": 3}},
    "incident_list": lambda s: {**s, "first_nonfinite": [1]},
    "explosion_empty": lambda s: {**s, "explosion": {}},
    "explosion_step_none": lambda s: {**s, "explosion": {"step": None, "signal": None}},
    "skipped_huge_range": lambda s: {**s, "skipped_ranges": [[0, 10**15]]},
    "skipped_beyond_steps": lambda s: {**s, "skipped_ranges": [[1, 2], [100, 200]]},
    "skipped_garbage": lambda s: {**s, "skipped_ranges": "x"},
    "columns_missing": lambda s: {k: v for k, v in s.items() if k != "series_columns"},
    "columns_wrong_width": lambda s: {**s, "series_columns": ["loss"]},
    "version_text": lambda s: {**s, "format_version": "1"},
    "status_object": lambda s: {**s, "status": {"a": 1}},
    "layers_hostile": lambda s: {**s, "layers": ["<script>alert(1)</script>"], "model": None},
}


def test_crafted_broken_summaries_are_skipped_or_shown_never_fatal(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    logdir = str(tmp_path / "logs")
    write_synthetic_run(os.path.join(logdir, "aaa_good"), 20)
    write_synthetic_run(os.path.join(logdir, "zzz_good"), 30, incident_step=25)
    template = _summary_of_a_real_run(tmp_path)
    for name, mutate in BROKEN_SUMMARIES.items():
        run_dir = os.path.join(logdir, name)
        write_synthetic_run(run_dir, 3, num_layers=2)  # real series, flight, schema
        writer = RunWriter(run_dir)  # a later summary overrides the good one
        writer.write_json(metadata.TAG_RUN, metadata.KIND_RUN, 10, mutate(dict(template)))
        writer.close()
    start = time.monotonic()
    runs = check_everything(logdir)
    assert time.monotonic() - start < 60
    # One broken run never hides the others.
    assert runs["aaa_good"]["steps"] == 20
    assert runs["zzz_good"]["first_nonfinite"]["step"] == 25
    assert_one_line_warnings(caplog)


def test_crafted_broken_payloads_of_other_tags(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    logdir = str(tmp_path / "logs")
    cases = {
        "run_tensor_is_numbers": (metadata.TAG_RUN, "run", np.ones((2, 2))),
        "series_wrong_width": (metadata.series_tag(0), "series", np.ones((5, 3))),
        "series_rank3": (metadata.series_tag(0), "series", np.ones((2, 2, 2))),
        "series_far_step": (metadata.series_tag(9), "series", None),
        "flight_wrong_width": (metadata.TAG_FLIGHT, "flight", np.ones((4, 7))),
        "flight_rank1": (metadata.TAG_FLIGHT, "flight", np.ones(4)),
        "layers_wrong": (metadata.layers_tag(0), "layers", np.ones((3, 3))),
        "layers_bad_tag": (metadata.TAG_LAYERS_PREFIX + "x\n<b>", "layers", np.ones(2)),
        "incident_not_json": (metadata.TAG_INCIDENT, "incident", "{not json"),
        "incident_is_list": (metadata.TAG_INCIDENT, "incident", "[1, 2]"),
        "kind_mismatch": (metadata.TAG_FLIGHT, "incident", "{}"),
        "unknown_tag": ("nanwatch/from_the_future", "run", "{}"),
    }
    for name, (tag, kind, value) in cases.items():
        run_dir = os.path.join(logdir, name)
        write_synthetic_run(run_dir, 40, num_layers=2, incident_step=30, snapshot_every=10)
        writer = RunWriter(run_dir)
        if isinstance(value, str):
            writer.write_json(tag, kind, 5, None)
            writer._add(tag, kind, 5, _text_tensor(value))
        elif value is None:  # a chunk claiming steps far beyond the run
            width = 11 + 1
            writer.write_array(tag, kind, 10**15, np.ones((4, width)))
        else:
            writer.write_array(tag, kind, 0, value)
        writer.close()
    runs = check_everything(logdir, extra_steps=(0, 10, 30))
    # The run summary is fine in these: the runs stay listed.
    assert "series_wrong_width" in runs and "flight_wrong_width" in runs
    assert_one_line_warnings(caplog)


def _text_tensor(text: str):
    from tb_nanwatch.record.writing.event_writer import _string_tensor

    return _string_tensor(text)


def test_hostile_names_of_runs_layers_and_tensors(tmp_path):
    logdir = str(tmp_path / "logs")
    hostile = ["<script>alert(1)</script>", "a\u2028b\u0000c", "../../etc/passwd", "\"'`${x}"]
    run_name = "run <img src=x onerror=alert(1)> \u00e9\u6f22"
    write_named_run(
        os.path.join(logdir, run_name),
        hostile,
        bad_layer=2,
        bad_step=3,
        steps=5,
        model="<b>m</b>",
        tensor_suffix="</script>",
    )
    runs = check_everything(logdir, extra_steps=(0, 3))
    incident = runs[run_name]["first_nonfinite"]
    assert incident["layer"] == "../../etc/passwd" and incident["step"] == 3


# -- thousands of unrelated runs ------------------------------------------------------------


def _tiny_scalar_event_file() -> bytes:
    version = event_pb2.Event(wall_time=1.0, file_version="brain.Event:2")
    records = [frame(version.SerializeToString())]
    for step in range(3):
        summary = summary_pb2.Summary(
            value=[summary_pb2.Summary.Value(tag="loss", simple_value=1.0 / (step + 1))]
        )
        records.append(
            frame(event_pb2.Event(wall_time=2.0, step=step, summary=summary).SerializeToString())
        )
    return b"".join(records)


def test_thousands_of_unrelated_runs(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    logdir = str(tmp_path / "logs")
    content = _tiny_scalar_event_file()
    for i in range(2000):
        run_dir = os.path.join(logdir, f"group{i % 20:02d}", f"unrelated_{i:04d}")
        os.makedirs(run_dir)
        with open(os.path.join(run_dir, "events.out.tfevents.1.host.1.v2"), "wb") as f:
            f.write(content)
    write_synthetic_run(os.path.join(logdir, "group07", "watched"), 50, incident_step=40)
    start = time.monotonic()
    body, _ = run_report(logdir)
    assert [r["run"] for r in json.loads(body)["runs"]] == ["group07/watched"]
    client = route_client(logdir)
    code, runs = get(client, f"{PLUGIN}/runs")
    assert [r["run"] for r in runs["runs"]] == ["group07/watched"]
    get(client, f"{PLUGIN}/incident?run=group07%2Fwatched")
    assert time.monotonic() - start < 120
    assert not nanwatch_lines(caplog)  # unrelated runs are not warned about


# -- format versions -----------------------------------------------------------------------


def test_runs_of_other_format_versions(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.WARNING)
    logdir = str(tmp_path / "logs")
    write_synthetic_run(os.path.join(logdir, "current"), 20, incident_step=10)
    for name, version in (("newer", metadata.FORMAT_VERSION + 1), ("older_invalid", 0)):
        with monkeypatch.context() as patch:
            patch.setattr(metadata, "FORMAT_VERSION", version)
            write_synthetic_run(os.path.join(logdir, name), 20, incident_step=10)
    runs = check_everything(logdir)
    assert sorted(runs) == ["current"]
    skipped = [line for line in nanwatch_lines(caplog) if "skipping run" in line]
    assert any("'newer'" in line for line in skipped)
    assert any("'older_invalid'" in line for line in skipped)
    assert_one_line_warnings(caplog)
    # The CLI says it on stderr, one line per run and reason.
    proc = subprocess.run(
        [sys.executable, "-m", "tb_nanwatch.cli", "report", logdir],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 0
    assert "run current:" in proc.stdout
    warned = [line for line in proc.stderr.splitlines() if "skipping run" in line]
    assert len(warned) == 2, proc.stderr

    # A reader of a later version still reads today's runs (older for it).
    caplog.clear()
    monkeypatch.setattr(metadata, "FORMAT_VERSION", metadata.FORMAT_VERSION + 1)
    runs = check_everything(logdir)
    assert "current" in runs and runs["current"]["first_nonfinite"]["step"] == 10


# -- two processes writing into one log dir ----------------------------------------------------

WRITER = r"""
import os, sys, time, types
sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("notf"))
import numpy as np
from tb_nanwatch.evidence.options import WatchOptions
from tb_nanwatch.record.writing.journal import RunJournal
from tb_nanwatch.record.writing.synthetic import build_schema

logdir, tag = sys.argv[1], sys.argv[2]
schema = build_schema(3)
journals = [RunJournal(os.path.join(logdir, name), schema, {"model": tag}, WatchOptions(flush_secs=0.05))
            for name in (f"{tag}_0", f"{tag}_1", "shared")]
header = [schema.header_index(f) for f in ("loss", "grad_norm", "lr", "loss_scale", "skipped", "iterations")]
for step in range(1500):
    for journal in journals:
        vector = np.zeros(schema.size, np.float32)
        vector[header] = (1.0, 1.0, 1e-3, 0.0, 0.0, step)
        journal.record(step, 0, step, vector)
    if step % 100 == 0:
        time.sleep(0.02)
for journal in journals:
    journal.close()
print("done", flush=True)
"""


def test_two_processes_writing_into_one_log_dir(tmp_path):
    logdir = str(tmp_path / "logs")
    os.makedirs(logdir)
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    env = dict(os.environ, PYTHONPATH=REPO)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), logdir, tag], env=env, stdout=subprocess.PIPE
        )
        for tag in ("a", "b")
    ]
    try:
        rounds = 0
        while any(p.poll() is None for p in procs) or rounds < 2:
            check_everything(logdir, live=True)  # reads half-written files
            rounds += 1
        assert all(p.wait(timeout=120) == 0 for p in procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    runs = check_everything(logdir)
    assert sorted(runs) == ["a_0", "a_1", "b_0", "b_1", "shared"]
    assert all(runs[name]["steps"] == 1500 for name in runs)
