"""demo/run_all.py as a user meets it: a busy port, Ctrl-C while serving and
while training, progress lines and results in words.

Ctrl-C is sent the way a terminal sends it: SIGINT to the whole foreground
process group (the script runs in a session of its own here).
"""

from __future__ import annotations

import http.server
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import nanwatch_testlib as lib
import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN_ALL = str(ROOT / "demo" / "run_all.py")

pytestmark = pytest.mark.timeout(300)


class OtherServer(http.server.BaseHTTPRequestHandler):
    """Another program on the port: answers everything, even TensorBoard's routes."""

    def do_GET(self):
        body = json.dumps({"data_location": "somewhere else"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class Script:
    """run_all.py in its own process group, its output lines read as they come."""

    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, RUN_ALL, *args],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.stdout: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.stdout.append(line)
            self.lines.put(line)

    def wait_for_line(self, pattern: str, timeout: float = 150) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                assert self.process.poll() is None, self.output()
                continue
            match = re.search(pattern, line)
            if match:
                return match
        raise AssertionError(f"no line matching {pattern!r} in {timeout} s:\n{self.output()}")

    def ctrl_c(self) -> int:
        os.killpg(self.process.pid, signal.SIGINT)
        return self.process.wait(timeout=60)

    def output(self) -> str:
        return "".join(self.stdout)

    def stderr(self) -> str:
        return self.process.stderr.read()

    def children(self) -> list[int]:
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    stat = Path(f"/proc/{entry}/stat").read_text()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == self.process.pid:
                    found.append(int(entry))
        return found

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def answers(url: str) -> bool:
    try:
        lib.http_get(url)
    except OSError:
        return False
    return True


@pytest.fixture
def busy_port():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), OtherServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_a_busy_port_gives_a_free_one_and_the_url_shows_this_logdir(tmp_path, busy_port):
    from tb_nanwatch.record.writing.synthetic import write_synthetic_run

    logdir = str(tmp_path / "logs")
    write_synthetic_run(os.path.join(logdir, "one"), steps=20, num_layers=3)
    script = Script("--logdir", logdir, "--serve-only", "--port", str(busy_port))
    try:
        script.wait_for_line(f"Port {busy_port} is already in use by another program")
        url = script.wait_for_line(r"NaN Watch tab: (http://127\.0\.0\.1:(\d+)/)#nanwatch")
        base, port = url.group(1), int(url.group(2))
        assert port != busy_port
        environment = json.loads(lib.http_get(f"{base}data/environment")[2])
        assert environment["data_location"] == logdir
        runs = json.loads(lib.http_get(f"{base}data/plugin/nanwatch/runs")[2])["runs"]
        assert [run["run"] for run in runs] == ["one"]
        assert script.ctrl_c() == 130
    finally:
        script.kill()
    assert "Traceback" not in script.output() + script.stderr()
    assert not answers(f"{base}data/environment"), "TensorBoard outlived Ctrl-C"


def test_ctrl_c_while_a_demo_trains_stops_it_cleanly(tmp_path):
    name = "seed001_lstm_attention_log0"  # the longest: still training when Ctrl-C comes
    script = Script("--logdir", str(tmp_path / "logs"), "--only", name)
    try:
        script.wait_for_line(rf"^\[\s*\d+\.\ds\] {name}: step \d+/400$")
        children = script.children()
        assert children, "the demo process is not running"
        assert script.ctrl_c() == 130
    finally:
        script.kill()
    stderr = script.stderr()
    assert "Traceback" not in script.output() + stderr
    assert "Stopped: every process this demo started has ended." in stderr
    assert not [pid for pid in children if os.path.exists(f"/proc/{pid}")]


def test_an_unknown_scenario_is_a_clear_error(tmp_path):
    result = subprocess.run(
        [sys.executable, RUN_ALL, "--logdir", str(tmp_path), "--only", "seed999"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "invalid choice: 'seed999'" in result.stderr


def test_the_demo_run_twice_into_one_logdir_replaces_its_runs(tmp_path):
    """The README's command a second time: the scenario's run is replaced (the
    demo owns its scenario dirs), not added as a second run beside it, and
    ``tb-nanwatch report`` reads it."""
    for _ in range(2):
        result = subprocess.run(
            [sys.executable, RUN_ALL, "--logdir", str(tmp_path), "--only", "healthy"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert "no NaN/Inf and no explosion" in result.stdout
    assert not [name for name in os.listdir(tmp_path / "healthy") if name.startswith("run_")]
    report = subprocess.run(
        [sys.executable, "-m", "tb_nanwatch.cli", "report", str(tmp_path), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    (entry,) = json.loads(report.stdout)["runs"]
    assert entry["first_nonfinite"] is None and entry["explosion"] is None
