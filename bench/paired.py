"""Paired, step-by-step A/B of NanWatch's in-graph cost, in one process.

``run_bench.py`` times each tool in its own process, in interleaved rounds of
tens of steps; on a shared VM a round can land in a fast or a slow phase of
the machine, which leaves about +-0.1 of noise in the ratios. This script
takes the other road: one process, the same model built twice (same weights,
same batches) as a plain custom training step and as the same step watched by
:class:`tb_nanwatch.StepWatcher`, and it alternates them *every step*, in a
random order, so both halves of each pair see the same machine. The ratio is
the median over pairs of (watched step / plain step), with its quartiles.

A third variant, ``floor``, is the plain step plus *one bare reduction*
(``reduce_sum``) of every tensor NanWatch reads (each watched layer's output,
every gradient it asks for, every weight after the update) and one transfer
of the results: no min/max, norms, counts, packing or host work. It is what
any per-tensor, every-step check of those tensors costs at least on this
machine, and so how low NanWatch's ratio can go without checking fewer tensors.
With ``--front-end fit --floor-counts``, ``floor_counts`` adds to it the exact
NaN/Inf counts of those tensors, built as NanWatch builds them: the floor of a
check that also counts.

Each variant's memory is measured too: the peak bytes a step allocates above
what was resident before it (TensorFlow's allocator statistics), the least
over 5 steps.

By default it measures the custom-loop front end (``StepWatcher``, the host
side included: ``end_step``, one read of the row, the journal). With
``--front-end fit`` each step is what ``fit`` runs: Keras' train function on
one batch and NanWatch's ``on_train_batch_end`` (the row comes back with the
step's outputs, no read); Keras' own loop around them is the same for every
variant and left out.

    python bench/paired.py                      # mlp, ~1 min
    python bench/paired.py --front-end fit      # the same through fit's path
    python bench/paired.py --models mlp,lstm --pairs 2000 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402


def _plain_runner(model, optimizer, loss_fn, batches):
    import tensorflow as tf

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    def run(i: int) -> None:
        step(*batches[i % len(batches)]).numpy()

    return run


def _floor_runner(model, optimizer, loss_fn, batches):
    import tensorflow as tf
    import worker

    from tb_nanwatch.record.in_step.recorder import StepRecorder
    from tb_nanwatch.record.in_step.taps import LayerTaps

    taps = LayerTaps(model)  # the same watched tensors as NanWatch's
    taps.install()
    weights = model.trainable_variables

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape, taps.recording(tape) as trace:
            y_pred = model(x, training=True)
            loss = loss_fn(y, y_pred)
        grads = tape.gradient(loss, list(weights) + StepRecorder.watched_tensors(trace))
        optimizer.apply_gradients(zip(grads[: len(weights)], weights, strict=True))
        sums = [tf.reduce_sum(t) for t in worker.floor_reads(trace, grads, y_pred)]
        sums += [tf.reduce_sum(v) for v in weights]  # read after the update
        return loss, tf.stack(sums)

    def run(i: int) -> None:
        step(*batches[i % len(batches)])[1].numpy()

    return run


def _watched_runner(model, optimizer, loss_fn, batches, watcher):
    import tensorflow as tf

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape, watcher.forward(tape, x, y) as rec:
            y_pred = model(x, training=True)
            loss = rec.loss(loss_fn(y, y_pred), y_pred=y_pred)
        grads = tape.gradient(loss, rec.sources(model.trainable_variables))
        grads = rec.gradients(grads)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        rec.after_update()
        return loss

    def run(i: int) -> None:
        step(*batches[i % len(batches)]).numpy()
        watcher.end_step()

    return run


def _fit_runner(model, batches, variant: str, log_dir: str):
    """One step of ``fit``'s own path: Keras' train function on one batch,
    then what ``fit`` calls after it (NanWatch's ``on_train_batch_end``)."""
    from realistic_child import FloorRecorder

    import tb_nanwatch
    from tb_nanwatch.record.in_step import train_step

    callback = None
    if variant.startswith("floor"):
        floor = FloorRecorder(model, exact_counts=variant == "floor_counts")
        floor.taps.install()
        train_step.instrument(model, floor)
    elif variant == "nanwatch":
        callback = tb_nanwatch.NanWatch(log_dir)
        callback.set_model(model)
        callback.on_train_begin()
        callback.on_epoch_begin(0)
    else:
        model.make_train_function()

    def run(i: int) -> None:
        logs = model.train_function(iter([batches[i % len(batches)]]))
        if callback is not None:
            callback.on_train_batch_end(i, logs)

    return run


def make_steps(
    spec: str, variants: list[str], log_root: str, front_end: str = "loop", jit: bool = False
) -> dict:
    """One runner per variant, each on its own copy of the same model
    (compiled by XLA with ``jit``: the ``fit`` front end only)."""
    import keras
    import tensorflow as tf
    import worker

    import tb_nanwatch

    shape = worker.parse_model(spec)
    steps = {}
    for variant in variants:
        keras.utils.set_random_seed(0)
        model, x, y = worker.build(shape, jit_compile=jit)
        n = shape["batch"]
        batches = [
            (tf.constant(x[i * n : (i + 1) * n]), tf.constant(y[i * n : (i + 1) * n]))
            for i in range(8)
        ]
        optimizer = keras.optimizers.Adam(1e-3)
        loss_fn = keras.losses.SparseCategoricalCrossentropy()
        if front_end == "fit":
            run = _fit_runner(model, batches, variant, os.path.join(log_root, f"{spec}-fit"))
        elif variant == "plain":
            run = _plain_runner(model, optimizer, loss_fn, batches)
        elif variant == "floor":
            run = _floor_runner(model, optimizer, loss_fn, batches)
        else:
            watcher = tb_nanwatch.StepWatcher(
                os.path.join(log_root, f"{spec}-{variant}"),
                model,
                optimizer,
                pre_step_weights="every_step" if variant == "nanwatch_every_step" else "on_suspect",
            )
            run = _watched_runner(model, optimizer, loss_fn, batches, watcher)
        for i in range(10):  # tracing and first-call costs
            run(i)
        run.xla = bool(getattr(model, "jit_compile", False))  # whether XLA stayed on
        steps[variant] = run
    return steps


def peak_step_memory(run, steps: int = 5) -> int:
    """Bytes a step allocates above what was resident before it (the least
    over ``steps`` steps), from TensorFlow's allocator statistics."""
    import tensorflow as tf

    device = "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"
    peaks = []
    for i in range(steps):
        tf.config.experimental.reset_memory_stats(device)
        before = tf.config.experimental.get_memory_info(device)["current"]
        run(i)
        peaks.append(tf.config.experimental.get_memory_info(device)["peak"] - before)
    return min(peaks)


def measure(
    spec: str,
    pairs: int,
    variants: list[str],
    log_root: str,
    front_end: str = "loop",
    jit: bool = False,
) -> dict:
    steps = make_steps(spec, variants, log_root, front_end, jit)
    peaks = {v: peak_step_memory(steps[v]) for v in variants}
    times = {v: np.zeros(pairs) for v in variants}
    order = list(variants)
    shuffle = random.Random(0).shuffle
    for i in range(pairs):
        shuffle(order)
        for v in order:
            start = time.perf_counter()
            steps[v](i)
            times[v][i] = time.perf_counter() - start
    rows = []
    for v in variants:
        ratio = times[v] / times["plain"]
        rows.append(
            {
                "variant": v,
                "median_ms": float(np.median(times[v]) * 1e3),
                "ratio_median": float(np.median(ratio)),
                "ratio_q25": float(np.percentile(ratio, 25)),
                "ratio_q75": float(np.percentile(ratio, 75)),
                "step_peak_bytes": int(peaks[v]),
                "xla": steps[v].xla,
            }
        )
    return {"model": spec, "front_end": front_end, "jit": jit, "pairs": pairs, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp")
    parser.add_argument("--pairs", type=int, default=1500)
    parser.add_argument(
        "--front-end",
        choices=["loop", "fit"],
        default="loop",
        help="loop: a custom training loop with StepWatcher; fit: Keras' train "
        "function with the NanWatch callback, as fit calls them",
    )
    parser.add_argument(
        "--floor-counts",
        action="store_true",
        help="with --front-end fit, also floor_counts: the floor plus exact NaN/Inf "
        "counts of the same tensors, built as NanWatch builds them",
    )
    parser.add_argument(
        "--jit", action="store_true", help="with --front-end fit: every model jit_compile=True"
    )
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args()
    if args.floor_counts and args.front_end != "fit":
        parser.error("--floor-counts needs --front-end fit")
    if args.jit and args.front_end != "fit":
        parser.error("--jit needs --front-end fit")
    variants = ["plain", "floor", "nanwatch"]
    if args.front_end == "loop":
        variants.append("nanwatch_every_step")
    if args.floor_counts:
        variants.insert(2, "floor_counts")
    results = []
    with tempfile.TemporaryDirectory(prefix="nwpaired-") as log_root:
        for spec in args.models.split(","):
            result = measure(spec, args.pairs, variants, log_root, args.front_end, args.jit)
            results.append(result)
            xla = ", jit_compile=True" if args.jit else ""
            print(f"== {spec}, {args.front_end}{xla} ({args.pairs} pairs)")
            for row in result["rows"]:
                print(
                    f"  {row['variant']:22s} median {row['median_ms']:7.2f} ms/step  "
                    f"paired ratio {row['ratio_median']:.3f} "
                    f"[q25 {row['ratio_q25']:.3f}, q75 {row['ratio_q75']:.3f}]  "
                    f"step peak {row['step_peak_bytes'] / 2**20:.2f} MiB above resident"
                    + ("  (XLA)" if row["xla"] else ""),
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
