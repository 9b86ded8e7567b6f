"""One measurement of ``bench/realistic.py``: one model, one variant, one process.

    python bench/realistic_child.py transformer nanwatch --steps 40 [--jit]

Prints ``RESULT {json}`` as its last line (see ``realistic.py`` for the fields).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import types

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402


def vm_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


class FloorRecorder:
    """Stands in for NanWatch's recorder in its instrumented Keras step: the
    same watched tensors, but only one bare ``reduce_sum`` of each, handed to
    the host once a step (``train_step.instrument`` routes the row here).

    With ``exact_counts`` (the ``floor_counts`` variant) the row also holds
    the exact NaN and Inf count of every one of those tensors, each sum its
    trigger, lazy as NanWatch's statistics backend builds them without XLA (``GraphStats``:
    held and counted in one rare conditional; under XLA a few at a time, as
    NanWatch counted before it took the counts in its statistics' own pass):
    what lazy exact counts cost on top of the floor, without NanWatch's other
    statistics (min, max, norms) and host side.
    """

    steps_per_execution = 1

    def __init__(self, model, exact_counts: bool = False) -> None:
        from tb_nanwatch.record.in_step.recorder import StepRecorder
        from tb_nanwatch.record.in_step.taps import LayerTaps

        self.model = model
        self.taps = LayerTaps(model)
        self.watched_tensors = StepRecorder.watched_tensors
        self.device = self
        self.tensors_read = 0
        self.exact_counts = exact_counts
        self._counts: list = []  # the lazy counts of the step being traced

    def guarded(self, method, *args):
        return method(*args)

    def before_update(self, inputs):
        import tensorflow as tf
        import worker

        from tb_nanwatch.record.stats import choose

        self._stats = choose.for_current_graph()  # as NanWatch's, once a step
        tensors = worker.floor_reads(inputs.trace, inputs.grads, inputs.y_pred)
        sums = [tf.reduce_sum(t) for t in tensors]
        self._counts = []
        if self.exact_counts:
            for t, total in zip(tensors, sums, strict=True):
                if t.dtype.is_floating:
                    trigger = tf.cast(total, tf.float32)
                    self._counts += self._stats.transient_counts_of([t], trigger).values()
        # As NanWatch's PendingStep: the step applies weight_gradients.
        return types.SimpleNamespace(
            sums=sums, weight_gradients=inputs.grads[: len(inputs.weights)]
        )

    def after_update(self, pending, weights):
        import tensorflow as tf

        from tb_nanwatch.record.stats import lazy_counts

        if self.exact_counts:  # the counts read each weight once
            weights = [tf.convert_to_tensor(v) for v in weights]
        weight_sums = [tf.reduce_sum(v) for v in weights]
        sums = pending.sums
        row = tf.cast(tf.stack(sums + weight_sums), tf.float32)
        self.tensors_read = len(sums) + len(weight_sums)
        if not self.exact_counts:
            return row
        counts = list(self._counts)
        for v, total in zip(weights, weight_sums, strict=True):
            if v.dtype.is_floating:
                counts += lazy_counts.counts_of([v], tf.cast(total, tf.float32)).values()
        return tf.concat([row, _exact_counts(self._stats, counts)], 0)

    def hand_over(self, row) -> None:
        row.numpy()


def _exact_counts(stats, counts: list):
    """Every lazy count of ``counts``, as NanWatch's step computes them
    (``stats``: the step's statistics backend)."""
    import tensorflow as tf

    triggers = list({id(c.trigger): c.trigger for c in counts}.values())
    return stats.lazy_count_values(
        counts, [""] * len(counts), lambda: tf.logical_not(stats.all_finite(triggers))
    )


class Probe:
    """Times the batches, and the allocator's peak above resident per step."""

    def __init__(self, keras, tf, warmup: int) -> None:
        self.tf, self.warmup = tf, warmup
        self.ends: list[float] = []
        self.peaks: list[int] = []
        gpus = tf.config.list_logical_devices("GPU")
        self.device = "GPU:0" if gpus else "CPU:0"
        self.callback = keras.callbacks.LambdaCallback(
            on_train_batch_begin=self.begin, on_train_batch_end=self.end
        )
        self._before = 0

    def begin(self, batch, logs=None) -> None:
        if len(self.ends) >= self.warmup:
            try:
                self.tf.config.experimental.reset_memory_stats(self.device)
                self._before = self.tf.config.experimental.get_memory_info(self.device)["current"]
            except (ValueError, RuntimeError):
                self._before = None

    def end(self, batch, logs=None) -> None:
        self.ends.append(time.perf_counter())
        if len(self.ends) > self.warmup and self._before is not None:
            peak = self.tf.config.experimental.get_memory_info(self.device)["peak"]
            self.peaks.append(peak - self._before)


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument(
        "variant", choices=["plain", "floor", "floor_counts", "nanwatch", "nanwatch_before"]
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--jit", action="store_true")
    parser.add_argument("--optimizer-built", action="store_true")
    args = parser.parse_args()

    import keras
    import tensorflow as tf
    import worker

    keras.utils.set_random_seed(0)
    spec = worker.parse_model(args.model)
    model, x, y = worker.build(spec, jit_compile=args.jit)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(spec["batch"], drop_remainder=True)
    data = data.repeat().prefetch(2)
    if args.optimizer_built:  # as after an earlier fit, or for a loaded model
        model.optimizer.build(model.trainable_variables)
    probe = Probe(keras, tf, args.warmup)
    callbacks, log_dir, floor = [], None, None
    if args.variant.startswith("nanwatch"):
        import tb_nanwatch

        log_dir = tempfile.mkdtemp(prefix="nwreal-")
        callbacks.append(tb_nanwatch.NanWatch(log_dir))
    started = time.perf_counter()
    if args.variant.startswith("floor"):
        from tb_nanwatch.record.in_step import train_step

        floor = FloorRecorder(model, exact_counts=args.variant == "floor_counts")
        floor.taps.install()
        train_step.instrument(model, floor)
    steps = args.warmup + args.steps + 1
    model.fit(
        data, epochs=1, steps_per_epoch=steps, callbacks=callbacks + [probe.callback], verbose=0
    )
    gaps = np.diff(probe.ends)[args.warmup :]
    result = {
        "model": args.model,
        "variant": args.variant,
        "jit": args.jit,
        "xla": bool(getattr(model, "jit_compile", False)),
        "optimizer_built": args.optimizer_built,
        "ttfs_s": probe.ends[0] - started,
        "step_ms": float(np.median(gaps) * 1e3),
        "peak_rss_mb": vm_kib("VmHWM") / 1024,
        "device_peak_mb": min(probe.peaks) / 2**20 if probe.peaks else None,
        "device": probe.device,
        "params": int(model.count_params()),
    }
    if log_dir is not None:
        watch = callbacks[0]
        recorded = watch.journal.steps if watch.journal else 0
        result["event_bytes_per_step"] = dir_bytes(log_dir) / max(recorded, 1)
        result["incident"] = watch.incident
        recorder = getattr(watch, "_recorder", None)
        if recorder is not None and recorder.schema is not None:
            result["watched_tensors"] = len(recorder.schema.entries)
    if floor is not None:
        result["watched_tensors"] = floor.tensors_read
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
