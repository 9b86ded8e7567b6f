"""The report, its JSON and the tab say each thing once and the same way
(issue 56 items 5, 7 and 9): the skip fallback's steps are skipped steps
everywhere; a custom loop without ``loss_fn=`` is told to pass it (never an
empty op line); a regression's outputs are not "logits"; an explosion at the
incident's own step is not "before it"."""

from __future__ import annotations

import io
import json

import keras
import numpy as np
import scenarios
import tensorflow as tf
from nanwatch_testlib import base_vector, run_node_module

import tb_nanwatch
from tb_nanwatch import cli
from tb_nanwatch.board import reader
from tb_nanwatch.evidence.options import WatchOptions
from tb_nanwatch.evidence.schema import Schema
from tb_nanwatch.record.after_incident.replay import NEEDS_LOSS_FN
from tb_nanwatch.record.writing.journal import RunJournal

BATCH = 8


def _report(*argv: str) -> str:
    out, err = io.StringIO(), io.StringIO()
    assert cli.main(["report", *argv], out=out, err=err) == 0, err.getvalue()
    return out.getvalue()


def test_skip_fallback_steps_are_skipped_steps_in_json_text_and_tab(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6 * BATCH, 4)).astype("float32")
    y = rng.normal(size=(6 * BATCH, 1)).astype("float32")
    for step in (1, 2, 4):
        x[step * BATCH + 2, 1] = np.nan
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    run_dir = str(tmp_path / "run")
    watch = tb_nanwatch.NanWatch(run_dir, on_nonfinite="skip", remedy_trials=False)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[watch])
    assert watch.journal.summary()["skipped_nonfinite_steps"] == [1, 2, 4]
    (entry,) = json.loads(_report(run_dir, "--json"))["runs"]
    assert entry["skipped_steps"] == [1, 2, 4]
    text = _report(run_dir)
    assert "  skipped steps: 3\n" in text
    assert "not applied (skipped): 3: 1, 2, 4" in text


def test_the_tab_counts_and_bands_the_skip_fallbacks_steps():
    summary = {"skipped_ranges": [[7, 8]], "skipped_nonfinite_steps": [1, 2, 4, 8]}
    run = reader.Run(listing=None, summary=summary, schema=None)
    assert run.skipped_steps() == [1, 2, 4, 7, 8]
    assert run.skipped_count() == 5
    assert run.skipped_ranges() == [[1, 2], [4, 4], [7, 8]]


def _loop_without_loss_fn(run_dir: str):
    """A loss-phase incident (log of a 0 probability) in a custom loop whose
    StepWatcher was given no ``loss_fn=`` (the README's example)."""
    _, kwargs, truth = scenarios.loss_log_zero()
    keras.utils.set_random_seed(2)
    inp = keras.Input((4,), name="x")
    h = keras.layers.Dense(8, name="proj")(inp)
    model = keras.Model(inp, keras.layers.Dense(3, name="logits")(h))  # no compiled loss
    optimizer = keras.optimizers.SGD(0.01)
    watcher = tb_nanwatch.StepWatcher(run_dir, model, optimizer, remedy_trials=False)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape, watcher.forward(tape, x, y) as rec:
            y_pred = model(x, training=True)
            loss = rec.loss(tf.reduce_mean(scenarios.softmax_log_loss(y, y_pred)), y_pred=y_pred)
        grads = rec.gradients(tape.gradient(loss, rec.sources(model.trainable_variables)))
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=False))
        rec.after_update()
        return loss

    x, y = kwargs["x"], kwargs["y"]
    for start in range(0, len(x), BATCH):
        train_step(tf.constant(x[start : start + BATCH]), tf.constant(y[start : start + BATCH]))
        if watcher.end_step():
            break
    watcher.close()
    return watcher, truth


def test_a_custom_loop_without_loss_fn_is_told_to_pass_it(tmp_path):
    run_dir = tmp_path / "loop"
    watcher, truth = _loop_without_loss_fn(str(run_dir))
    assert watcher.incident["step"] == truth["step"]
    assert watcher.incident["phase"] == "loss"
    op = watcher.journal.summary()["first_nonfinite"]["op"]
    assert op["reproduced"] is False and op["why"] == NEEDS_LOSS_FN
    text = _report(str(run_dir))
    assert f"op: not named: {NEEDS_LOSS_FN}" in text
    assert "op:  ''" not in text and "source line unknown" not in text


def _regression_schema() -> Schema:
    """One dense layer whose outputs are a regression's: no final activation."""
    schema = Schema()
    schema.add("header", "header", None, "step header")
    schema.add("input", "input", "input_0", "model input input_0")
    schema.add("forward", "activation", "model/head", "output of model/head")
    schema.add("forward", "logits", "model/head", "logits of model output model/head")
    schema.add("loss", "loss", None, "total loss")
    schema.add("loss", "loss", "model/head", "loss of output model/head")
    schema.add("backward", "grad_out", "model/head", "gradient w.r.t. output of model/head")
    schema.add("backward", "grad_var", "model/head", "gradient of model/head/kernel")
    schema.add("backward", "grad_in", "model/head", "gradient w.r.t. input of model/head")
    return schema


def test_a_regressions_exploding_outputs_are_outputs_in_the_report(tmp_path):
    schema = _regression_schema()
    (logits,) = schema.find(kind="logits")
    run_dir = str(tmp_path / "regression")
    journal = RunJournal(run_dir, schema, {"model": "vectors"}, WatchOptions(flush_secs=1e9))
    for step in range(130):
        vector = base_vector(schema, step)
        if step >= 100:
            vector[logits.index("min")], vector[logits.index("max")] = -1e6, 1e6
        journal.record(step, 0, step, vector)
    journal.close("finished")
    assert journal.explosion_onset["signal"] == "logits"
    text = _report(run_dir)
    assert "explosion onset: step 100 (outputs)" in text
    assert "logits" not in text


def test_card_words_for_the_same_step_and_a_loop_without_loss_fn():
    out = run_node_module(f"""
      import {{ explosionNote, opNotNamed }} from "./src/incident_card.js";
      console.log(JSON.stringify({{
        same: explosionNote({{ step: 1 }}, {{ step: 1, signal: "loss" }}),
        before: explosionNote({{ step: 9 }}, {{ step: 4, signal: "loss" }}),
        why: opNotNamed({{ type: "", name: "", source: null, reproduced: false,
                           why: {json.dumps(NEEDS_LOSS_FN)} }}),
        plain: opNotNamed({{ type: "", name: "", source: null, reproduced: false }}),
      }}));
    """)
    assert out["same"] == "The explosion and the incident are the same step (loss)."
    assert "before it" not in out["same"]
    assert out["before"] == "Explosion onset before it: step 4 (loss)."
    assert out["why"] == f"No op is named: {NEEDS_LOSS_FN}."
    assert out["plain"].startswith("The replay did not reproduce")
