"""The replay at the end of training, beyond a plain ``fit`` (test_incident_wiring):
before ``on_nonfinite="raise"`` raises, not for an update-phase incident, the
model travelling with the bundle, and the run-summary keys the cause reads."""

from __future__ import annotations

import inspect
import io
import json
import os

import keras
import nanwatch_testlib as lib
import numpy as np
import pytest
import tensorflow as tf

import tb_nanwatch
from tb_nanwatch import cli
from tb_nanwatch.record import run_info
from tb_nanwatch.record.after_incident import bundle as bundle_module
from tb_nanwatch.record.after_incident import replay
from tb_nanwatch.record.callback import NonFiniteError

BATCH = 4
STEPS = 6
BAD_STEP = 2


class WiringLog(keras.layers.Layer):
    def call(self, x):
        return tf.math.log(x)


def log_line() -> str:
    lines, first = inspect.getsourcelines(WiringLog.call)
    offset = next(i for i, line in enumerate(lines) if "tf.math.log" in line)
    return f"{inspect.getsourcefile(WiringLog.call)}:{first + offset}"


def log_model() -> keras.Model:
    inp = keras.Input((3,), name="features")
    out = keras.layers.Dense(1, name="head")(WiringLog(name="log")(inp))
    return keras.Model(inp, out, name="wiring")


def fit_log_model(run_dir: str, **watch_options) -> tb_nanwatch.NanWatch:
    x = np.random.RandomState(0).uniform(0.5, 1.5, (STEPS * BATCH, 3)).astype("float32")
    x[BAD_STEP * BATCH + 1, 0] = -1.0  # log of a negative at BAD_STEP
    model = log_model()
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    watch = tb_nanwatch.NanWatch(run_dir, **watch_options, trial_budget_s=lib.TRIAL_BUDGET_S)
    y = np.ones((len(x), 1), "float32")
    model.fit(x, y, batch_size=BATCH, shuffle=False, callbacks=[watch], verbose=0)
    return watch


def report_run(run_dir: str) -> dict:
    out, err = io.StringIO(), io.StringIO()
    assert cli.main(["report", run_dir, "--json"], out, err) == 0, err.getvalue()
    (run,) = json.loads(out.getvalue())["runs"]
    return run


def test_raise_replays_before_raising(tmp_path, capfd):
    with pytest.raises(NonFiniteError):
        fit_log_model(str(tmp_path), on_nonfinite="raise")
    op = report_run(str(tmp_path))["first_nonfinite"]["op"]
    assert op == {"type": "Log", "name": "log/Log", "source": log_line(), "reproduced": True}
    saved = tb_nanwatch.load_bundle(str(tmp_path))
    assert os.path.exists(os.path.join(saved.directory, bundle_module.MODEL_FILE))
    with open(os.path.join(saved.directory, bundle_module.REPLAY_FILE)) as f:
        assert json.load(f)["op"]["source"] == log_line()
    err = capfd.readouterr().err
    assert "\nNanWatch replay: step 2: first non-finite value from op Log (log/Log)" in err


def test_an_update_phase_incident_is_not_replayed(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(replay, "replay_step", lambda *a, **k: calls.append(a))
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    # Adam with epsilon=0 and a zero gradient: 0/0 in the update, all before it finite.
    model.compile(optimizer=keras.optimizers.Adam(epsilon=0.0), loss="mse")
    watch = tb_nanwatch.NanWatch(str(tmp_path), trial_budget_s=lib.TRIAL_BUDGET_S)
    zeros = np.zeros((8, 3), "float32")
    model.fit(zeros, np.zeros((8, 1), "float32"), batch_size=4, callbacks=[watch], verbose=0)
    assert watch.incident["phase"] == "update" and calls == []
    assert report_run(str(tmp_path))["first_nonfinite"]["op"] is None


def test_loss_fn_must_be_callable(tmp_path):
    with pytest.raises(ValueError, match="loss_fn"):
        tb_nanwatch.StepWatcher(str(tmp_path), log_model(), keras.optimizers.SGD(), loss_fn="mse")


def test_step_watcher_records_loss_from_logits_of_its_loss_fn(tmp_path):
    loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)
    watcher = tb_nanwatch.StepWatcher(
        str(tmp_path), log_model(), keras.optimizers.SGD(), loss_fn=loss_fn
    )
    assert watcher.session.run_info["loss_from_logits"] is True
    watcher.close()


