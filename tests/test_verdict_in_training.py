"""Issue 55's verdicts on real Keras training: what the run info records of
the model's ends, and the card's first remedy followed literally trains.

A next-token model whose hand-written loss takes the log of probabilities is
fed raw logits: the cause is ``logits_as_probabilities`` (never "standardise
the targets": the token ids are labels), its first remedy adds the softmax,
and the script with the softmax added trains (finite, loss falling).
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from nanwatch_testlib import TRIAL_BUDGET_S, report_json

import tb_nanwatch
from tb_nanwatch.record import run_info

VOCAB = 300
BATCH = 16


def next_token_loss(y_true, probs):
    """Cross-entropy written for probabilities: -log p[target]."""
    picked = tf.gather(probs, tf.cast(tf.reshape(y_true, [-1]), tf.int32), batch_dims=1)
    return -tf.reduce_mean(tf.math.log(picked))


def next_token_model(softmax: bool) -> keras.Model:
    keras.utils.set_random_seed(0)
    ids = keras.Input((8,), dtype="int32")
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(VOCAB, 16)(ids))
    out = keras.layers.Dense(VOCAB, activation="softmax" if softmax else None)(h)
    model = keras.Model(ids, out)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=next_token_loss)
    return model


def token_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.integers(1, VOCAB, size=(20 * BATCH, 8)).astype("int32")
    y = (x[:, -1:] % 50 + 1).astype("int32")  # learnable: the next token from the last one
    y[0, 0], y[1, 0] = 1, VOCAB - 1  # the target ids span 1 to 299
    return x, y


def test_raw_logits_into_a_log_of_probabilities_is_named_and_its_remedy_trains(tmp_path):
    x, y = token_data()
    model = next_token_model(softmax=False)
    watch = tb_nanwatch.NanWatch(str(tmp_path / "raw"), remedy_trials=False)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[watch])
    assert watch.incident is not None and watch.incident["phase"] == "loss"
    (run,) = report_json(tmp_path)
    cause = run["cause"]
    assert cause["id"] == "logits_as_probabilities", cause
    assert cause["remedy_ids"][0] == "output_activation"
    assert "scale_targets" not in cause["remedy_ids"]
    assert not any("Standardise the targets" in r["text"] for r in cause["remedies"])
    assert 'activation="softmax"' in cause["remedies"][0]["text"]
    # The first remedy, literally: the last Dense gets activation="softmax".
    fixed = next_token_model(softmax=True)
    history = fixed.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0)
    losses = history.history["loss"]
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses


def binary_crossentropy_of_probabilities(y_true, probs):
    """Binary cross-entropy written for probabilities: -log p, -log(1 - p)."""
    y_true = tf.cast(y_true, probs.dtype)
    return -tf.reduce_mean(y_true * tf.math.log(probs) + (1 - y_true) * tf.math.log(1 - probs))


def binary_model(sigmoid: bool) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(1, activation="sigmoid" if sigmoid else None),
        ]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss=binary_crossentropy_of_probabilities)
    return model


def test_raw_logits_of_a_binary_model_get_a_sigmoid_in_the_trial_and_on_the_card(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(16 * BATCH, 4)).astype("float32")
    y = (x[:, :1] + x[:, 1:2] > 0).astype("float32")
    watch = tb_nanwatch.NanWatch(str(tmp_path / "raw"), trial_budget_s=TRIAL_BUDGET_S)
    binary_model(sigmoid=False).fit(
        x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[watch]
    )
    (run,) = report_json(tmp_path)
    cause = run["cause"]
    assert cause["id"] == "logits_as_probabilities", cause
    first = cause["remedies"][0]
    assert cause["remedy_ids"][0] == "output_activation", cause["remedy_ids"]
    assert 'activation="sigmoid"' in first["text"] and "softmax" not in first["code"]
    assert first["code"] == 'outputs = keras.layers.Activation("sigmoid")(logits)'
    # The trial wrapped the outputs in the same sigmoid, and it trained.
    assert first["trial"]["setting"] == "sigmoid on the outputs before the loss"
    assert first["trial"]["outcome"] == "fixed", first["trial"]
    # The card, literally: the last Dense ends in the sigmoid.
    history = binary_model(sigmoid=True).fit(
        x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0
    )
    losses = history.history["loss"]
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses


def test_the_run_info_records_the_models_ends():
    norm = keras.layers.Normalization()
    norm.adapt(np.random.default_rng(0).normal(size=(32, 3)).astype("float32"))
    model = keras.Sequential(
        [
            keras.Input((3,)),
            norm,
            keras.layers.Dense(4),
            keras.layers.Dense(5, activation="softmax"),
        ]
    )
    facts = run_info.model_ends(model)
    assert facts == {
        "first_layer_class": "Normalization",
        "normalizes_inputs": True,
        "output_activations": ["softmax"],
        "output_units": [5],
    }
    raw = next_token_model(softmax=False)
    assert run_info.model_ends(raw)["output_activations"] == ["linear"]
    assert run_info.model_ends(raw)["normalizes_inputs"] is False
    assert run_info.loss_name(next_token_loss) == "next_token_loss"
    assert run_info.loss_name(keras.losses.SparseCategoricalCrossentropy()) == (
        "SparseCategoricalCrossentropy"
    )


def house_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = np.stack(
        [rng.uniform(500, 4000, 320), rng.uniform(1900, 2020, 320), rng.uniform(1e3, 2e4, 320)],
        axis=1,
    ).astype("float32")
    y = (100 * x[:, :1] + 50 * (x[:, 1:2] - 1900) + 2 * x[:, 2:]).astype("float32")
    return x, y


def normalised_model(x: np.ndarray, rate: float) -> keras.Model:
    keras.utils.set_random_seed(0)
    norm = keras.layers.Normalization()
    norm.adapt(x)
    model = keras.Sequential(
        [keras.Input((3,)), norm, keras.layers.Dense(16), keras.layers.Dense(1)]
    )
    model.compile(optimizer=keras.optimizers.SGD(rate), loss="mse")
    return model


def test_a_model_that_normalises_first_is_told_to_standardise_the_targets_only(tmp_path):
    x, y = house_data()
    model = normalised_model(x, 0.05)
    watch = tb_nanwatch.NanWatch(str(tmp_path / "house"), remedy_trials=False)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[watch])
    assert watch.incident is not None
    (run,) = report_json(tmp_path)
    cause = run["cause"]
    assert "normalize_inputs" not in cause["remedy_ids"], cause
    assert not any("Normalization" in r["text"] for r in cause["remedies"])
    assert "scale_targets" in cause["remedy_ids"]
    # Standardising the targets, as its text says, at the same rate: it trains.
    fixed = normalised_model(x, 0.05)
    mean, std = y.mean(), y.std()
    history = fixed.fit(x, (y - mean) / std, batch_size=BATCH, epochs=3, shuffle=False, verbose=0)
    losses = history.history["loss"]
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses
