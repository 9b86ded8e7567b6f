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
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from watched_step import interleaved_times, watched_fit_step  # noqa: E402

MODES = ("stop", "skip", "rewind")


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="transformer", help="a bench/worker.py model")
    parser.add_argument("--pairs", type=int, default=400, help="steps of each mode, interleaved")
    parser.add_argument("--jit", action="store_true", help="jit_compile=True")
    return parser.parse_args()


def _counted_reads() -> dict:
    """Counts the device record's reads (buffer reads and rows handed over) by mode."""
    from tb_nanwatch.record.in_step import device_record

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
    runs = {
        mode: watched_fit_step(spec, args.jit, f"nw{mode}-", on_nonfinite=mode) for mode in MODES
    }
    reads = _counted_reads()

    def count_as(mode: str) -> None:
        reads["current"] = mode

    times = interleaved_times(
        {mode: run for mode, (run, _, _) in runs.items()}, args.pairs, before=count_as
    )
    reads.pop("current")
    print("RESULT " + json.dumps(_summary(args, spec, runs, times, reads)), flush=True)


def _summary(args, spec: dict, runs: dict, times: dict, reads: dict) -> dict:
    out = {
        "model": args.model,
        "batch": spec["batch"],
        "jit": args.jit,
        "xla": bool(getattr(runs["stop"][2], "jit_compile", False)),
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
