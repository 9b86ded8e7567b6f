"""Seed 001: embedding + LSTM + MultiHeadAttention + Dense logits, a loss that
takes log of a softmax probability (no epsilon), logits that keep growing.

The model learns to predict the last token of a sequence while the learning
rate decays (cosine, to 0 at step ``SHARPEN_FROM``). From then on an inverse
temperature schedule sharpens the logits by ``SHARPEN_GROWTH`` per step, with
no cap (as in temperature annealing), so the logit max climbs step after step
while every prediction stays right and the loss stays finite. Batch
``MISLABELED_STEP`` carries wrong labels: the true class's probability
underflows to exactly 0 and the loss is ``-log(0) = inf``, while every layer's
output is still finite.

What NaN Watch shows: first non-finite step ``MISLABELED_STEP`` (360), phase
loss, no layer, kind inf; the timeline shows the logit max climbing over the
steps before it (about 25 at step 300, about 500 at step 359).
"""

from __future__ import annotations

try:
    from demo._common import main_with_log_dir, progress_lines
except ImportError:
    from _common import main_with_log_dir, progress_lines

import keras
import numpy as np
import tensorflow as tf

import tb_nanwatch

VOCAB = 50
SEQ = 8
BATCH = 16
LEARNING_RATE = 0.03
SHARPEN_FROM = 300
SHARPEN_GROWTH = 1.05
MISLABELED_STEP = 360
STEPS = MISLABELED_STEP + 40


@keras.saving.register_keras_serializable("demo")
class InverseTemperature(keras.layers.Layer):
    """Multiplies the logits by a scale that a schedule sets (not trained)."""

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(), initializer="ones", trainable=False, name="scale")

    def call(self, x):
        return x * self.scale


class SharpenSchedule(keras.callbacks.Callback):
    """Scale 1 until ``SHARPEN_FROM``, then ``SHARPEN_GROWTH`` times larger each step."""

    def __init__(self, layer: InverseTemperature) -> None:
        super().__init__()
        self.layer = layer

    def on_train_batch_begin(self, batch, logs=None):
        self.layer.scale.assign(SHARPEN_GROWTH ** max(0, batch - SHARPEN_FROM))


def softmax_then_log(y_true, logits):
    """The user's cross-entropy: softmax, then -log(p[true]) with no epsilon."""
    logits = logits[:, -1, :]
    shifted = logits - tf.reduce_max(logits, axis=-1, keepdims=True)
    probs = tf.exp(shifted) / tf.reduce_sum(tf.exp(shifted), axis=-1, keepdims=True)
    true = tf.one_hot(tf.cast(y_true[:, 0], tf.int32), VOCAB)
    return -tf.math.log(tf.reduce_sum(true * probs, axis=-1))


def build_model() -> keras.Model:
    tokens = keras.Input((SEQ,), dtype="int32", name="tokens")
    h = keras.layers.Embedding(VOCAB, 16, name="embedding")(tokens)
    h = keras.layers.LSTM(16, return_sequences=True, name="lstm")(h)
    a = keras.layers.MultiHeadAttention(2, 8, name="attention")(h, h)
    h = keras.layers.Add(name="residual")([h, a])
    h = keras.layers.Dense(VOCAB, name="logits")(h)
    logits = InverseTemperature(name="inverse_temperature")(h)
    return keras.Model(tokens, logits, name="seed001")


def make_data() -> tuple[np.ndarray, np.ndarray]:
    """Random token sequences; the label is the last token, wrong in one batch."""
    rng = np.random.RandomState(1)
    x = rng.randint(0, VOCAB, (STEPS * BATCH, SEQ)).astype("int32")
    y = x[:, -1:].astype("float32")
    bad = slice(MISLABELED_STEP * BATCH, (MISLABELED_STEP + 1) * BATCH)
    y[bad] = (y[bad] + VOCAB // 2) % VOCAB
    return x, y


def run(log_dir: str) -> dict:
    """Trains until the loss meets log(0); returns the incident."""
    keras.utils.set_random_seed(1)
    x, y = make_data()
    model = build_model()
    learning_rate = keras.optimizers.schedules.CosineDecay(LEARNING_RATE, SHARPEN_FROM)
    model.compile(optimizer=keras.optimizers.Adam(learning_rate), loss=softmax_then_log)
    sharpen = SharpenSchedule(model.get_layer("inverse_temperature"))
    watch = tb_nanwatch.NanWatch(log_dir)
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=1,
        shuffle=False,
        callbacks=[sharpen, watch, progress_lines(STEPS)],
        verbose=0,
    )
    return watch.incident


if __name__ == "__main__":
    main_with_log_dir(run, "demo_logs/seed001_lstm_attention_log0")
