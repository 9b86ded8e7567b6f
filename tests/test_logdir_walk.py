"""A log dir with unreadable parts, symlink cycles and FIFOs (issue 17, item 3).

``report`` and ``export`` read every readable run, warn once per thing they
skip, keep the exit-code contract and never hang. An unreadable directory is
made real even when the tests run as root (root ignores ``chmod 000``): the
command then runs under ``setpriv`` without the capabilities that bypass file
permissions.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nanwatch_testlib as lib
import pytest

from tb_nanwatch import cli
from tb_nanwatch.board import logdir_walk, report
from tb_nanwatch.record.writing.synthetic import write_synthetic_run

READABLE_RUNS = [f"run{i:02d}" for i in range(16)]
TIMEOUT_S = 60  # each command finishes in a few seconds; a hang is a failure
REPO = Path(__file__).resolve().parent.parent
# Drops what lets root read a chmod-000 directory anyway.
SETPRIV = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]


@pytest.fixture(scope="module")
def readable_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sixteen")
    for name in READABLE_RUNS:
        write_synthetic_run(str(root / name), 12, num_layers=2)
    return root


@pytest.fixture
def logdir(readable_runs, tmp_path):
    target = tmp_path / "logs"
    shutil.copytree(readable_runs, target)
    yield target
    for path in target.rglob("*"):  # let pytest remove what was locked
        if path.is_dir() and not path.is_symlink():
            path.chmod(0o755)


def _lock_a_run(logdir: Path) -> Path:
    locked = logdir / "locked"
    write_synthetic_run(str(locked / "inner"), 12, num_layers=2)
    locked.chmod(0)
    return locked


def _command(*argv: str) -> subprocess.CompletedProcess:
    """``tb-nanwatch *argv`` in a fresh process, unable to bypass file modes."""
    prefix = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.fail("running as root without setpriv: cannot make a directory unreadable")
        prefix = SETPRIV
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [*prefix, sys.executable, "-m", "tb_nanwatch.cli", *argv],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=env,
    )


def _report_json(logdir: Path) -> tuple[list[str], str]:
    done = _command("report", str(logdir), "--json")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    return [r["run"] for r in json.loads(done.stdout)["runs"]], done.stderr


def _export_runs(logdir: Path, output: Path) -> tuple[list[str], str]:
    done = _command("export", str(logdir), "-o", str(output))
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    page = output.read_text()
    data = json.loads(page.split("window.__NANWATCH_DATA__ = ", 1)[1].split(";</script>", 1)[0])
    return [e["run"] for e in data["routes"][0]["body"]["runs"]], done.stderr


def _skipped(stderr: str, path: Path) -> int:
    return stderr.count(f"skipping {path}:")


def test_an_unreadable_directory_costs_only_itself(logdir, tmp_path):
    locked = _lock_a_run(logdir)
    runs, stderr = _report_json(logdir)
    assert runs == READABLE_RUNS
    assert _skipped(stderr, locked) == 1 and "Permission denied" in stderr
    exported, stderr = _export_runs(logdir, tmp_path / "out.html")
    assert exported == READABLE_RUNS
    assert _skipped(stderr, locked) == 1


def test_an_unreadable_event_file_costs_only_itself(logdir):
    run = logdir / READABLE_RUNS[4]
    original = next(run.glob("*tfevents*"))
    locked = run / "events.out.tfevents.0.locked"  # sorts first: read first
    shutil.copy(original, locked)
    locked.chmod(0)
    runs, stderr = _report_json(logdir)
    assert runs == READABLE_RUNS
    assert _skipped(stderr, locked) == 1


def test_an_unreadable_logdir_is_a_bad_path(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0)
    try:
        done = _command("report", str(locked))
    finally:
        locked.chmod(0o755)
    assert done.returncode == cli.EXIT_USAGE
    assert "cannot be read" in done.stderr and "Traceback" not in done.stderr


def test_a_symlink_cycle_is_followed_once(logdir, tmp_path):
    (logdir / "cycle").mkdir()
    (logdir / "cycle" / "up").symlink_to("..")
    (logdir / "alias").symlink_to(logdir / READABLE_RUNS[0])
    runs, stderr = _report_json(logdir)
    assert runs == READABLE_RUNS  # the alias is the same directory: listed once
    assert _skipped(stderr, logdir / "cycle" / "up") == 1
    assert _skipped(stderr, logdir / "alias") == 1
    exported, _ = _export_runs(logdir, tmp_path / "out.html")
    assert exported == READABLE_RUNS


def test_fifos_named_like_event_files_do_not_hang(logdir, tmp_path):
    alone = logdir / "fifo" / "events.out.tfevents.1.host"
    alone.parent.mkdir()
    os.mkfifo(alone)
    beside = logdir / READABLE_RUNS[3] / "events.out.tfevents.9.zz"  # next to a real one
    os.mkfifo(beside)
    runs, stderr = _report_json(logdir)
    assert runs == READABLE_RUNS
    assert _skipped(stderr, alone) == 1 and _skipped(stderr, beside) == 1
    assert "FIFO" in stderr
    exported, _ = _export_runs(logdir, tmp_path / "out.html")
    assert exported == READABLE_RUNS


def test_a_directory_that_cannot_be_listed_in_process(logdir, monkeypatch, caplog):
    """The same as chmod 000, by making ``os.scandir`` refuse one directory,
    through the Python loader and the plugin's ``runs`` route."""
    locked = _lock_a_run(logdir)
    locked.chmod(0o755)
    real_scandir = os.scandir

    def refusing_scandir(path="."):
        if Path(path) == locked:
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", refusing_scandir)
    with caplog.at_level(logging.WARNING):
        provider = report.load_provider(str(logdir))
    assert sum(f"skipping {locked}:" in r.getMessage() for r in caplog.records) == 1
    client = lib.make_client(provider, str(logdir))
    body = lib.get_json(client, f"{lib.PLUGIN}/runs")
    assert [r["run"] for r in body["runs"]] == READABLE_RUNS


def test_find_run_dirs_lists_each_directory_once(logdir):
    (logdir / "loop").symlink_to(logdir)
    found = logdir_walk.find_run_dirs(str(logdir))
    assert [logdir_walk.run_name(str(logdir), d) for d in found] == READABLE_RUNS


def test_report_in_process_keeps_its_contract(logdir):
    """The in-process CLI (as the tests and scripts call it) on a log dir
    with a cycle and a FIFO."""
    (logdir / "up").symlink_to(".")
    os.mkfifo(logdir / "events.out.tfevents.0.fifo")
    out, err = io.StringIO(), io.StringIO()
    assert cli.main(["report", str(logdir), "--json"], out=out, err=err) == cli.EXIT_OK
    assert [r["run"] for r in json.loads(out.getvalue())["runs"]] == READABLE_RUNS
