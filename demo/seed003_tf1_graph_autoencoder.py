"""Seed 003 as the user wrote it: a TF1 graph (placeholders, ``Session``,
``feed_dict``, ``AdamOptimizer``), watched by
``tb_nanwatch.compat.v1.GraphWatcher``.

The same autoencoder, data and ground truth as the TF2 version beside it
(``seed003_custom_loop_autoencoder.py``): inputs P in [0, 1], a tanh encoder
without bias, the code's norm appended (``[h, ||h||]``), a sigmoid decoder,
the user's weighted cross-entropy ``log(p_pred + 1e-10)``, Adam at 0.01. An
all-zero row of P in step 13 gives h = 0: the forward pass and the loss stay
finite, the gradient of ``sqrt`` at 0 does not. The run is TF1 end to end
(``tf.compat.v1.disable_v2_behavior()``: reference variables, TF1 control
flow), so run it in its own process.

Ground truth: step 13 (epoch 1, batch 3), phase ``backward``, layer (name
scope) ``code_norm``, tensor ``gradient w.r.t. input of code_norm``, kind
``nan``; the bundle holds the fed batch (the ``p`` placeholder) and the
weights before step 13.
"""

from __future__ import annotations

try:
    from demo import seed003_custom_loop_autoencoder as tf2_version
    from demo._common import Progress, main_with_log_dir
except ImportError:
    import seed003_custom_loop_autoencoder as tf2_version
    from _common import Progress, main_with_log_dir

import tensorflow as tf

FEATURES, CODE, BATCH = tf2_version.FEATURES, tf2_version.CODE, tf2_version.BATCH
STEPS_PER_EPOCH, EPOCHS = tf2_version.STEPS_PER_EPOCH, tf2_version.EPOCHS
ZERO_STEP, ZERO_ROW = tf2_version.ZERO_STEP, tf2_version.ZERO_ROW
TRUTH = dict(tf2_version.TRUTH)


class Autoencoder:
    """The user's model object: placeholders, layers, loss (TF1 style)."""

    def __init__(self, learning_rate: float = 0.01) -> None:
        v1 = tf.compat.v1
        self.learning_rate = learning_rate
        self.p = v1.placeholder(tf.float32, [None, FEATURES], name="p")
        init = v1.glorot_uniform_initializer(seed=3)
        with v1.variable_scope("encoder"):
            w = v1.get_variable("kernel", [FEATURES, CODE], initializer=init)
            self.h = tf.tanh(tf.matmul(self.p, w))
        with v1.variable_scope("code_norm"):
            norm = tf.sqrt(tf.reduce_sum(self.h * self.h, axis=1, keepdims=True))
            self.code = tf.concat([self.h, norm], 1)
        with v1.variable_scope("decoder"):
            w = v1.get_variable("kernel", [CODE + 1, FEATURES], initializer=init)
            b = v1.get_variable("bias", [FEATURES], initializer=v1.zeros_initializer())
            self.y_pred = tf.sigmoid(tf.matmul(self.code, w) + b)
        self.p_pred = self.y_pred
        # Define loss and optimizer, minimize the squared error
        with tf.name_scope("loss"):
            L = -tf.reduce_sum(  # noqa: N806 - the user's name
                self.p * tf.math.log(self.p_pred + 1e-10)
                + 0.55 * (1 - self.p) * tf.math.log(1 - self.p_pred + 1e-10),
                axis=1,
            )
            self.loss = tf.reduce_mean(L)


def run(log_dir: str) -> dict | None:
    """Trains the TF1 autoencoder in a Session until the gradient goes NaN."""
    from tb_nanwatch.compat.v1 import GraphWatcher

    v1 = tf.compat.v1
    v1.disable_v2_behavior()
    v1.set_random_seed(3)
    data = tf2_version.make_data()
    model = Autoencoder()
    watch = GraphWatcher(log_dir, model.loss, outputs={"p_pred": model.p_pred})
    # was: model.optimizer = v1.train.AdamOptimizer(model.learning_rate).minimize(model.loss)
    model.optimizer = watch.minimize(v1.train.AdamOptimizer(model.learning_rate))
    progress = Progress(EPOCHS * STEPS_PER_EPOCH)
    with v1.Session() as sess:
        sess.run(v1.global_variables_initializer())
        for epoch in range(EPOCHS):
            watch.begin_epoch(epoch)
            for batch in range(STEPS_PER_EPOCH):
                start = (epoch * STEPS_PER_EPOCH + batch) * BATCH
                feed = {model.p: data[start : start + BATCH]}
                _, loss = sess.run([model.optimizer, model.loss], feed_dict=feed)
                progress.advance()
                if watch.end_step(sess):
                    break
            if watch.incident is not None:
                break
    watch.close()
    return watch.incident


if __name__ == "__main__":
    main_with_log_dir(run, "demo_logs/seed003_tf1_graph_autoencoder")
