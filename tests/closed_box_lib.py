"""Hostile run dirs and a guarded CLI for the closed-box, limits and faults tests.

Every attacked run dir is first written by the project's own writers (the
journal through ``write_synthetic_run``, ``bundle.save_bundle`` and
``bundle.save_model``), then tampered with, as a teammate sending it could.

:func:`guarded_cli` runs ``tb-nanwatch`` commands in a fresh interpreter with
an audit hook (``sys.addaudithook``) that records every file opened, listed,
created, renamed or removed under the given ``outside`` paths, and the peak
resident memory (``VmHWM``, else ``ru_maxrss``) before and after each command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import numpy as np

from tb_nanwatch.evidence import metadata
from tb_nanwatch.record.writing.event_writer import RunWriter
from tb_nanwatch.record.writing.synthetic import write_synthetic_run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A command may grow the peak resident memory of its process by at most this
# much (the attacks measured 2.2 to 3.1 GB).
MEMORY_BOUND_MB = 300
# The report and the export (no TensorFlow) stay under this in all.
REPORT_PEAK_MB = 400

HARNESS = r"""
import io, json, logging, os, resource, sys, traceback, types
spec = json.loads(sys.argv[1])
if spec["notf"]:
    sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("notf"))
outside = [os.path.realpath(p) + os.sep for p in spec["outside"]]
touched, busy = [], [False]
EVENTS = {"open", "os.listdir", "os.scandir", "os.rename", "os.replace", "os.remove",
          "os.unlink", "os.mkdir", "os.symlink", "os.truncate", "os.chmod", "shutil.rmtree"}

def hook(event, args):
    if busy[0] or event not in EVENTS or not args or not isinstance(args[0], (str, bytes)):
        return
    busy[0] = True
    try:
        path = os.path.realpath(os.fsdecode(args[0])) + os.sep
        if any(path.startswith(root) for root in outside):
            touched.append([event, path.rstrip(os.sep)])
    finally:
        busy[0] = False

logs = io.StringIO()
logging.getLogger().addHandler(logging.StreamHandler(logs))
from tb_nanwatch import cli
if spec["preload_tf"]:
    import tensorflow, keras  # noqa: F401  (their memory is not the command's)
sys.addaudithook(hook)
def peak():
    # VmHWM: this process image's own peak (ru_maxrss also counts the parent's before exec)
    try:
        with open("/proc/self/status") as status:
            line = next(l for l in status if l.startswith("VmHWM:"))
        return int(line.split()[1]) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
results = []
for argv in spec["commands"]:
    out, err = io.StringIO(), io.StringIO()
    logs.seek(0); logs.truncate()
    touched.clear()
    before = peak()
    try:
        code, crash = cli.main(argv, out=out, err=err), None
    except BaseException:
        code, crash = None, traceback.format_exc()
    results.append({"argv": argv, "code": code, "crash": crash, "out": out.getvalue(),
                    "err": err.getvalue() + logs.getvalue(), "touched": list(touched),
                    "grew_mb": peak() - before, "peak_mb": peak()})
