"""String, sparse and ragged inputs: what can be recorded is, the rest is
named in the run summary's ``not_watched``, and a NaN made later is found."""

from __future__ import annotations

import json
import warnings

import keras
import numpy as np
import tensorflow as tf

import tb_nanwatch

BATCH, STEPS, NAN_STEP = 8, 8, 5


def _fit(model, x, y, tmp_path) -> tb_nanwatch.NanWatch:
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    watch = tb_nanwatch.NanWatch(str(tmp_path / "run"), on_nonfinite="stop", flush_secs=1e9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=BATCH, shuffle=False, epochs=1, verbose=0, callbacks=[watch])
    watch.nanwatch_warnings = [str(w.message) for w in caught if "NanWatch" in str(w.message)]
    return watch


def assert_said_the_batch_is_not_kept_whole(watch, tmp_path, kind: str) -> None:
    """A sparse or ragged batch: the bundle and the trials say it is not held
    whole (never a failure to load its own bundle), and the only warning is
    that no rewind points are kept, with why."""
    why = f"the batch holds a {kind}, which is not kept (dense tensors only)"
    assert watch.nanwatch_warnings == [f"NanWatch keeps no rewind points: {why}"]
    run = tmp_path / "run"
    saved = tb_nanwatch.load_bundle(str(run / watch.journal.repro_bundle))
    assert saved.info["batch_incomplete"] == why
    trials = json.loads((run / "repro" / "trials.json").read_text())["trials"]
    assert trials and {t["outcome"] for t in trials} == {"not_tried"}, trials
    assert all(f"the bundle does not hold the whole batch: {why}" in t["why"] for t in trials)


def _targets() -> np.ndarray:
    return np.ones((BATCH * STEPS, 1), "float32")


def test_string_input_records_the_layers_after_the_lookup(tmp_path):
    # Word "poison" first appears at NAN_STEP; its embedding row is negative,
    # so the log after the embedding makes the first NaN there.
    words = np.array([["a", "b", "c"][i % 3] for i in range(BATCH * STEPS)], dtype=object)
    words[NAN_STEP * BATCH + 3] = "poison"
    inp = keras.Input((1,), dtype="string", name="word")
    ids = keras.layers.StringLookup(vocabulary=["a", "b", "c", "poison"], name="lookup")(inp)
    embedded = keras.layers.Embedding(5, 4, name="embed")(ids)
    logs = keras.layers.Lambda(tf.math.log, name="log")(embedded)
    out = keras.layers.Dense(1, name="head")(keras.layers.Flatten(name="flat")(logs))
    model = keras.Model(inp, out)
    rows = np.full((5, 4), 0.5, "float32")
    rows[4] = -1.0
    model.get_layer("embed").embeddings.assign(rows)

    watch = _fit(model, tf.constant(words.reshape(-1, 1).astype(str)), _targets(), tmp_path)
    summary = watch.journal.summary()
    assert summary["steps"] == NAN_STEP + 1
    incident = watch.incident
    assert (incident["step"], incident["phase"], incident["layer"]) == (
        NAN_STEP,
        "forward",
        "log",
    )
    notes = summary["not_watched"]
    assert any(n.startswith("model input word: a string tensor") for n in notes)
    assert any(n.startswith("lookup: its output is not a float tensor") for n in notes)


def test_sparse_input_is_recorded_by_its_values(tmp_path):
    dense = np.random.RandomState(0).binomial(1, 0.4, (BATCH * STEPS, 6)).astype("float32")
    dense[:, 0] = 1.0
    dense[NAN_STEP * BATCH + 2, 0] = np.nan
    inp = keras.Input((6,), sparse=True, name="counts")
    out = keras.layers.Dense(1, name="head")(keras.layers.Dense(4, name="hidden")(inp))
    watch = _fit(keras.Model(inp, out), tf.sparse.from_dense(dense), _targets(), tmp_path)
    assert watch.journal.steps == NAN_STEP + 1
    incident = watch.incident
    assert (incident["step"], incident["phase"], incident["layer"]) == (NAN_STEP, "input", "counts")
    assert "not_watched" not in watch.journal.summary()
    assert_said_the_batch_is_not_kept_whole(watch, tmp_path, "SparseTensor")


def test_ragged_input_is_recorded_by_its_values(tmp_path):
    rows = [[1.0, 2.0], [3.0], [4.0, 5.0, 6.0], [7.0]] * (BATCH * STEPS // 4)
    rows[NAN_STEP * BATCH + 2] = [3.0, np.nan]
    inp = keras.Input((None,), ragged=True, name="lengths")
    mean = keras.layers.Lambda(lambda r: tf.reduce_mean(r, axis=1, keepdims=True), name="mean")
    out = keras.layers.Dense(1, name="head")(mean(inp))
    watch = _fit(keras.Model(inp, out), tf.ragged.constant(rows), _targets(), tmp_path)
    assert watch.journal.steps == NAN_STEP + 1
    incident = watch.incident
    assert (incident["step"], incident["phase"], incident["layer"]) == (
        NAN_STEP,
        "input",
        "lengths",
    )
    assert_said_the_batch_is_not_kept_whole(watch, tmp_path, "RaggedTensor")


def test_a_replay_of_a_bundle_without_its_whole_batch_says_so():
    from tb_nanwatch.record.after_incident.bundle import ReproBundle
    from tb_nanwatch.record.after_incident.replay import replay_step

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    weights = {v.path: v.numpy() for v in model.weights}
    why = "the batch holds a SparseTensor, which is not kept (dense tensors only)"
    info = {"incident": {"phase": "forward", "step": 3}, "batch_incomplete": why}
    saved = ReproBundle(3, [None, np.ones((2, 1), "float32")], weights, info)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert replay_step(model, saved) is None
    said = [str(w.message) for w in caught]
    assert said == [
        f"NanWatch could not replay step 3: ValueError('the bundle does not hold the whole batch: {why}')"
    ]
