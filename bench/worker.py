"""One benchmark configuration (model x tool) in its own process.

Run by ``bench/run_bench.py``; not meant to be run by hand (but it can be:
``python bench/worker.py --model mlp --tool nanwatch --steps 20 --rounds 2``
then type ``go`` + Enter for every round).

Protocol (lines on stdout prefixed with ``BENCH``, JSON after the prefix; TF's
own chatter goes to stderr):

* the worker builds the model, enables its tool, and starts ONE ``model.fit``
  whose ``steps_per_epoch`` covers warm-up + all rounds (a single fit: no
  retrace between rounds, as in real training);
* after the warm-up steps (tracing excluded) it prints ``{"event": "ready"}``
  and blocks, inside the last callback of the step, until the parent writes
  ``go``; then it times ``--steps`` steps (wall time between consecutive
  ``on_train_batch_end`` of the timing callback, which is the last callback,
  so the tool's own callback work is inside the interval), prints
  ``{"event": "round", ...}`` and blocks again;
* ``stop`` ends training early; after the last round it prints ``{"event":
  "done", ...}`` with memory, event-file and transfer facts.

While blocked the process uses no CPU, so the parent can keep one worker per
tool alive and interleave rounds A B C A B C ...: drift of the shared machine
hits every tool alike.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

TOOLS = (
    "plain",
    "terminate_on_nan",
    "nanwatch",
    "nanwatch_every_step",
    "check_numerics",
    "dbg_curt_health",
    "dbg_full_health",
)


def emit(event: str, **fields) -> None:
    sys.stdout.write("BENCH " + json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def vm_rss_kib(pid: int | str = "self") -> int:
    """Resident set size in KiB from /proc (no psutil)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


def dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


# -- models --------------------------------------------------------------------


def parse_model(spec: str) -> dict:
    """``mlp`` | ``conv`` | ``lstm`` | ``resnet50`` | ``transformer`` |
    ``transformer110m`` | ``mlpdeep:<depth>:<width>:<batch>``."""
    if spec == "resnet50":
        return {"kind": "resnet50", "batch": 16}
    if spec == "transformer":
        return {"kind": "transformer", "batch": 16}
    if spec == "transformer110m":  # BERT-base-sized: 12 x 768, vocabulary 16000, 110M parameters
        return {
            "kind": "transformer",
            "batch": 4,
            "shape": {"vocab": 16000, "width": 768, "blocks": 12, "seq": 64},
        }
    if spec == "mlp":
        return {"kind": "mlp", "depth": 12, "width": 256, "batch": 64}
    if spec == "conv":
        return {"kind": "conv", "batch": 128}
    if spec == "lstm":
        return {"kind": "lstm", "batch": 64}
    if spec.startswith("mlpdeep:"):
        _, depth, width, batch = spec.split(":")
        return {"kind": "mlp", "depth": int(depth), "width": int(width), "batch": int(batch)}
    raise ValueError(f"unknown model {spec!r}")


def build(spec: dict, jit_compile: bool = False):
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    kind = spec["kind"]
    if kind == "mlp":
        width, depth = spec["width"], spec["depth"]
        inputs = keras.Input((width,), name="x")
        h = inputs
        for i in range(depth):
            h = keras.layers.Dense(width, activation="relu", name=f"dense{i}")(h)
        outputs = keras.layers.Dense(10, activation="softmax", name="out")(h)
        x = rng.standard_normal((4096, width)).astype("float32")
        y = rng.integers(0, 10, 4096)
    elif kind == "conv":
        inputs = keras.Input((32, 32, 3), name="image")
        h = inputs
        for i, filters in enumerate((32, 32, 64, 64, 128, 128)):
            h = keras.layers.Conv2D(filters, 3, padding="same", activation="relu", name=f"conv{i}")(
                h
            )
            if i in (1, 3):
                h = keras.layers.MaxPooling2D(name=f"pool{i}")(h)
        h = keras.layers.GlobalAveragePooling2D(name="gap")(h)
        outputs = keras.layers.Dense(10, activation="softmax", name="out")(h)
        x = rng.standard_normal((2048, 32, 32, 3)).astype("float32")
        y = rng.integers(0, 10, 2048)
    elif kind == "lstm":
        inputs = keras.Input((32, 32), name="seq")
        h = keras.layers.LSTM(64, return_sequences=True, name="lstm")(inputs)
        a = keras.layers.MultiHeadAttention(num_heads=4, key_dim=16, name="attn")(h, h)
        h = keras.layers.Add(name="residual")([h, a])
        h = keras.layers.LayerNormalization(name="norm")(h)
        h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
        outputs = keras.layers.Dense(10, activation="softmax", name="out")(h)
        x = rng.standard_normal((4096, 32, 32)).astype("float32")
        y = rng.integers(0, 10, 4096)
    elif kind == "resnet50":
        backbone = keras.applications.ResNet50(
            weights=None, include_top=False, input_shape=(64, 64, 3), pooling="avg"
        )
        inputs = keras.Input((64, 64, 3), name="image")
        outputs = keras.layers.Dense(10, activation="softmax", name="out")(backbone(inputs))
        x = rng.standard_normal((512, 64, 64, 3)).astype("float32")
        y = rng.integers(0, 10, 512)
    elif kind == "transformer":
        shape = spec.get("shape", {})
        vocab, seq = shape.get("vocab", 2000), shape.get("seq", 64)
        inputs, outputs = _transformer(keras, **shape)
        x = rng.integers(0, vocab, (512, seq)).astype("int32")
        y = rng.integers(0, vocab, (512, seq))
    else:
        raise ValueError(kind)
    model = keras.Model(inputs, outputs, name=kind)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss="sparse_categorical_crossentropy",
        jit_compile=jit_compile,
    )
    return model, x, y