def test_mixed_precision_policy_and_every_weight_checked(tmp_path):
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        inp = keras.Input((3,))
        h = keras.layers.BatchNormalization()(keras.layers.Dense(2)(inp))
        model = keras.Model(inp, keras.layers.Dense(1, dtype="float32")(h))
        model.compile(optimizer="sgd", loss="mse")
        watch = tb_nanwatch.NanWatch(str(tmp_path), trial_budget_s=lib.TRIAL_BUDGET_S)
        ones = np.ones((8, 3), "float32")
        model.fit(ones, np.ones((8, 1), "float32"), batch_size=4, callbacks=[watch], verbose=0)
    finally:
        keras.config.set_dtype_policy(previous)
    summary = watch.journal.summary()
    assert summary["dtype_policy"] == "mixed_float16"
    # 2 + 2 Dense weights, BatchNormalization's gamma, beta and moving statistics.
    assert summary["weights_at_start"] == {"checked": 8, "nonfinite": []}
    assert summary["loss_from_logits"] is None  # "mse" reads no logits or probabilities


@pytest.mark.parametrize(
    ("loss", "expected"),
    [
        ("binary_crossentropy", False),
        (keras.losses.BinaryCrossentropy(from_logits=True), True),
        (keras.losses.SparseCategoricalCrossentropy(), False),
        ("mse", None),
        (lambda y, p: tf.reduce_mean(y - p), None),
        ({"a": keras.losses.CategoricalCrossentropy(from_logits=True), "b": "mse"}, None),
        ([keras.losses.BinaryCrossentropy(from_logits=True)] * 2, True),
    ],
)
def test_loss_from_logits(loss, expected):
    assert run_info.loss_from_logits(loss) is expected


# -- the remedy trials at the end of training and in a copied run dir ----------------------


def test_an_explosion_gets_its_trials_at_the_end_and_again_from_a_copied_run_dir(
    tmp_path, monkeypatch
):
    import shutil

    from scenarios import exploding

    model, fit_args, truth = exploding()
    watch = tb_nanwatch.NanWatch(
        str(tmp_path / "run"), rewind_every=20, trial_budget_s=lib.TRIAL_BUDGET_S
    )
    model.fit(**fit_args, callbacks=[watch], verbose=0)
    assert watch.incident is None
    with open(tmp_path / "run" / "repro" / "trials.json") as f:
        written = json.load(f)
    assert written["cause"] == "explosion" and written["step"] >= truth["jump_step"]
    assert written["baseline"]["outcome"] == "not_fixed"  # the re-run explodes again
    lower = {t["remedy"]: t for t in written["trials"]}["lower_lr"]
    assert lower["outcome"] == "fixed" and lower["setting"].startswith("lr x")
    # Sent elsewhere: no bundle, the model beside the rewind point; the same trials.
    shutil.copytree(tmp_path / "run", tmp_path / "sent")
    os.remove(tmp_path / "sent" / "repro" / "trials.json")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    out, err = io.StringIO(), io.StringIO()
    assert cli.main(["replay", str(tmp_path / "sent"), "--json"], out, err) == 0, err.getvalue()
    body = json.loads(out.getvalue())
    assert body["op"] is None
    assert body["trials"] == written["trials"]
    # Both re-runs were checked against the recorded losses (the journal's; the record's).
    with open(tmp_path / "sent" / "repro" / "trials.json") as f:
        again = json.load(f)
    for fidelity in (written["fidelity"], again["fidelity"]):
        assert fidelity.startswith("the re-run reproduced the recorded losses"), fidelity


def test_seed003_demo_card_names_the_op_and_its_source_line(tmp_path):
    from demo import seed003_custom_loop_autoencoder as seed003

    seed003.run(str(tmp_path))
    op = report_run(str(tmp_path))["first_nonfinite"]["op"]
    lines, first = inspect.getsourcelines(seed003.CodeNorm.call)
    offset = next(i for i, line in enumerate(lines) if "tf.sqrt" in line)
    assert (op["type"], op["reproduced"]) == ("SqrtGrad", True)
    assert op["source"] == f"{inspect.getsourcefile(seed003.CodeNorm.call)}:{first + offset}"
