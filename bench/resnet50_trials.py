"""ResNet50 + Adam end to end at NanWatch's defaults: an explosion, its rewind
point, the replay and the remedy trials, at the size people train.

    python bench/resnet50_trials.py LOG_DIR        # ~8 min on a 2-core CPU

Seed 000's model (a Keras ResNet50 base, ``weights=None``, 64x64 inputs,
nested in a ``Sequential`` under ``Dense(6, sigmoid)`` and binary
cross-entropy), Adam, batch 8, and a learning-rate schedule with a typo: x1e4
at step ``--jump``. ``NanWatch(LOG_DIR)`` with every option at its default.
Prints one ``RESULT {json}`` line: the incident or explosion, the trials'
fidelity and outcomes, the time of ``fit`` (the trials included) and the
process's peak RSS.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tb_nanwatch  # noqa: E402

BATCH = 8


@keras.saving.register_keras_serializable("bench")
class TypoSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """``base`` until step ``jump``, then ``base x factor`` (a typo)."""

    def __init__(self, base: float = 1e-3, jump: int = 30, factor: float = 1e4) -> None:
        self.base, self.jump, self.factor = base, jump, factor

    def __call__(self, step):
        return tf.where(step < self.jump, self.base, self.base * self.factor)

    def get_config(self) -> dict:
        return {"base": self.base, "jump": self.jump, "factor": self.factor}


def build(schedule: TypoSchedule) -> keras.Model:
    keras.utils.set_random_seed(0)
    base = keras.applications.ResNet50(
        include_top=False, weights=None, input_shape=(64, 64, 3), pooling="avg"
    )
    model = keras.Sequential(
        [keras.Input((64, 64, 3)), base, keras.layers.Dense(6, activation="sigmoid")]
    )
    model.compile(optimizer=keras.optimizers.Adam(schedule), loss="binary_crossentropy")
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log_dir")
    parser.add_argument("--jump", type=int, default=30, help="the step the rate jumps at")
    parser.add_argument("--steps", type=int, default=60, help="the steps of data")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.steps * BATCH, 64, 64, 3)).astype("float32")
    y = (rng.random((args.steps * BATCH, 6)) < 0.3).astype("float32")
    model = build(TypoSchedule(jump=args.jump))
    watch = tb_nanwatch.NanWatch(args.log_dir)
    started = time.perf_counter()
    model.fit(x, y, batch_size=BATCH, shuffle=False, callbacks=[watch], verbose=0)
    fit_s = time.perf_counter() - started
    written = {}
    for trials_file in glob.glob(os.path.join(args.log_dir, "**", "trials.json"), recursive=True):
        with open(trials_file) as f:
            written = json.load(f)
    result = {
        "parameters": model.count_params(),
        "incident": watch.incident,
        "steps": watch.journal.steps,
        "fit_s": round(fit_s, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "cause": written.get("cause"),
        "fidelity": written.get("fidelity"),
        "baseline": (written.get("baseline") or {}).get("why"),
        "trials": {t["remedy"]: (t["outcome"], t["setting"]) for t in written.get("trials", [])},
    }
    print("RESULT " + json.dumps(result, default=str))


if __name__ == "__main__":
    main()
