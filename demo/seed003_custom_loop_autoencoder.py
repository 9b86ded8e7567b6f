"""Seed 003: an autoencoder trained with a custom loop (``tf.GradientTape``
inside ``tf.function``), watched by ``tb_nanwatch.StepWatcher``.

The user's setup: inputs P in [0, 1], a sigmoid output ``p_pred``, the
hand-written weighted cross-entropy

    L = -sum(p * log(p_pred + 1e-10) + 0.55 * (1 - p) * log(1 - p_pred + 1e-10))

and Adam with learning rate 0.01. The loss "returns NaN at a random epoch" and
recomputing it from the saved ``p`` / ``p_pred`` never reproduces it, because
the NaN is not born in the forward pass at all.

Here the code layer appends the code's magnitude to it, ``[h, ||h||]`` with
``||h|| = sqrt(sum h^2)`` (a common "norm feature"). The encoder (tanh) has
no bias, so an all-zero row of P (an empty record) gives h = 0 exactly:
sqrt(0) = 0 and the forward pass and the loss stay finite, but the gradient
of sqrt at 0 is 0.5 * g / sqrt(0) = inf (g, the decoder's gradient for the
norm feature, is not zero), and inf * (dh^2/dh = 2h = 0) = NaN.

Ground truth (by construction, checked by tests/test_custom_loop.py): the
first all-zero row is in global step ``ZERO_STEP`` = 13 (epoch 1, batch 3 of
10); every earlier row has entries in [0.05, 1]. The first non-finite value is
in phase ``backward``, layer ``code_norm``, tensor ``gradient w.r.t. input of
code_norm``, kind ``nan``; inputs, every activation and the loss of step 13
are finite. The reproduction bundle holds batch 13 (with the zero row) and the
weights before step 13.
"""

from __future__ import annotations

try:
    from demo._common import Progress, main_with_log_dir
except ImportError:
    from _common import Progress, main_with_log_dir

import keras
import numpy as np
import tensorflow as tf

import tb_nanwatch

FEATURES = 24
CODE = 6
BATCH = 16
STEPS_PER_EPOCH = 10
EPOCHS = 3
ZERO_STEP = 13
ZERO_ROW = 5

TRUTH = {
    "step": ZERO_STEP,
    "epoch": ZERO_STEP // STEPS_PER_EPOCH,
    "batch": ZERO_STEP % STEPS_PER_EPOCH,
    "phase": "backward",
    "layer": "code_norm",
    "tensor": "gradient w.r.t. input of code_norm",
    "kind": "nan",
}


@keras.saving.register_keras_serializable("demo")
class CodeNorm(keras.layers.Layer):
    """[h, ||h||_2] per row: finite at h = 0, its gradient is not."""

    def call(self, h):
        return tf.concat([h, tf.sqrt(tf.reduce_sum(h * h, axis=-1, keepdims=True))], -1)


def build_autoencoder() -> keras.Model:
    p = keras.Input((FEATURES,), name="p")
    h = keras.layers.Dense(CODE, activation="tanh", use_bias=False, name="encoder")(p)
    code = CodeNorm(name="code_norm")(h)
    p_pred = keras.layers.Dense(FEATURES, activation="sigmoid", name="decoder")(code)
    return keras.Model(p, p_pred, name="seed003_autoencoder")


def weighted_cross_entropy(p, p_pred):
    """The user's loss, as written (epsilon inside the log only)."""
    per_row = -tf.reduce_sum(
        p * tf.math.log(p_pred + 1e-10) + 0.55 * (1 - p) * tf.math.log(1 - p_pred + 1e-10),
        axis=1,
    )
    return tf.reduce_mean(per_row)


def make_data() -> np.ndarray:
    rng = np.random.RandomState(3)
    p = rng.uniform(0.05, 1.0, (EPOCHS * STEPS_PER_EPOCH * BATCH, FEATURES)).astype("float32")
    p[ZERO_STEP * BATCH + ZERO_ROW] = 0.0  # an empty record
    return p


def run(log_dir: str) -> dict:
    """Trains the autoencoder with a custom loop until the gradient goes NaN."""
    keras.utils.set_random_seed(3)
    data = make_data()
    model = build_autoencoder()
    optimizer = keras.optimizers.Adam(0.01)
    # loss_fn: the replay after training re-runs the step with it, to name the op and line.
    watcher = tb_nanwatch.StepWatcher(log_dir, model, optimizer, loss_fn=weighted_cross_entropy)

    @tf.function
    def train_step(p):
        with tf.GradientTape() as tape, watcher.forward(tape, p, p) as rec:
            p_pred = model(p, training=True)
            loss = rec.loss(weighted_cross_entropy(p, p_pred), y_pred=p_pred)
        grads = tape.gradient(loss, rec.sources(model.trainable_variables))
        grads = rec.gradients(grads)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=False))
        rec.after_update()
        return loss

    progress = Progress(EPOCHS * STEPS_PER_EPOCH)
    stop = False
    for epoch in range(EPOCHS):
        watcher.begin_epoch(epoch)
        for batch in range(STEPS_PER_EPOCH):
            start = (epoch * STEPS_PER_EPOCH + batch) * BATCH
            train_step(tf.constant(data[start : start + BATCH]))
            progress.advance()
            if watcher.end_step():
                stop = True
                break
        if stop:
            break
    watcher.close()
    return watcher.incident


if __name__ == "__main__":
    main_with_log_dir(run, "demo_logs/seed003_custom_loop_autoencoder")
