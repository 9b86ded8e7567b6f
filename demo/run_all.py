"""Writes the demo runs (the four seed situations, seed 003 also as the user's own
TF1 graph code, and a healthy run) and shows them.

    python demo/run_all.py --logdir demo_logs --serve

Each scenario runs in its own process (a distribution strategy or a mixed
precision policy must not leak into the next), on small synthetic CPU data; a
line per scenario shows its progress, then what NaN Watch found, in words.
With ``--serve`` TensorBoard is started on the log dir (on a free port if the
one asked for is taken) and its URL printed once it answers. Ctrl-C stops
everything it started and exits with status 130.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

try:
    from demo._common import EXIT_INTERRUPTED, parse_progress
except ImportError:  # run as a script
    from _common import EXIT_INTERRUPTED, parse_progress

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

SCENARIOS = {
    "seed000_nested_sigmoid_bce": "demo.seed000_nested_sigmoid_bce",
    "seed001_lstm_attention_log0": "demo.seed001_lstm_attention_log0",
    "seed002_explosion_no_nan": "demo.seed002_explosion_no_nan",
    "seed003_custom_loop_autoencoder": "demo.seed003_custom_loop_autoencoder",
    "seed003_tf1_graph_autoencoder": "demo.seed003_tf1_graph_autoencoder",
    "healthy": "demo.healthy_run",
}
NAME_WIDTH = max(map(len, SCENARIOS))
BAR_WIDTH = 24
PLAIN_PROGRESS_EVERY_S = 5.0
SERVE_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0


class Stopped(Exception):
    """A signal (SIGTERM, SIGHUP) asked this process to stop."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum, frame) -> None:
    raise Stopped(signum)


class Children:
    """The processes this script started; each in its own session, so that only
    this script sees the terminal's Ctrl-C and it stops them in order."""

    def __init__(self) -> None:
        self.running: list[subprocess.Popen] = []

    def start(self, command: list[str], **kwargs) -> subprocess.Popen:
        process = subprocess.Popen(command, start_new_session=True, **kwargs)
        self.running.append(process)
        return process

    def stop_all(self) -> None:
        for process in self.running:
            if process.poll() is None:
                process.terminate()
        for process in self.running:
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.running.clear()


class ProgressLine:
    """One line per scenario: redrawn in place on a terminal, a line every
    PLAIN_PROGRESS_EVERY_S (the first at once) otherwise (logs, pipes)."""

    def __init__(self, stream=sys.stdout) -> None:
        self.stream = stream
        self.live = stream.isatty()
        self._last_plain: float | None = None

    def start(self, name: str) -> None:
        self._last_plain = None
        if self.live:
            self._write(f"\r\x1b[K  {name:<{NAME_WIDTH}} starting (TensorFlow loads first)")
        else:
            self._write(f"[  0.0s] {name}: starting\n")

    def update(self, name: str, done: int, total: int, elapsed: float) -> None:
        if self.live:
            filled = BAR_WIDTH * min(done, total) // max(total, 1)
            bar = "#" * filled + "." * (BAR_WIDTH - filled)
            self._write(
                f"\r\x1b[K  {name:<{NAME_WIDTH}} [{bar}] step {done}/{total}  {elapsed:5.1f}s"
            )
        elif self._last_plain is None or elapsed - self._last_plain >= PLAIN_PROGRESS_EVERY_S:
            self._last_plain = elapsed
            self._write(f"[{elapsed:5.1f}s] {name}: step {done}/{total}\n")

    def finish(self, name: str, words: str, elapsed: float) -> None:
        self._write(("\r\x1b[K" if self.live else "") + f"[{elapsed:5.1f}s] {name}: {words}\n")

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()


def run_scenario(name: str, run_dir: str, children: Children, progress: ProgressLine) -> None:
    """Trains one scenario in a child process, relaying its progress and its result."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    started = time.monotonic()
    progress.start(name)
    with tempfile.TemporaryFile("w+") as stderr:
        process = children.start(
            [sys.executable, "-m", SCENARIOS[name], run_dir],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        result = ""
        for line in process.stdout:
            steps = parse_progress(line)
            if steps:
                progress.update(name, *steps, time.monotonic() - started)
            elif line.strip():
                result = line.strip()
        if process.wait() != 0:
            stderr.seek(0)
            sys.stderr.write(stderr.read()[-5000:])
            raise SystemExit(f"demo {name} failed (exit status {process.returncode})")
    progress.finish(name, result, time.monotonic() - started)


def write_runs(logdir: str, names: list[str], children: Children) -> None:
    progress = ProgressLine()
    for name in names:
        # The demo owns its scenario dirs: a second run replaces the first (NanWatch would
        # add run_2 beside run_1, and TensorBoard would show every scenario twice).
        shutil.rmtree(os.path.join(logdir, name), ignore_errors=True)
        run_scenario(name, os.path.join(logdir, name), children, progress)
    print(f"Runs written to {logdir}/ (`tb-nanwatch report {logdir}` prints the same diagnosis).")


def port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serves_logdir(port: int, logdir: str) -> bool:
    """Whether the server on ``port`` is a TensorBoard showing ``logdir`` (not some other server)."""
    url = f"http://127.0.0.1:{port}/data/environment"
    with contextlib.suppress(OSError, ValueError):
        with urllib.request.urlopen(url, timeout=2) as response:
            return json.load(response).get("data_location") == logdir
    return False


def serve(logdir: str, port: int, children: Children) -> None:
    """Runs TensorBoard on ``logdir`` until it exits; prints its URL once it answers."""
    if not port_is_free(port):
        asked, port = port, free_port()
        print(f"Port {asked} is already in use by another program: using port {port} instead.")
    with tempfile.TemporaryFile("w+") as log:
        process = children.start(
            [sys.executable, "-m", "tensorboard.main", "--logdir", logdir]
            + ["--host", "127.0.0.1", "--port", str(port)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + SERVE_TIMEOUT_S
        while not serves_logdir(port, logdir):
            if process.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                sys.stderr.write(log.read()[-3000:])
                raise SystemExit(f"TensorBoard did not start on port {port} (see its output above)")
            time.sleep(0.5)
        print(
            f"TensorBoard with the NaN Watch tab: http://127.0.0.1:{port}/#nanwatch  (Ctrl-C to stop)"
        )
        sys.stdout.flush()
        if process.wait() != 0:
            log.seek(0)
            sys.stderr.write(log.read()[-3000:])
            raise SystemExit(f"TensorBoard exited with status {process.returncode}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--logdir", default="demo_logs")
    parser.add_argument("--serve", action="store_true", help="start TensorBoard afterwards")
    parser.add_argument(
        "--serve-only", action="store_true", help="serve the runs already in --logdir, train none"
    )
    parser.add_argument("--port", type=int, default=6006, help="TensorBoard's port when free")
    parser.add_argument("--only", nargs="+", choices=list(SCENARIOS), help="scenarios to run")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _raise_stopped)
    # Ctrl-C stops the demo even when it was started from a background job,
    # which inherits SIGINT as ignored (Python then installs no handler).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    children = Children()
    try:
        if not args.serve_only:
            write_runs(args.logdir, args.only or list(SCENARIOS), children)
        if args.serve or args.serve_only:
            serve(args.logdir, args.port, children)
    except (KeyboardInterrupt, Stopped) as stop:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup
        children.stop_all()
        print("\nStopped: every process this demo started has ended.", file=sys.stderr)
        return 128 + stop.signum if isinstance(stop, Stopped) else EXIT_INTERRUPTED
    finally:
        children.stop_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
