"""What NanWatch costs on the models people train, next to plain ``fit``.

For each model (ResNet50 and a transformer encoder beside the MLP, conv and
LSTM+attention models of ``worker.py``) and each variant, one fresh process
runs ``model.fit`` and reports:

* **time to first step**: from the ``fit`` call to the end of the first
  ``on_train_batch_end`` (tracing, graph optimization, the first run, and for
  NanWatch its ``on_train_begin``);
* **step time**: the median wall time between consecutive batch ends after
  ``--warmup`` steps;
* **peak RSS** (``VmHWM``), **peak device memory above resident** (the least
  over a few steps of TensorFlow's allocator peak minus what was allocated
  before the step, on ``GPU:0`` when there is one, else ``CPU:0``) and, for
  NanWatch, **event-file bytes per step**.

Variants: ``plain`` (``fit``), ``nanwatch`` (``fit`` with ``NanWatch`` at its
defaults), ``floor`` (``fit`` whose step also takes one bare ``reduce_sum`` of
every tensor NanWatch reads and hands them to the host once a step: the least
any every-step, per-tensor check costs), ``floor_counts`` (the floor plus the
exact NaN/Inf count of each of those tensors, built as NanWatch builds them;
``--variants plain,floor,floor_counts,nanwatch``) and, with ``--before TREE``,
``nanwatch_before`` (NanWatch imported from another checkout). The processes
run interleaved (plain, floor, nanwatch, ... then again in reverse order), and
each ratio is the median over repeats of (variant / plain of the same repeat),
with its quartiles. ``--jit`` adds the same table under ``jit_compile=True``
(each row proves from the model that XLA stayed on). ``--optimizer-built``
builds the optimizer before ``fit``, as it is after an earlier ``fit``, for a
loaded model or under a distribution strategy: Keras then traces the step
once, where otherwise it builds the optimizer in a first trace it throws away.

    python bench/realistic.py                          # the realistic models, CPU or GPU
    python bench/realistic.py --models transformer --repeats 5 --json out.json
    python bench/realistic.py --gpu                    # the GPU check: refuses to run without one
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
REALISTIC = "resnet50,transformer"
ALL_MODELS = "resnet50,transformer,mlp,conv,lstm"
COLUMNS = ("ttfs_s", "step_ms", "peak_rss_mb", "device_peak_mb")


def gpu_names(python: str = sys.executable) -> tuple[list[str], str]:
    """The GPUs TensorFlow sees in a fresh ``python`` process (its own, so
    this one stays light).

    Returns the device names and, when there are none, why: TensorFlow missing,
    a build without CUDA, or a CUDA build that finds no device.
    """
    code = (
        "import json, tensorflow as tf; print(json.dumps({"
        "'version': tf.__version__, 'cuda': tf.test.is_built_with_cuda(), "
        "'gpus': [d.name for d in tf.config.list_physical_devices('GPU')]}))"
    )
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, check=False)
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        error = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return [], f"TensorFlow does not import in {python} ({error})"
    found = json.loads(lines[-1])
    if found["gpus"]:
        return found["gpus"], ""
    if not found["cuda"]:
        return [], f"TensorFlow {found['version']} here is a build without CUDA"
    return [], f"TensorFlow {found['version']} is built with CUDA but sees no GPU"


def run_child(model: str, variant: str, args, jit: bool, log_modules: str = "") -> dict:
    """One measurement in a fresh process; its JSON result.

    ``log_modules``: a ``TF_CPP_VMODULE`` value; TensorFlow's log is then on
    and its lines come back as ``result["log"]``.
    """
    command = [sys.executable, os.path.join(HERE, "realistic_child.py"), model, variant]
    command += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    if jit:
        command.append("--jit")
    if args.optimizer_built:
        command.append("--optimizer-built")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": ROOT}
    if log_modules:
        env.update(TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE=log_modules)
    if variant == "nanwatch_before":
        env["PYTHONPATH"] = args.before
    out = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
        return {"model": model, "variant": variant, "error": " | ".join(tail)}
    result = json.loads(lines[-1][len("RESULT ") :])
    if log_modules:
        result["log"] = out.stderr.splitlines()
    return result


def measure(model: str, variants: list[str], args, jit: bool) -> list[dict]:
    """Every variant ``args.repeats`` times, interleaved (A B C, C B A, ...)."""
    runs = []
    for repeat in range(args.repeats):
        order = variants if repeat % 2 == 0 else variants[::-1]
        for variant in order:
            result = run_child(model, variant, args, jit)
            result["repeat"] = repeat
            runs.append(result)
            print(f"  {model} {'xla ' if jit else ''}{variant} #{repeat}: {_brief(result)}")
    return runs


def _brief(result: dict) -> str:
    if "error" in result:
        return "ERROR " + result["error"]
    return ", ".join(f"{c} {result[c]:.1f}" for c in COLUMNS if result.get(c) is not None)


def summarize(runs: list[dict]) -> list[dict]:
    """One row per variant: medians, and ratios to plain (median over
    repeats of the per-repeat ratio, with quartiles)."""
    ok = [r for r in runs if "error" not in r]
    plain = {r["repeat"]: r for r in ok if r["variant"] == "plain"}
    rows = []
    for variant in dict.fromkeys(r["variant"] for r in runs):
        mine = [r for r in ok if r["variant"] == variant]
        row = {"variant": variant, "runs": len(mine)}
        errors = [r["error"] for r in runs if r["variant"] == variant and "error" in r]
        if errors:
            row["errors"] = errors
        for column in COLUMNS:
            values = [r[column] for r in mine if r.get(column) is not None]
            row[column] = float(np.median(values)) if values else None
            ratios = [
                r[column] / plain[r["repeat"]][column]
                for r in mine
                if r.get(column) and plain.get(r["repeat"], {}).get(column)
            ]
            if ratios:
                row[column + "_ratio"] = [float(np.percentile(ratios, q)) for q in (50, 25, 75)]
        for column in (
            "event_bytes_per_step",
            "xla",
            "watched_tensors",
            "device",
            "optimizer_built",
        ):
            values = [r.get(column) for r in mine if r.get(column) is not None]
            row[column] = values[0] if values else None
        rows.append(row)
    return rows


def table(model: str, rows: list[dict], jit: bool) -> str:
    """A Markdown table of one model's rows."""
    title = f"{model}{' (jit_compile=True)' if jit else ''}"
    if rows and rows[0].get("optimizer_built"):
        title += ", optimizer built before fit"
    lines = [
        f"**{title}**",
        "",
        "| variant | step ms | step ratio [q25, q75] | time to first step s | ratio "
        "| peak RSS MB | ratio | device peak above resident MB | event bytes/step | XLA |",
        "|---|---:|---|---:|---|---:|---|---:|---:|---|",
    ]
    for row in rows:
        if not row["runs"]:
            lines.append(f"| {row['variant']} | error: {row.get('errors', ['?'])[0][:120]} |")
            continue
        lines.append(
            f"| {row['variant']} | {_num(row['step_ms'])} | {_ratio(row, 'step_ms')} "
            f"| {_num(row['ttfs_s'])} | {_ratio(row, 'ttfs_s')} "
            f"| {_num(row['peak_rss_mb'], 0)} | {_ratio(row, 'peak_rss_mb')} "
            f"| {_num(row['device_peak_mb'])} | {_num(row['event_bytes_per_step'], 0)} "
            f"| {row['xla']} |"
        )
    return "\n".join(lines)


def _num(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ratio(row: dict, column: str) -> str:
    ratio = row.get(column + "_ratio")
    if not ratio:
        return "-"
    return f"{ratio[0]:.2f} [{ratio[1]:.2f}, {ratio[2]:.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=REALISTIC, help=f"comma list from {ALL_MODELS}")
    parser.add_argument("--variants", default="plain,floor,nanwatch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per process")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--jit", action="store_true", help="also the table under jit_compile=True")
    parser.add_argument("--jit-only", action="store_true")
    parser.add_argument("--before", help="another checkout: adds the nanwatch_before variant")
    parser.add_argument(
        "--optimizer-built",
        action="store_true",
        help="build the optimizer before fit (as after an earlier fit, or for a loaded model): "
        "Keras then traces the step once instead of twice",
    )
    parser.add_argument("--gpu", action="store_true", help="refuse to run without a GPU")
    parser.add_argument("--json", help="write every run and row to this file")
    args = parser.parse_args()

    gpus, why_none = gpu_names()
    if args.gpu and not gpus:
        print(f"No GPU table: {why_none}.")
        sys.exit(2)
    print(f"device: {', '.join(gpus) if gpus else 'CPU only'}; load average {os.getloadavg()}")
    variants = args.variants.split(",")
    if args.before:
        variants.append("nanwatch_before")
    modes = [True] if args.jit_only else ([False, True] if args.jit else [False])
    report = {"device": gpus or "CPU", "started": time.strftime("%Y-%m-%d %H:%M"), "tables": []}
    for jit in modes:
        for model in args.models.split(","):
            runs = measure(model, variants, args, jit)
            rows = summarize(runs)
            report["tables"].append({"model": model, "jit": jit, "rows": rows, "runs": runs})
            print(table(model, rows, jit) + "\n", flush=True)
    report["load_average_end"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
