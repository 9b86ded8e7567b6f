"""Where an XLA first step goes: tf2xla, XLA's HLO passes, its backend, and the rest.

Runs ``realistic_child.py`` (one model, one variant, one fresh process) under
``jit_compile=True`` with TensorFlow's compile log on, and splits the time to
the first step by the log's timestamps:

* **tf2xla**: from the start of the step's compile to the last line of
  TensorFlow's graph-to-HLO lowering (``xla_compiler.cc``), which lowers the
  TF graph op by op (an ``XlaVariadicReduceV2`` through an MLIR pipeline of
  its own: about 5 ms each on this CPU, a plain ``Sum`` 0.3 ms);
* **HLO passes**: from there to the start of the CPU backend;
* **backend**: the CPU backend (fusion emitters, LLVM), to its last line;
* **outside the compile**: the rest of the first step (tracing, graph
  optimization, the first run, the callbacks).

The split needs TensorFlow's CPU compiler log lines (TensorFlow 2.21 on a
CPU); without them only the compile total is given, and without any XLA
compile in the log the row says so.

    python bench/compile_phases.py transformer
    python bench/compile_phases.py mlp --variants floor_counts,nanwatch --repeats 3
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import realistic  # noqa: E402

PHASES = ("tf2xla_s", "hlo_s", "backend_s", "compile_s", "outside_s")
# What TensorFlow logs at these verbosities (TF_CPP_VMODULE), by the file that logs it.
_VMODULE = "device_compiler=2,xla_compiler=1,cpu_compiler=1"
_STARTED = "Instantly compiling"  # device_compiler.h: the compile of a signature begins
_LOWERING = "xla_compiler.cc"  # tf2xla: each function it lowers, and when it is done
_BACKEND_STARTED = "] Compiling: "  # cpu_compiler.cc: the CPU backend begins
_BACKEND_DONE = "Compilation finished"  # cpu_compiler.cc
_DONE = "Compilation of XLA executable"  # device_compiler.h: with the compile's total time


def log_seconds(line: str) -> float | None:
    """The timestamp of a TensorFlow (absl) log line in seconds, or None.

    The second field is ``hh:mm:ss.ffffff``; before absl is initialized
    TensorFlow writes ``00:00:<seconds since the epoch>``, which reads the
    same way.
    """
    fields = line.split()
    if len(fields) < 2 or fields[1].count(":") != 2:
        return None
    hours, minutes, seconds = fields[1].split(":")
    try:
        return int(hours) * 3600 + int(minutes) * 60 + float(seconds)
    except ValueError:
        return None


def compile_phases(lines: list[str]) -> dict[str, float | None] | None:
    """The phases (seconds) of the first XLA compile in a TensorFlow log, or
    None when the log holds no finished compile. ``hlo_s`` and ``backend_s``
    are None when the CPU backend's lines are missing (another backend)."""
    stamped = [(line, log_seconds(line)) for line in lines]
    stamped = [(line, t) for line, t in stamped if t is not None]
    start = next((i for i, (line, _) in enumerate(stamped) if _STARTED in line), None)
    if start is None:
        return None
    done = next((i for i in range(start, len(stamped)) if _DONE in stamped[i][0]), None)
    if done is None:
        return None
    backend = next(
        (
            i
            for i in range(start, done)
            if _BACKEND_STARTED in stamped[i][0] and "cpu_compiler" in stamped[i][0]
        ),
        None,
    )
    lowering_end = backend if backend is not None else done
    lowered = [i for i in range(start, lowering_end) if _LOWERING in stamped[i][0]]
    if not lowered:
        return None
    t0 = stamped[start][1]
    tf2xla_end = stamped[lowered[-1]][1]
    phases: dict[str, float | None] = {
        "tf2xla_s": tf2xla_end - t0,
        "hlo_s": None,
        "backend_s": None,
        "compile_s": stamped[done][1] - t0,
    }
    if backend is not None:
        finished = next(
            (i for i in range(backend, done + 1) if _BACKEND_DONE in stamped[i][0]), done
        )
        phases["hlo_s"] = stamped[backend][1] - tf2xla_end
        phases["backend_s"] = stamped[finished][1] - stamped[backend][1]
    return phases


def run_child(model: str, variant: str, optimizer_built: bool) -> dict:
    """One first step under XLA in a fresh process: its result and phases."""
    steps = argparse.Namespace(steps=1, warmup=0, optimizer_built=optimizer_built, before=None)
    result = realistic.run_child(model, variant, steps, jit=True, log_modules=_VMODULE)
    if "error" in result:
        return result
    phases = compile_phases(result.pop("log"))
    if phases is None:
        result["error"] = "no finished XLA compile in the log (was XLA on?)"
        return result
    result.update(phases)
    result["outside_s"] = result["ttfs_s"] - phases["compile_s"]
    return result


def row(variant: str, runs: list[dict]) -> str:
    """One Markdown row: medians over ``runs`` of one variant."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        errors = [r["error"] for r in runs]
        return f"| {variant} | error: {errors[0][:120] if errors else '?'} |"
    cells = [f"{np.median([r['ttfs_s'] for r in ok]):.2f}"]
    for phase in PHASES:
        values = [r[phase] for r in ok if r.get(phase) is not None]
        cells.append(f"{np.median(values):.2f}" if values else "-")
    return f"| {variant} | {len(ok)} | " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="mlp, conv, lstm, resnet50 or transformer")
    parser.add_argument("--variants", default="plain,floor_counts,nanwatch")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--optimizer-built", action="store_true")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    variants = args.variants.split(",")
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for repeat in range(args.repeats):
        for variant in variants if repeat % 2 == 0 else variants[::-1]:
            result = run_child(args.model, variant, args.optimizer_built)
            runs[variant].append(result)
            brief = result.get("error") or ", ".join(
                f"{p} {result[p]:.2f}" for p in ("ttfs_s", *PHASES) if result.get(p) is not None
            )
            print(f"  {args.model} {variant} #{repeat}: {brief}", flush=True)
    print(f"\n**{args.model} (jit_compile=True), medians of seconds**\n")
    print("| variant | runs | first step | tf2xla | HLO passes | backend | compile | outside it |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for variant in variants:
        print(row(variant, runs[variant]))


if __name__ == "__main__":
    main()
