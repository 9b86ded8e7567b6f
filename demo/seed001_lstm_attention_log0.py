"""Seed 001: embedding + LSTM + MultiHeadAttention + Dense logits, a loss that
takes log of a softmax probability (no epsilon), logits that keep growing.

The logits pass through a learnable logit scale ``exp(s)`` (as in CLIP, but
without CLIP's clamp at 100). While the model gets its examples right, the
optimizer keeps raising the scale, so the logits grow step after step. Batch
``MISLABELED_STEP`` carries wrong labels: once the logits are large, a true
class's probability underflows to exactly 0 and the loss is ``-log(0) = inf``,
while every layer's output is still finite.

What NaN Watch shows: phase loss, kind inf, layer null, at or before the
mislabeled batch; the timeline shows the logit max climbing for many steps.
"""

from __future__ import annotations

try:
    from demo._common import main_with_log_dir
except ImportError:
    from _common import main_with_log_dir

import keras
import numpy as np
import tensorflow as tf

import tb_nanwatch

VOCAB = 50
SEQ = 8
BATCH = 16
STEPS = 320
MISLABELED_STEP = 280


@keras.saving.register_keras_serializable("demo")
class LogitScale(keras.layers.Layer):
    """Multiplies by exp(s), s learnable, unclamped."""

    def build(self, input_shape):
        self.s = self.add_weight(shape=(), initializer="zeros", name="s")

    def call(self, x):
        return x * tf.exp(self.s)


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
    logits = LogitScale(name="logit_scale")(h)
    return keras.Model(tokens, logits, name="seed001")


def run(log_dir: str) -> dict:
    """Trains until the loss meets log(0); returns the incident."""
    keras.utils.set_random_seed(1)
    rng = np.random.RandomState(1)
    x = rng.randint(0, VOCAB, (STEPS * BATCH, SEQ)).astype("int32")
    y = x[:, :1].astype("float32")  # learnable: predict the first token
    bad = slice(MISLABELED_STEP * BATCH, (MISLABELED_STEP + 1) * BATCH)
    y[bad] = (y[bad] + VOCAB // 2) % VOCAB  # one mislabeled batch
    model = build_model()
    model.compile(optimizer=keras.optimizers.Adam(0.03), loss=softmax_then_log)
    watch = tb_nanwatch.NanWatch(log_dir)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, callbacks=[watch], verbose=0)
    return watch.incident


if __name__ == "__main__":
    main_with_log_dir(run, "demo_logs/seed001_lstm_attention_log0")
