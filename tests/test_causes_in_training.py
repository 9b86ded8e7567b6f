"""The cause verdict on real Keras training, each cause fixed by how the model
and data were built (tests/test_causes.py covers every id and its near misses
on recorded vectors; here the recorder, the journal and the report run too)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from nanwatch_testlib import report_json

import tb_nanwatch

BATCH = 8


def _cause(log_dir) -> dict | None:
    (run,) = report_json(log_dir)
    return run["cause"]


def _fit(model, x, y, run_dir, optimizer, loss="mse", steps=None):
    model.compile(optimizer=optimizer, loss=loss)
    watch = tb_nanwatch.NanWatch(str(run_dir))
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[watch])
    return watch


def _mlp(depth: int, width: int, seed: int = 0, outputs: int = 1, head=None) -> keras.Model:
    keras.utils.set_random_seed(seed)
    inp = keras.Input((width,))
    h = inp
    for i in range(depth):
        h = keras.layers.Dense(width, name=f"dense_{i}")(h)
    return keras.Model(inp, keras.layers.Dense(outputs, activation=head, name="head")(h))


def test_a_learning_rate_far_too_high_is_growth_overflow(tmp_path):
    # Linear layers and SGD at lr 1: every step multiplies the weights' scale,
    # the loss climbs by orders of magnitude until float32 overflows.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60 * BATCH, 16)).astype("float32")
    y = rng.normal(size=(60 * BATCH, 1)).astype("float32")
    watch = _fit(_mlp(3, 16), x, y, tmp_path / "run", keras.optimizers.SGD(1.0))
    assert watch.incident is not None
    cause = _cause(tmp_path)
    assert cause["id"] == "growth_overflow", cause
    assert cause["evidence"]["onset_step"] < watch.incident["step"]
    assert cause["evidence"]["growth_factor"] > 1e3
    assert "learning rate" in cause["remedies"][0]["text"].lower()


def test_a_nan_row_in_a_pretrained_embedding_is_nonfinite_weights(tmp_path):
    keras.utils.set_random_seed(0)
    inp = keras.Input((4,), dtype="int32")
    h = keras.layers.Embedding(20, 8, name="pretrained")(inp)
    out = keras.layers.Dense(1, name="head")(keras.layers.GlobalAveragePooling1D()(h))
    model = keras.Model(inp, out)
    table = model.get_layer("pretrained").embeddings
    rows = table.numpy()
    rows[7] = np.nan  # a broken row of the pretrained table
    table.assign(rows)
    x = np.arange(10 * BATCH * 4).reshape(-1, 4) % 7  # never looks row 7 up ...
    x[5 * BATCH + 2, 1] = 7  # ... until step 5
    y = np.zeros((len(x), 1), "float32")
    watch = _fit(model, x, y, tmp_path / "run", keras.optimizers.SGD(0.01))
    # The table is checked whole after each update: the NaN row shows at step 0.
    assert (watch.incident["step"], watch.incident["phase"]) == (0, "update")
    cause = _cause(tmp_path)
    assert cause["id"] == "nonfinite_weights", cause
    assert table.path in cause["evidence"]["variables"]


def test_an_all_masked_softmax_row_is_forward_math(tmp_path, recwarn):
    @keras.saving.register_keras_serializable("test_causes_in_training")
    class MaskedSoftmax(keras.layers.Layer):
        def call(self, x):
            scores = keras.ops.where(x > 0, x, -np.inf)  # masks with -inf
            return keras.ops.softmax(scores, axis=-1)

    keras.utils.set_random_seed(0)
    inp = keras.Input((6,))
    out = keras.layers.Dense(1, name="head")(MaskedSoftmax(name="attend")(inp))
    model = keras.Model(inp, out)
    x = np.random.default_rng(0).uniform(0.1, 1.0, (8 * BATCH, 6)).astype("float32")
    x[4 * BATCH + 3] = -1.0  # every position of this row is masked: softmax 0/0
    y = np.zeros((len(x), 1), "float32")
    watch = _fit(model, x, y, tmp_path / "run", keras.optimizers.SGD(0.01))
    assert (watch.incident["step"], watch.incident["layer"]) == (4, "attend")
    assert _cause(tmp_path)["id"] == "forward_math"
    # The replay names the masking op (the -inf it writes), with no warning on the way.
    assert watch.incident["op"]["type"] == "SelectV2", watch.incident["op"]
    assert [str(w.message) for w in recwarn if "NanWatch" in str(w.message)] == []


@pytest.fixture
def mixed_precision():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


def test_a_float16_activation_beyond_65504_is_fp16_overflow(tmp_path, mixed_precision):
    keras.utils.set_random_seed(0)
    inp = keras.Input((8,))
    h = keras.layers.Dense(8, kernel_initializer="ones", name="wide")(inp)
    out = keras.layers.Dense(1, dtype="float32", name="head")(h)
    model = keras.Model(inp, out)
    x = np.full((30 * BATCH, 8), 10.0, "float32")  # 8 x 10 = 80: fine in float16
    x[3 * BATCH :] = 1e4  # 8 x 1e4 = 8e4 > 65504: inf in float16, finite in float32
    y = np.zeros((len(x), 1), "float32")
    optimizer = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(0.0))
    watch = _fit(model, x, y, tmp_path / "run", optimizer)
    # The loss scaler skips every step from 3 on, halving its scale each time:
    # the incident is when the scale falls below min_loss_scale (or 20 skips).
    assert 3 < watch.incident["step"] <= 3 + 20
    assert "loss scale" in watch.incident.get("note", "")
    cause = _cause(tmp_path)
    assert cause["id"] == "fp16_overflow", cause
    assert cause["evidence"]["dtype_policy"] == "mixed_float16"


def test_a_healthy_noisy_run_has_no_cause(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(40 * BATCH, 16)).astype("float32")
    y = (x[:, :1] + rng.normal(scale=2.0, size=(len(x), 1))).astype("float32")
    watch = _fit(_mlp(3, 16), x, y, tmp_path / "run", keras.optimizers.Adam(1e-3))
    assert watch.incident is None
    assert _cause(tmp_path) is None


def test_an_exploding_softmax_model_is_told_to_compute_its_loss_from_logits(tmp_path):
    # The remedy rests on the recorder's text for a softmax output's logits
    # (schema.BEFORE_FINAL_ACTIVATION); a linear head must not get it.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60 * BATCH, 16)).astype("float32")
    remedies = {}
    for head in ("softmax", None):
        model = _mlp(3, 16, outputs=4, head=head)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=head is None)
        run_dir = tmp_path / str(head)
        watch = _fit(model, x, np.arange(len(x)) % 4, run_dir, keras.optimizers.SGD(3.0), loss)
        assert watch.incident is not None, head
        cause = _cause(run_dir)
        assert cause["id"] == "growth_overflow", cause
        remedies[head] = [remedy["text"] for remedy in cause["remedies"]]
    from_logits = "Compute the loss from logits (from_logits=True, no final activation)."
    assert from_logits in remedies["softmax"]
    assert from_logits not in remedies[None]


def test_raw_house_prices_are_unscaled_data_not_a_learning_rate_to_lower(tmp_path):
    # Square feet 500-4000, year 1900-2020, lot 1k-20k and prices 1e5-1e6, two
    # ReLU Dense layers and SGD at 1e-4: the loss is ~1e11 at step 0 and
    # overflows within a few steps, at any learning rate.
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    rows = 64
    x = np.stack(
        [rng.uniform(500, 4000, rows), rng.uniform(1900, 2020, rows), rng.uniform(1e3, 2e4, rows)],
        axis=1,
    ).astype("float32")
    y = (100 * x[:, :1] + 5 * x[:, 2:] + rng.uniform(1e5, 5e5, (rows, 1))).astype("float32")
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    watch = _fit(model, x, y, tmp_path / "run", keras.optimizers.SGD(1e-4))
    assert watch.incident is not None and watch.incident["step"] <= 3
    cause = _cause(tmp_path)
    assert cause["id"] == "unscaled_data", cause
    # Neither alone fixes it: the two together are the first remedy, one entry.
    assert cause["remedy_ids"][0] == "normalize_inputs+scale_targets"
    assert cause["remedies"][0]["together"] == ["normalize_inputs", "scale_targets"]
    assert "logit" not in cause["summary"] and "input input" not in cause["summary"]
    assert "Normalization" in cause["remedies"][0]["text"]
    # The run summary holds the facts the remedies read.
    summary = watch.journal.summary()
    assert summary["has_attention"] is False and "Dense" in summary["layer_classes"]
    assert summary["optimizer_settings"]["epsilon"] is None  # SGD has none
    assert summary["input_dtypes"] == {"input": "float32"}
