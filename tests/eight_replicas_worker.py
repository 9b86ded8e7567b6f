"""Subprocess body of tests/test_eight_replicas.py: MirroredStrategy over 8
logical CPU devices (the replica layout of a TPU v3-8), ``fit`` and a custom
loop, each healthy and with one bad shard. Logical devices must be set before
TensorFlow initializes: hence a process of its own.

    python eight_replicas_worker.py <out.json> <log_dir>
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

REPLICAS = 8
ZERO_STEP = 3
STEPS = 5
ZERO_ROW = 5  # batch 8 over 8 replicas: one row a replica, the zero is replica 5's


def _healthy(kwargs: dict) -> dict:
    den = kwargs["x"]["den"].copy()
    den[den == 0] = 1.0
    return {**kwargs, "x": {**kwargs["x"], "den": den}}


def _fit(log_dir: str, strategy, bad: bool) -> dict:
    import scenarios

    import tb_nanwatch

    with strategy.scope():
        model, kwargs, _ = scenarios.ratio_multi_io(ZERO_STEP, STEPS, ZERO_ROW)
    if not bad:
        kwargs = _healthy(kwargs)
    watch = tb_nanwatch.NanWatch(log_dir)
    model.fit(**kwargs, callbacks=[watch], verbose=0)
    summary = watch.journal.summary()
    return {
        "incident": watch.incident,
        "steps": watch.journal.steps,
        "replicas": summary["replicas"],
    }


def _loop(log_dir: str, strategy, bad: bool) -> dict:
    import scenarios
    from distribute_worker import _custom_loop

    def data(_pipeline):
        num, den, y_main, y_aux = scenarios.ratio_data(ZERO_STEP, STEPS, ZERO_ROW)
        if not bad:
            den[den == 0] = 1.0
        return num, den, y_main, y_aux

    return _custom_loop(log_dir, strategy, data)


def main(out: str, log_dir: str) -> None:
    from nanwatch_testlib import logical_cpus

    logical_cpus(REPLICAS)
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(REPLICAS)])
    result = {"num_replicas": strategy.num_replicas_in_sync}
    for name, run in (("fit", _fit), ("loop", _loop)):
        for bad in (False, True):
            key = f"{name}_{'bad' if bad else 'healthy'}"
            result[key] = run(os.path.join(log_dir, key), strategy, bad)
    with open(out, "w") as f:
        json.dump(result, f, default=lambda o: getattr(o, "tolist", lambda: str(o))())


if __name__ == "__main__":
    main(*sys.argv[1:3])
