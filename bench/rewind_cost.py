"""What the rewind points cost: NanWatch with ``rewind_every=K`` against ``rewind_every=0``.

    python bench/rewind_cost.py                  # transformer, K=50, 600 pairs (~2.5 min on 2 CPUs)
    python bench/rewind_cost.py --model mlp --every 10 --pairs 400 --jit
    python bench/rewind_cost.py --models resnet50 --batch 4 --pairs 150   # ResNet50 64x64 + Adam

One process, the same model built twice (same weights, same batches), each
watched by its own NanWatch: ``rewind`` (``rewind_every=K``: the device ring
of batches written every step, a host snapshot of the weights and optimizer
state every K steps) and ``off`` (``rewind_every=0``). Each step is what
``fit`` runs (Keras' train function on one batch, then NanWatch's
``on_train_batch_end``, where the snapshots are taken), and the two
alternate every step in a random order, as ``paired.py`` does, so both halves
of a pair see the same machine.

* ``ratio_median`` [quartiles]: the median over pairs of rewind / off: the
  per-step cost (the ring write); a snapshot step is one pair in K.
* ``snapshot_ms``: the median time of one snapshot (timed around it).
* ``ratio_amortized``: ``ratio_median + snapshot_ms / (K * off step)``: the
  cost per step with the snapshots spread over their K steps.
* ``ratio_of_sums``: all rewind steps' time over all off steps' (holds
  everything, the background writer's share of the CPUs included, and the
  machine's outliers).
* ``host_mb``: the snapshots' host memory at once (one on a local run dir:
  each is written to disk in the background, then released);
  ``disk_mb``: the snapshot files' size at the end (the two kept);
  ``peak_rss_mb``: the process's peak resident memory (both models, both
  optimizers, TensorFlow and the snapshots).

``--models a,b`` runs each model in turn (one ``RESULT`` line each).
Prints one ``RESULT {json}`` line at the end of each model.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from watched_step import interleaved_times, watched_fit_step  # noqa: E402


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="transformer", help="a bench/worker.py model")
    parser.add_argument(
        "--models", default=None, help="several, comma-separated (overrides --model)"
    )
    parser.add_argument(
        "--batch", type=int, default=None, help="the batch size (default: the model's)"
    )
    parser.add_argument("--every", type=int, default=50, help="rewind_every of the measured run")
    parser.add_argument("--pairs", type=int, default=600, help="steps of each variant, paired")
    parser.add_argument("--jit", action="store_true", help="jit_compile=True")
    return parser.parse_args()


_SNAPSHOT_TIMES: list[float] = []


def _timed_snapshots() -> list[float]:
    """Times every snapshot the rewind points take from now on (the host
    copy; the file is written in the background); returns the list."""
    from tb_nanwatch.record.after_incident import rewind_points

    _SNAPSHOT_TIMES.clear()
    original = rewind_points.RewindRing.take
    if getattr(original, "timed", False):
        return _SNAPSHOT_TIMES

    def take(self, *args, **kwargs):
        started = time.perf_counter()
        original(self, *args, **kwargs)
        _SNAPSHOT_TIMES.append(time.perf_counter() - started)

    take.timed = True
    rewind_points.RewindRing.take = take
    return _SNAPSHOT_TIMES


def main() -> None:
    args = _arguments()
    logging.getLogger("tb_nanwatch").setLevel(logging.ERROR)  # the not-watched notes
    for name in (args.models or args.model).split(","):
        args.model = name.strip()
        _measure(args)


def _measure(args: argparse.Namespace) -> None:
    import worker

    spec = worker.parse_model(args.model)
    if args.batch:
        spec["batch"] = args.batch
    runs = {
        name: watched_fit_step(spec, args.jit, "nwrewind-", rewind_every=every)
        for name, every in (("off", 0), ("rewind", args.every))
    }
    snapshots = _timed_snapshots()
    times = interleaved_times({name: run for name, (run, _, _) in runs.items()}, args.pairs)
    print("RESULT " + json.dumps(_summary(args, spec, runs, times, snapshots)), flush=True)
    for _, watch, _ in runs.values():
        watch.on_train_end()  # the snapshot files go


def _disk_mb(ring) -> float:
    """The snapshot files' size now (0 for snapshots in memory)."""
    if ring is None or ring.disk is None:
        return 0.0
    ring.settle(wait=True)
    return sum(os.path.getsize(s.path) for s in ring.snapshots if s.path) / 2**20


def _summary(args, spec: dict, runs: dict, times: dict, snapshots: list[float]) -> dict:
    ratio = times["rewind"] / times["off"]
    off_ms = float(np.median(times["off"]) * 1e3)
    snapshot_ms = float(np.median(snapshots) * 1e3) if snapshots else 0.0
    _, watch, model = runs["rewind"]
    ring = watch._session.rewind
    device_ring = watch._recorder.device.ring
    variables = list(model.weights) + list(model.optimizer.variables)
    state = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in variables)
    return {
        "model": args.model,
        "batch": spec["batch"],
        "jit": args.jit,
        "xla": bool(getattr(model, "jit_compile", False)),
        "rewind_every": args.every,
        "pairs": args.pairs,
        "off_ms": off_ms,
        "rewind_ms": float(np.median(times["rewind"]) * 1e3),
        "ratio_median": float(np.median(ratio)),
        "ratio_q25": float(np.percentile(ratio, 25)),
        "ratio_q75": float(np.percentile(ratio, 75)),
        "snapshot_ms": snapshot_ms,
        "snapshots": len(snapshots),
        "ratio_amortized": float(np.median(ratio)) + snapshot_ms / (args.every * off_ms),
        "ratio_of_sums": float(times["rewind"].sum() / times["off"].sum()),
        "state_mb": state / 2**20,
        "host_mb": (1 if ring is not None and ring.disk else 2) * state / 2**20,
        "disk_mb": _disk_mb(ring),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "ring_mb": device_ring.nbytes() / 2**20 if device_ring is not None else None,
        "ring_slots": ring.slots if ring is not None else None,
        "not_taken_why": ring.not_taken_why if ring is not None else "rewind off",
    }


if __name__ == "__main__":
    main()
