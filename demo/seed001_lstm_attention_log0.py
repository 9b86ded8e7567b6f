"""Seed 001: embedding + LSTM + MultiHeadAttention + Dense logits, a loss that
takes log of a softmax probability (no epsilon), a learning rate too high.

A temperature slip scales the logits by 100; they grow step after step until, for one example, the true class's
probability underflows to exactly 0 and the loss is ``-log(0) = inf``, while
every layer's output is still finite.

What NaN Watch shows: phase loss, kind inf, layer null; the timeline shows the
logit max climbing for many steps before it.
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
    logits = keras.layers.Rescaling(100.0, name="temperature")(h)  # a 1/T = 100 slip
    return keras.Model(tokens, logits, name="seed001")


def run(log_dir: str) -> dict:
    """Trains with a too-high learning rate until the loss meets log(0)."""
    keras.utils.set_random_seed(1)
    rng = np.random.RandomState(1)
    steps = 300
    x = rng.randint(0, VOCAB, (steps * BATCH, SEQ)).astype("int32")
    # Noisy labels: the model grows confident and sometimes confidently wrong.
    y = np.where(rng.uniform(size=(steps * BATCH, 1)) < 0.7, x[:, :1], rng.randint(0, VOCAB, (steps * BATCH, 1))).astype("float32")
    model = build_model()
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss=softmax_then_log)
    watch = tb_nanwatch.NanWatch(log_dir)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, callbacks=[watch], verbose=0)
    return watch.incident


if __name__ == "__main__":
    main_with_log_dir(run, "demo_logs/seed001_lstm_attention_log0")
