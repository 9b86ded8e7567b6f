"""What ``on_nonfinite="skip"`` and ``"rewind"`` cost a healthy step, against ``"stop"``.

    python bench/recovery_cost.py                     # transformer, 400 triples (~3 min on 2 CPUs)
    python bench/recovery_cost.py --model mlp --pairs 300 --jit

One process, the same model built three times (same weights, same batches),
each watched by its own NanWatch with the default options but
``on_nonfinite``: ``stop``, ``skip`` and ``rewind``. Each step is what
``fit`` runs (Keras' train function on one batch, then NanWatch's
``on_train_batch_end``), and the three alternate every step in a random
order, as ``paired.py`` does, so each triple sees the same machine. The
rewind points are on in all three (``rewind_every=50``, the default): what
``skip`` and ``rewind`` add is the undo of a non-finite step (the copy
decision agreed across replicas, the undo branch after the update; neither
runs its body on a healthy step) and the host's check of each row.

* ``ratio_median`` [quartiles] of each mode: the median over triples of
  mode / stop.
* ``ratio_of_sums``: all of the mode's steps' time over all of stop's.
* ``device_reads``: device-to-host reads of the record per mode (the same
  count: the undo is decided on the device).

Prints one ``RESULT {json}`` line at the end.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

MODES = ("stop", "skip", "rewind")


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="transformer", help="a bench/worker.py model")
    parser.add_argument("--pairs", type=int, default=400, help="steps of each mode, interleaved")
    parser.add_argument("--jit", action="store_true", help="jit_compile=True")
    return parser.parse_args()


def _runner(spec: dict, mode: str, jit: bool):
    """One step of ``fit``'s path for a fresh copy of the model watched with
    ``on_nonfinite=mode``; returns (run, the model)."""
    import keras
    import tensorflow as tf
    import worker

    import tb_nanwatch

    keras.utils.set_random_seed(0)
    model, x, y = worker.build(spec, jit_compile=jit)
    n = spec["batch"]
    batches = [
        (tf.constant(x[i * n : (i + 1) * n]), tf.constant(y[i * n : (i + 1) * n])) for i in range(8)
    ]
    watch = tb_nanwatch.NanWatch(
        tempfile.mkdtemp(prefix=f"nw{mode}-"), on_nonfinite=mode, remedy_trials=False
    )
    watch.set_model(model)
    watch.on_train_begin()
    watch.on_epoch_begin(0)

    def run(i: int) -> None:
        logs = model.train_function(iter([batches[i % len(batches)]]))
        watch.on_train_batch_end(i, logs)

    for i in range(10):  # tracing and first-call costs
        run(i)
    return run, model


def _counted_reads() -> dict:
    """Counts the device record's reads (buffer reads and rows handed over) by mode."""
    from tb_nanwatch.record import device_record

    counts = {"current": None}
    read, hand_over = device_record._read, device_record.DeviceRecord.hand_over

    def counted_read(var):
        counts[counts["current"]] = counts.get(counts["current"], 0) + 1
        return read(var)

    def counted_hand_over(self, row):
        counts[counts["current"]] = counts.get(counts["current"], 0) + 1
        return hand_over(self, row)

    device_record._read = counted_read
    device_record.DeviceRecord.hand_over = counted_hand_over
    return counts


def main() -> None:
    args = _arguments()
    import worker

    logging.getLogger("tb_nanwatch").setLevel(logging.ERROR)  # the not-watched notes
    spec = worker.parse_model(args.model)
    runs = {mode: _runner(spec, mode, args.jit) for mode in MODES}
    reads = _counted_reads()
    times = {mode: np.zeros(args.pairs) for mode in MODES}
    order = list(MODES)
    shuffle = random.Random(0).shuffle
    for i in range(10, 10 + args.pairs):
        shuffle(order)
        for mode in order:
            reads["current"] = mode
            started = time.perf_counter()
            runs[mode][0](i)
            times[mode][i - 10] = time.perf_counter() - started
    reads.pop("current")
    print("RESULT " + json.dumps(_summary(args, spec, runs, times, reads)), flush=True)


def _summary(args, spec: dict, runs: dict, times: dict, reads: dict) -> dict:
    out = {
        "model": args.model,
        "batch": spec["batch"],
        "jit": args.jit,
        "xla": bool(getattr(runs["stop"][1], "jit_compile", False)),
        "pairs": args.pairs,
        "load_average": list(os.getloadavg()),
        "stop_ms": float(np.median(times["stop"]) * 1e3),
        "device_reads": reads,
    }
    for mode in ("skip", "rewind"):
        ratio = times[mode] / times["stop"]
        out[mode] = {
            "ms": float(np.median(times[mode]) * 1e3),
            "ratio_median": float(np.median(ratio)),
            "ratio_q25": float(np.percentile(ratio, 25)),
            "ratio_q75": float(np.percentile(ratio, 75)),
            "ratio_of_sums": float(times[mode].sum() / times["stop"].sum()),
        }
    return out


if __name__ == "__main__":
    main()