print("RESULTS " + json.dumps(results))
"""


def guarded_cli(
    commands: list[list[str]],
    outside: list[str],
    *,
    tensorflow: bool = False,
    cwd: str = REPO,
    path: tuple[str, ...] = (),
) -> list[dict]:
    """Runs each ``tb-nanwatch`` command (argv list) in one fresh interpreter;
    for each: ``code``, ``out``, ``err`` (stderr and log lines), ``crash`` (a
    traceback or None), ``touched`` (file operations under ``outside``),
    ``grew_mb`` (peak memory growth) and ``peak_mb``. ``tensorflow``: the
    commands need it (replay); it is imported before the first is measured.
    ``cwd``: where it runs (first on its ``sys.path``, as ``python -m``
    puts it); ``path``: more ``PYTHONPATH`` entries."""
    spec = {"commands": commands, "outside": outside, "notf": not tensorflow}
    spec["preload_tf"] = tensorflow
    pythonpath = os.pathsep.join((REPO, *path))
    env = dict(os.environ, PYTHONPATH=pythonpath, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run(
        [sys.executable, "-c", HARNESS, json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULTS ") :])


def assert_contained(result: dict) -> None:
    """Nothing outside read or written, no traceback, memory bounded."""
    assert result["crash"] is None, result["crash"]
    assert result["touched"] == [], result["touched"]
    assert result["grew_mb"] < MEMORY_BOUND_MB, result
    assert "Traceback" not in result["err"], result["err"]


def refusal_lines(result: dict, *words: str) -> list[str]:
    """The lines of ``err`` holding every one of ``words``."""
    return [line for line in result["err"].splitlines() if all(w in line for w in words)]


# -- run dirs written by the project's own writers ---------------------------------------


def good_runs(logdir: str) -> dict[str, int]:
    """Two ordinary runs beside the attacked one (a healthy one and one that
    stopped at an incident): name -> steps."""
    healthy = write_synthetic_run(os.path.join(logdir, "aaa_good"), 20)
    stopped = write_synthetic_run(os.path.join(logdir, "zzz_good"), 30, incident_step=25)
    return {"aaa_good": healthy["steps"], "zzz_good": stopped["steps"]}


def override_summary(run_dir: str, change: dict, step: int = 10**6) -> dict:
    """Writes a later run summary (the reader keeps the latest) with ``change``."""
    summary = write_synthetic_run(run_dir, 12, num_layers=2, incident_step=8)
    summary = {**summary, **change}
    writer = RunWriter(run_dir)
    writer.write_json(metadata.TAG_RUN, metadata.KIND_RUN, step, summary)
    writer.close()
    return summary


def input_incident(step: int = 8) -> dict:
    """An incident born in the input (the report then reads the bundle's batch)."""
    return {
        "step": step,
        "epoch": 0,
        "batch": step,
        "phase": "input",
        "layer": "input_0",
        "tensor": "model input input_0",
        "kind": "nan",
    }


def tiny_model():
    """A two-layer Sequential, compiled: what a bundle's model.keras holds."""
    import keras

    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4, name="big"), keras.layers.Dense(1, name="out")]
    )
    model.compile(optimizer="sgd", loss="mse")
    return model


def write_bundle_run(run_dir: str, step: int = 3) -> str:
    """A run dir with a reproduction bundle and its model, as a watched run
    writes them (the project's save_bundle and save_model); the bundle dir."""
    from tb_nanwatch.record.after_incident import bundle

    write_synthetic_run(run_dir, step + 1, num_layers=2, incident_step=step)
    model = tiny_model()
    weights = {v.path: v.numpy() for v in model.trainable_weights}
    x = np.ones((4, 3), np.float32)
    x[1, 2] = np.nan
    incident = {**input_incident(step), "phase": "forward", "layer": "big"}
    info = {"incident": incident, "exact": True, "weights_before_step": step}
    relative = bundle.save_bundle(
        run_dir, step, weights, [x, np.ones((4, 1), np.float32)], [0, 0], info
    )
    directory = os.path.join(run_dir, relative)
    bundle.save_model(directory, model)
    return directory


def edit_bundle_json(directory: str, **changes) -> None:
    path = os.path.join(directory, "bundle.json")
    with open(path, encoding="utf-8") as infile:
        meta = json.load(infile)
    meta.update(changes)
    with open(path, "w", encoding="utf-8") as outfile:
        json.dump(meta, outfile)


def write_npz_bomb(path: str, member: str, gib: float = 1.0) -> None:
    """A small ``.npz`` whose one float32 array inflates to ``gib`` GiB
    (streamed: the array is never in this process's memory)."""
    count = int(gib * 2**30) // 4
    chunk = bytes(2**24)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as archive:
        with archive.open(member + ".npy", "w", force_zip64=True) as out:
            header = {"descr": "<f4", "fortran_order": False, "shape": (count,)}
            np.lib.format.write_array_header_2_0(out, header)
            for _ in range(count * 4 // len(chunk)):
                out.write(chunk)
