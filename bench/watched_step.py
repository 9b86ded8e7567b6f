"""``fit``'s step for a bench/worker.py model watched by NanWatch, and paired timing of several.

Shared by ``recovery_cost.py`` and ``rewind_cost.py``: each builds the same
model (same weights, same batches) once per variant, watched with the
variant's options, and times the variants' steps interleaved in a random order
every step, as ``paired.py`` does, so every variant sees the same machine.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

WARMUP = 10  # steps run before timing: tracing and first-call costs


def watched_fit_step(spec: dict, jit: bool, prefix: str, **options: Any):
    """One step of ``fit``'s path (Keras' train function on one batch, then
    NanWatch's ``on_train_batch_end``) for a fresh copy of the model watched
    with ``NanWatch(..., remedy_trials=False, **options)``, warmed up for
    ``WARMUP`` steps; returns (run, the NanWatch, the model)."""
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
    watch = tb_nanwatch.NanWatch(tempfile.mkdtemp(prefix=prefix), remedy_trials=False, **options)
    watch.set_model(model)
    watch.on_train_begin()
    watch.on_epoch_begin(0)

    def run(i: int) -> None:
        logs = model.train_function(iter([batches[i % len(batches)]]))
        watch.on_train_batch_end(i, logs)

    for i in range(WARMUP):
        run(i)
    return run, watch, model


def interleaved_times(
    runs: dict[str, Callable[[int], None]],
    pairs: int,
    before: Callable[[str], None] | None = None,
) -> dict[str, np.ndarray]:
    """Seconds of each of ``pairs`` steps of every run, the runs in a random
    order (seeded) each step; ``before(name)`` is called ahead of each timed step."""
    times = {name: np.zeros(pairs) for name in runs}
    order = list(runs)
    shuffle = random.Random(0).shuffle
    for i in range(WARMUP, WARMUP + pairs):
        shuffle(order)
        for name in order:
            if before is not None:
                before(name)
            started = time.perf_counter()
            runs[name](i)
            times[name][i - WARMUP] = time.perf_counter() - started
    return times