def _transformer(keras, vocab: int = 2000, width: int = 128, blocks: int = 4, seq: int = 64):
    """A post-norm transformer encoder LM: Embedding, ``blocks`` x [MHA (64-wide
    heads) + LayerNorm + Dense 4*width gelu + Dense width + LayerNorm],
    Dense(vocab) head. The defaults: the small one (4 x 128, 4 heads)."""
    inputs = keras.Input((seq,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(vocab, width, name="embed")(inputs)
    heads = max(4, width // 64)
    for i in range(blocks):
        a = keras.layers.MultiHeadAttention(heads, width // heads, name=f"block{i}_attn")(h, h)
        h = keras.layers.LayerNormalization(name=f"block{i}_norm1")(h + a)
        f = keras.layers.Dense(4 * width, activation="gelu", name=f"block{i}_ffn1")(h)
        f = keras.layers.Dense(width, name=f"block{i}_ffn2")(f)
        h = keras.layers.LayerNormalization(name=f"block{i}_norm2")(h + f)
    outputs = keras.layers.Dense(vocab, activation="softmax", name="out")(h)
    return inputs, outputs


def floor_reads(trace, grads: list, y_pred) -> list:
    """What the ``floor`` variants read once a step (besides every weight after
    the update): each watched layer's output (a model output's logits where
    NanWatch reads those instead) and every gradient NanWatch asks for, each
    tensor once."""
    import tensorflow as tf

    from tb_nanwatch.record.in_step.phase_stats import logits_read_instead

    instead = logits_read_instead(tf.nest.flatten(y_pred))
    outputs = [instead.get(id(t), t) for call in trace.calls for t in call.outputs]
    grads = [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads]
    return list({id(t): t for t in outputs + [g for g in grads if g is not None]}.values())


# -- timing ----------------------------------------------------------------------


def make_timer(keras, args, controller):
    class StepTimer(keras.callbacks.Callback):
        """Last callback: per-step wall time, pauses between rounds."""

        def __init__(self) -> None:
            super().__init__()
            self.batch_index = -1
            self.t_prev = None
            self.times: list[float] = []
            self.round = 0

        def on_train_batch_end(self, batch, logs=None) -> None:
            now = time.perf_counter()
            self.batch_index += 1
            if self.batch_index < args.warmup - 1:
                return
            if self.batch_index == args.warmup - 1:
                controller.ready()
                self.t_prev = time.perf_counter()
                return
            self.times.append(now - self.t_prev)
            controller.after_step(self)
            if len(self.times) == args.steps:
                self.round += 1
                controller.round_done(self, self.times)
                self.times = []
                # Always wait: after the last round the parent says "finish"
                # only once nobody else is being timed (tearing down a tool,
                # e.g. Debugger V2 dumping its buffers, must not load the CPU
                # while another tool is timed).
                if not controller.wait_go() or self.round >= args.rounds:
                    self.model.stop_training = True
            self.t_prev = time.perf_counter()

    return StepTimer()


class Controller:
    def __init__(self, args) -> None:
        self.args = args
        self.extra: dict = {}
        self.step_hook = None

    def ready(self) -> None:
        emit("ready", pid=os.getpid(), rss_kib=vm_rss_kib())
        self.wait_go()

    def wait_go(self) -> bool:
        if self.args.no_wait:
            return True
        line = sys.stdin.readline()
        return line.strip() == "go"

    def after_step(self, timer) -> None:
        if self.step_hook is not None:
            self.step_hook(timer)

    def round_done(self, timer, times: list[float]) -> None:
        ordered = sorted(times)
        emit(
            "round",
            round=timer.round,
            median_ms=1e3 * ordered[len(ordered) // 2],
            mean_ms=1e3 * sum(times) / len(times),
            times_ms=[round(1e3 * t, 4) for t in times],
        )


# -- tools -----------------------------------------------------------------------


def setup_tool(tool: str, workdir: str) -> tuple[list, dict]:
    """Enables ``tool`` (before the model is built); returns its callbacks."""
    import keras
    import tensorflow as tf

    info: dict = {}
    if tool == "plain":
        return [], info
    if tool == "terminate_on_nan":
        return [keras.callbacks.TerminateOnNaN()], info
    if tool in ("nanwatch", "nanwatch_every_step"):
        from tb_nanwatch import NanWatch

        log_dir = os.path.join(workdir, "nanwatch")
        kwargs = {} if tool == "nanwatch" else {"pre_step_weights": "every_step"}
        info["log_dir"] = log_dir
        return [NanWatch(log_dir, **kwargs)], info
    if tool == "check_numerics":
        tf.debugging.enable_check_numerics()
        return [], info
    if tool in ("dbg_curt_health", "dbg_full_health"):
        mode = "CURT_HEALTH" if tool == "dbg_curt_health" else "FULL_HEALTH"
        dump_root = os.path.join(workdir, "tfdbg2")
        # Default circular buffer (1000 execution/graph-execution events, kept
        # in memory and written at exit): the cheapest Debugger V2 setting.
        tf.debugging.experimental.enable_dump_debug_info(
            dump_root, tensor_debug_mode=mode, circular_buffer_size=1000
        )
        info["dump_root"] = dump_root
        return [], info
    raise ValueError(f"unknown tool {tool!r}")


def _zero_fields(patch: str) -> None:
    """One kind of entry's statistics replaced by zeros, in both statistics backends."""
    import tensorflow as tf

    from tb_nanwatch.record.stats.backend import StatsBackend
    from tb_nanwatch.record.stats.graph import GraphStats
    from tb_nanwatch.record.stats.xla import XlaStats

    def zeros(*names):
        return lambda self, *args, **kwargs: {k: tf.constant(0.0) for k in names}

    method, fields = {
        "notensorstats": ("tensor_fields", ("nan", "inf", "min", "max")),
        "nogradstats": ("gradient_fields", ("nan", "inf", "norm")),
    }.get(patch, ("value_fields", ("nan", "inf")))
    for backend in (GraphStats, XlaStats):
        setattr(backend, method, zeros(*fields))
    if method != "tensor_fields":  # XLA's *_each forms share passes; the base's call each one
        setattr(XlaStats, f"{method}_each", getattr(StatsBackend, f"{method}_each"))


def apply_patches(patches: list[str]) -> None:
    """Profiling experiments: switch parts of NanWatch off to price them."""

    for patch in patches:
        if patch == "before":  # another copy of the package (NWBENCH_BEFORE_PATH)
            sys.path.insert(0, os.environ["NWBENCH_BEFORE_PATH"])
            sys.modules.pop("tb_nanwatch", None)
        elif patch in ("nocounts", "notensorstats", "nogradstats", "noweightcounts"):
            # nocounts, noweightcounts: weights' nan/inf counts after the update replaced by 0
            _zero_fields(patch)
        elif patch == "nohost":  # no host-side work after the step (no fetch, no journal)
            from tb_nanwatch.record import callback

            callback.NanWatch.on_train_batch_end = lambda self, batch, logs=None: None
        elif patch == "nojournal":  # fetch the row, but do not record it
            from tb_nanwatch.record.writing import journal

            journal.RunJournal.record = lambda self, *a, **k: None
        elif patch == "asyncjournal":  # experiment: journal.record on a background thread
            import queue
            import threading

            from tb_nanwatch.record.writing import journal

            record = journal.RunJournal.record
            rows: queue.Queue = queue.Queue()

            def drain():
                while True:
                    self_, args, kwargs = rows.get()
                    record(self_, *args, **kwargs)

            threading.Thread(target=drain, daemon=True).start()
            journal.RunJournal.record = lambda self, *a, **k: rows.put((self, a, k))
        elif patch == "noweights":  # pre-step weight copy off
            from tb_nanwatch.record import callback

            init = callback.NanWatch.__init__

            def patched(self, *a, **k):
                k["pre_step_weights"] = "off"
                init(self, *a, **k)

            callback.NanWatch.__init__ = patched
        else:
            raise ValueError(f"unknown patch {patch!r}")


def count_transfers():
    """Counts EagerTensor -> numpy conversions (device-to-host reads)."""
    from tensorflow.python.framework import ops

    counter = {"n": 0}
    original = ops._EagerTensorBase._numpy

    def counted(self):
        counter["n"] += 1
        return original(self)

    ops._EagerTensorBase._numpy = counted
    return counter


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument(
        "--tool",
        required=True,
        help=f"one of {TOOLS}, optionally +patch+patch (profiling experiments)",
    )
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--no-wait", action="store_true", help="do not wait for 'go' lines")
    parser.add_argument(
        "--memcheck",
        action="store_true",
        help="record RSS, gc object counts and transfers per step",
    )
    parser.add_argument("--workdir", default=None)
    parser.add_argument(
        "--profile", default=None, help="write a cProfile of the timed steps to this file"
    )
    args = parser.parse_args()

    workdir = args.workdir or tempfile.mkdtemp(prefix=f"nwbench-{args.tool}-")
    os.makedirs(workdir, exist_ok=True)
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    tool, *patches = args.tool.split("+")
    if tool not in TOOLS:
        parser.error(f"unknown tool {tool!r}")
    args.tool = tool
    apply_patches(patches)
    spec = parse_model(args.model)
    callbacks, info = setup_tool(args.tool, workdir)
    model, x, y = build(spec)
    batch = spec["batch"]
    total_steps = args.warmup + args.steps * args.rounds
    data = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .batch(batch, drop_remainder=True)
        .repeat()
        .prefetch(2)
    )
    controller = Controller(args)
    timer = make_timer(keras, args, controller)

    memory: dict = {}
    if args.memcheck:
        transfers = count_transfers()
        marks: dict = {}

        def hook(t) -> None:
            done = (t.round * args.steps) + len(t.times)
            if done == 1:
                gc.collect()
                marks["start"] = (done, vm_rss_kib(), len(gc.get_objects()), transfers["n"])
            if done == args.steps * args.rounds:
                gc.collect()
                marks["end"] = (done, vm_rss_kib(), len(gc.get_objects()), transfers["n"])

        controller.step_hook = hook
        memory["marks"] = marks

    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        original_ready = controller.ready

        def ready_and_profile() -> None:
            original_ready()
            profiler.enable()

        controller.ready = ready_and_profile

    started = time.perf_counter()
    try:
        model.fit(
            data,
            epochs=1,
            steps_per_epoch=total_steps,
            callbacks=callbacks + [timer],
            verbose=0,
        )
        error = None
    except Exception as exc:  # noqa: BLE001 - reported, not hidden
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.profile)
    result = {
        "model": args.model,
        "tool": args.tool,
        "batch": batch,
        "layers": len(model.layers),
        "params": int(model.count_params()),
        "wall_s": time.perf_counter() - started,
        "error": error,
        "rss_kib": vm_rss_kib(),
        "package": getattr(sys.modules.get("tb_nanwatch"), "__file__", None),
    }
    if "log_dir" in info:
        watcher = callbacks[0]
        result["event_bytes"] = dir_bytes(info["log_dir"])
        result["steps_recorded"] = watcher.journal.steps if watcher.journal else 0
        result["incident"] = watcher.incident
        if watcher._recorder is not None and watcher._recorder.schema is not None:
            result["schema_size"] = watcher._recorder.schema.size
            result["schema_entries"] = len(watcher._recorder.schema.entries)
    if args.memcheck:
        marks = memory["marks"]
        if "start" in marks and "end" in marks:
            (s0, r0, o0, t0), (s1, r1, o1, t1) = marks["start"], marks["end"]
            steps = s1 - s0
            result["memcheck"] = {
                "steps": steps,
                "rss_start_kib": r0,
                "rss_end_kib": r1,
                "rss_growth_bytes_per_step": 1024 * (r1 - r0) / steps,
                "gc_objects_start": o0,
                "gc_objects_end": o1,
                "gc_objects_growth_per_step": (o1 - o0) / steps,
                "transfers_per_step": (t1 - t0) / steps,
            }
    emit("done", **result)
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
