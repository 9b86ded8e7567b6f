"""Writes the demo runs (the four seed situations and a healthy run) and shows them.

    python demo/run_all.py --logdir demo_logs --serve

Each scenario runs in its own process (a distribution strategy or a mixed
precision policy must not leak into the next), on small synthetic CPU data.
With ``--serve`` TensorBoard is started on the log dir and its URL printed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

SCENARIOS = [
    ("seed000_nested_sigmoid_bce", "demo.seed000_nested_sigmoid_bce"),
    ("seed001_lstm_attention_log0", "demo.seed001_lstm_attention_log0"),
    ("seed002_explosion_no_nan", "demo.seed002_explosion_no_nan"),
    ("seed003_custom_loop_autoencoder", "demo.seed003_custom_loop_autoencoder"),
    ("healthy", "demo.healthy_run"),
]


def write_runs(logdir: str, only: list[str] | None = None) -> None:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    for name, module in SCENARIOS:
        if only and name not in only:
            continue
        if not os.path.exists(os.path.join(ROOT, *module.split(".")) + ".py"):
            print(f"[skip] {name}: {module} is not there")
            continue
        started = time.monotonic()
        run_dir = os.path.join(logdir, name)
        result = subprocess.run(
            [sys.executable, "-m", module, run_dir],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            sys.stderr.write(result.stdout + result.stderr)
            raise SystemExit(f"demo {name} failed")
        print(
            f"[{time.monotonic() - started:5.1f}s] {name}: {result.stdout.strip().splitlines()[-1]}"
        )


def serve(logdir: str, port: int) -> None:
    url = f"http://127.0.0.1:{port}/#nanwatch"
    print(f"TensorBoard with the NaN Watch tab: {url}  (Ctrl-C to stop)", flush=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "tensorboard.main",
            "--logdir",
            logdir,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        check=False,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--logdir", default="demo_logs")
    parser.add_argument("--serve", action="store_true", help="start TensorBoard afterwards")
    parser.add_argument("--port", type=int, default=6006)
    parser.add_argument("--only", nargs="*", help="scenario names to run")
    args = parser.parse_args()
    write_runs(args.logdir, args.only)
    if args.serve:
        serve(args.logdir, args.port)


if __name__ == "__main__":
    main()
