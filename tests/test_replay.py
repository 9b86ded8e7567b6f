"""The replay: the op and the user's source line that made the first NaN/Inf.

Each scenario's offending line is in this file; its ``file:line`` is found at
run time (``inspect``), from the text of the line, not hard-coded.
"""

from __future__ import annotations

import inspect
import io
import json
import shutil

import keras
import nanwatch_testlib as lib
import numpy as np
import pytest
import tensorflow as tf
from nanwatch_testlib import watched_step

import tb_nanwatch
from tb_nanwatch import cli
from tb_nanwatch.record.after_incident import bundle as bundle_module
from tb_nanwatch.record.after_incident import replay

BATCH = 4
STEPS = 6
BAD_STEP = 3


def line_of(function, text: str) -> str:
    """``file:line`` of the first line of ``function`` holding ``text``."""
    lines, first = inspect.getsourcelines(function)
    offset = next(i for i, line in enumerate(lines) if text in line)
    return f"{inspect.getsourcefile(function)}:{first + offset}"


@keras.saving.register_keras_serializable("test_replay")
class LogLayer(keras.layers.Layer):
    def call(self, x):
        return tf.math.log(x)


@keras.saving.register_keras_serializable("test_replay")
class NormLayer(keras.layers.Layer):
    def call(self, x):
        return tf.sqrt(tf.reduce_sum(x * x, axis=-1, keepdims=True))


def sqrt_of_abs_and_its_gradient(x):
    def backward(dy):
        return dy * 0.5 / tf.sqrt(x)  # NaN where x < 0: the backward's own sqrt

    return tf.sqrt(tf.abs(x)), backward


root_of_abs = tf.custom_gradient(sqrt_of_abs_and_its_gradient)


@keras.saving.register_keras_serializable("test_replay")
class RootLayer(keras.layers.Layer):
    def call(self, x):
        return root_of_abs(x)


def _rows(features: int = 3) -> np.ndarray:
    rows = np.random.RandomState(0).uniform(0.5, 1.5, (STEPS * BATCH, features))
    return rows.astype("float32")


def forward_log():
    """A negative input reaches ``log`` at BAD_STEP."""
    x = _rows()
    x[BAD_STEP * BATCH + 1, 0] = -1.0
    inp = keras.Input((3,))
    out = keras.layers.Dense(1, name="head")(LogLayer(name="log")(inp))
    where = {"phase": "forward", "layer": "log", "type": "Log", "name": "log/Log"}
    return keras.Model(inp, out, name="log_case"), x, where, line_of(LogLayer.call, "tf.math.log")


def lambda_division():
    """An all-zero row: the Lambda divides it by its first feature, 0/0, at BAD_STEP."""
    x = _rows()
    x[BAD_STEP * BATCH + 2] = 0.0
    inp = keras.Input((3,))
    # Only operators: a saved Lambda's code is reloaded without this module's globals.
    normalize = keras.layers.Lambda(lambda t: t / t[:, :1], name="normalize")
    out = keras.layers.Dense(1, name="head")(normalize(inp))
    where = {
        "phase": "forward",
        "layer": "normalize",
        "type": "RealDiv",
        "name": "normalize/truediv",
    }
    return keras.Model(inp, out, name="div_case"), x, where, line_of(lambda_division, "t / t[")


def backward_sqrt():
    """An all-zero row reaches ``sqrt``: finite forward, infinite derivative."""
    x = _rows()
    x[BAD_STEP * BATCH + 1] = 0.0
    inp = keras.Input((3,))
    h = keras.layers.Dense(4, use_bias=False, name="encode")(inp)
    out = keras.layers.Dense(1, name="head")(NormLayer(name="norm")(h))
    where = {
        "phase": "backward",
        "layer": "norm",
        "type": "SqrtGrad",
        "name": "gradient_tape/norm/SqrtGrad",
    }
    return keras.Model(inp, out, name="sqrt_case"), x, where, line_of(NormLayer.call, "tf.sqrt")


def custom_gradient_sqrt():
    """A custom gradient whose backward takes the sqrt of a negative at BAD_STEP."""
    x = _rows(4)
    x[BAD_STEP * BATCH + 3, 2] = -1.0
    inp = keras.Input((4,))
    h = keras.layers.Dense(4, use_bias=False, kernel_initializer="identity", name="encode")(inp)
    out = keras.layers.Dense(1, name="head")(RootLayer(name="root")(h))
    # A custom gradient's ops carry no layer scope: the graph names it plain "Sqrt".
    where = {"phase": "backward", "layer": "root", "type": "Sqrt", "name": "Sqrt", "op_layer": None}
    return (
        keras.Model(inp, out, name="root_case"),
        x,
        where,
        line_of(sqrt_of_abs_and_its_gradient, "tf.sqrt(x)"),
    )


SCENARIOS = {
    "forward_log": forward_log,
    "lambda_division": lambda_division,
    "backward_sqrt": backward_sqrt,
    "custom_gradient_sqrt": custom_gradient_sqrt,
}


def fit_until_incident(build, run_dir: str):
    model, x, where, source = build()
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    y = np.ones((len(x), 1), "float32")
    watch = tb_nanwatch.NanWatch(run_dir, trial_budget_s=lib.TRIAL_BUDGET_S)
    model.fit(x, y, batch_size=BATCH, shuffle=False, epochs=1, callbacks=[watch], verbose=0)
    assert watch.incident["step"] == BAD_STEP
    assert {k: watch.incident[k] for k in ("phase", "layer")} == {
        k: where[k] for k in ("phase", "layer")
    }
    return model, where, source


def loop_until_incident(build, run_dir: str, step_loss, **watch_options):
    """Trains ``build()``'s model in a custom loop until its incident; keyword
    arguments go to the StepWatcher."""
    model, x, where, source = build()
    optimizer = keras.optimizers.SGD(0.01)
    watcher = tb_nanwatch.StepWatcher(run_dir, model, optimizer, **watch_options)

    train_step = watched_step(watcher, model, optimizer, step_loss)

    y = np.ones((len(x), 1), "float32")
    for start in range(0, len(x), BATCH):
        train_step(tf.constant(x[start : start + BATCH]), tf.constant(y[start : start + BATCH]))
        if watcher.end_step():
            break
    watcher.close()
    assert watcher.incident["step"] == BAD_STEP
    assert watcher.incident["phase"] == where["phase"]
    return model, where, source


def assert_found(origin, where, source):
    assert origin is not None
    assert (origin.type, origin.phase, origin.source) == (where["type"], where["phase"], source)
    assert origin.reproduced, origin.detail
    assert (origin.name, origin.layer) == (where["name"], where.get("op_layer", where["layer"]))
    assert set(origin.to_json()) >= {"type", "name", "source", "reproduced"}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_replay_after_fit_names_op_and_line(scenario, tmp_path):
    model, where, source = fit_until_incident(SCENARIOS[scenario], str(tmp_path))
    saved = tb_nanwatch.load_bundle(str(tmp_path))
    before = [v.numpy().tobytes() for v in model.variables]
    origin = replay.replay_step(model, saved)
    assert_found(origin, where, source)
    assert [v.numpy().tobytes() for v in model.variables] == before


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_replay_after_custom_loop_names_op_and_line(scenario, tmp_path):
    loss_fn = keras.losses.MeanSquaredError()
    model, where, source = loop_until_incident(SCENARIOS[scenario], str(tmp_path), loss_fn)
    saved = tb_nanwatch.load_bundle(str(tmp_path))
    origin = replay.replay_step(model, saved, loss_fn=loss_fn)
    assert_found(origin, where, source)


def test_a_finite_batch_does_not_reproduce(tmp_path):
    model, _, _ = fit_until_incident(forward_log, str(tmp_path))
    saved = tb_nanwatch.load_bundle(str(tmp_path))
    x, _ = saved.batch
    x[x < 0] = 1.0  # the batch no longer holds the negative that log met
    origin = replay.replay_step(model, saved)
    assert origin is not None and not origin.reproduced
    assert origin.type == "" and "stayed finite" in origin.detail


def test_a_model_that_cannot_be_cloned_is_put_back_bitwise(tmp_path):
    class Unclonable(keras.Model):
        def __init__(self, width):  # no get_config: clone_model cannot rebuild it
            super().__init__()
            self.log = LogLayer()
            self.head = keras.layers.Dense(width)

        def call(self, x):
            return self.head(self.log(x))

    model = Unclonable(1)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    x = _rows()
    x[BAD_STEP * BATCH, 1] = -2.0
    watch = tb_nanwatch.NanWatch(str(tmp_path), trial_budget_s=lib.TRIAL_BUDGET_S)
    model.fit(
        x,
        np.ones((len(x), 1), "float32"),
        batch_size=BATCH,
        shuffle=False,
        verbose=0,
        callbacks=[watch],
    )
    before = [v.numpy().tobytes() for v in model.variables]
    origin = replay.replay_step(model, tb_nanwatch.load_bundle(str(tmp_path)))
    assert origin.type == "Log" and origin.source == line_of(LogLayer.call, "tf.math.log")
    assert [v.numpy().tobytes() for v in model.variables] == before


def run_cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(["replay", *argv], out, err)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("scenario", ["forward_log", "backward_sqrt"])
def test_cli_on_a_copied_run_dir_gives_the_same_answer(scenario, tmp_path):
    model, where, source = fit_until_incident(SCENARIOS[scenario], str(tmp_path / "run"))
    saved = tb_nanwatch.load_bundle(str(tmp_path / "run"))
    assert bundle_module.save_model(saved.directory, model)
    expected = replay.replay_step(model, saved).to_json()
    shutil.copytree(tmp_path / "run", tmp_path / "sent")
    shutil.rmtree(tmp_path / "run")
    code, out, err = run_cli(str(tmp_path / "sent"), "--json")
    assert code == 0, err
    assert json.loads(out) == {"step": BAD_STEP, "op": expected}  # fix_code only: no trials
    written = tb_nanwatch.load_bundle(str(tmp_path / "sent")).directory + "/replay.json"
    with open(written) as f:
        assert json.load(f)["op"]["source"] == source
    code, out, _ = run_cli(str(tmp_path / "sent"))
    assert code == 0 and source in out and where["type"] in out and "reproduced" in out


def test_cli_refuses_a_lambda_model_without_unsafe(tmp_path):
    model, _, source = fit_until_incident(lambda_division, str(tmp_path))
    saved = tb_nanwatch.load_bundle(str(tmp_path))
    assert bundle_module.save_model(saved.directory, model)
    code, _, err = run_cli(str(tmp_path))
    assert code == 2 and "--unsafe" in err and "Lambda" in err
    code, out, err = run_cli(str(tmp_path), "--json", "--unsafe")
    assert code == 0, err
    op = json.loads(out)["op"]
    assert (op["type"], op["source"], op["reproduced"]) == ("RealDiv", source, True)


def test_cli_exit_2_without_bundle_or_model(tmp_path):
    code, _, err = run_cli(str(tmp_path / "missing"))
    assert code == 2 and "no reproduction bundle" in err
    fit_until_incident(forward_log, str(tmp_path / "run"))
    # The watcher saves the model beside the bundle; a run dir without it (a
    # model that could not be serialized, an older record) is refused.
    directory = tb_nanwatch.load_bundle(str(tmp_path / "run")).directory
    with open(f"{directory}/bundle.json") as f:
        meta = json.load(f)
    assert meta.pop("model") == bundle_module.MODEL_FILE
    with open(f"{directory}/bundle.json", "w") as f:
        json.dump(meta, f)
    code, _, err = run_cli(str(tmp_path / "run"))
    assert code == 2 and "no model saved" in err


def test_replay_in_a_nested_model(tmp_path):
    x = _rows()
    x[BAD_STEP * BATCH + 1, 2] = -1.0
    backbone = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(3, use_bias=False, kernel_initializer="identity", name="enc"),
            LogLayer(name="block_log"),
        ],
        name="backbone",
    )
    inp = keras.Input((3,))
    model = keras.Model(inp, keras.layers.Dense(1, name="head")(backbone(inp)))
    where = {"phase": "forward", "layer": "backbone/block_log", "type": "Log"}
    model, _, _ = fit_until_incident(lambda: (model, x, where, ""), str(tmp_path))
    origin = replay.replay_step(model, tb_nanwatch.load_bundle(str(tmp_path)))
    assert (origin.name, origin.layer) == ("backbone/block_log/Log", "backbone/block_log")
    assert origin.source == line_of(LogLayer.call, "tf.math.log") and origin.reproduced


def test_without_a_loss_a_backward_incident_is_not_reproduced(tmp_path):
    loss_fn = keras.losses.MeanSquaredError()
    model, _, _ = loop_until_incident(backward_sqrt, str(tmp_path), loss_fn)
    origin = replay.replay_step(model, tb_nanwatch.load_bundle(str(tmp_path)))
    assert origin is not None and not origin.reproduced and origin.type == ""
    assert "no loss" in origin.detail


def test_global_state_is_restored(tmp_path):
    model, _, _ = fit_until_incident(forward_log, str(tmp_path))
    assert replay.replay_step(model, tb_nanwatch.load_bundle(str(tmp_path))).reproduced
    assert np.isnan(tf.math.log(tf.constant(-1.0)).numpy())  # check_numerics is off again
    assert keras.config.is_traceback_filtering_enabled()
    assert tf.debugging.is_traceback_filtering_enabled()


# -- a run dir someone sent ------------------------------------------------------------------


def test_cli_replays_a_plain_sequential_copied_and_run_from_elsewhere(tmp_path, monkeypatch):
    x = _rows()
    x[BAD_STEP * BATCH + 1, 0] = 3e38  # the output or the loss overflows
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4, kernel_initializer="ones"), keras.layers.Dense(1)]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    watch = tb_nanwatch.NanWatch(str(tmp_path / "run"), remedy_trials=False)
    y = np.ones((len(x), 1), "float32")
    model.fit(x, y, batch_size=BATCH, shuffle=False, callbacks=[watch], verbose=0)
    assert watch.incident["step"] == BAD_STEP
    recorded = list(tb_nanwatch.load_bundle(str(tmp_path / "run")).weights)
    assert recorded[0].startswith("sequential")  # the rebuilt model names them otherwise
    shutil.copytree(tmp_path / "run", tmp_path / "sent")
    shutil.rmtree(tmp_path / "run")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    code, out, err = run_cli(str(tmp_path / "sent"), "--json", "--no-trials")
    assert code == 0, err
    body = json.loads(out)
    assert body["op"]["type"] and body["op"]["reproduced"], body
    assert body["op"]["phase"] == watch.incident["phase"]
    assert "trials" not in body


CUSTOM_MODULE = """
import keras
import tensorflow as tf


@keras.saving.register_keras_serializable("h2b_sent")
class SentLog(keras.layers.Layer):
    def call(self, x):
        return tf.math.log(x)  # the sent layer's log: NaN below 0
"""


def import_file(path, name):
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_cli_replays_a_sent_run_dir_with_a_custom_layer_given_by_import(tmp_path, monkeypatch):
    import sys

    from keras.src.saving import object_registration

    source_file = tmp_path / "mods" / "h2b_sent_layers.py"
    source_file.parent.mkdir()
    source_file.write_text(CUSTOM_MODULE)
    layers = import_file(str(source_file), "h2b_sent_layers")
    x = _rows()
    x[BAD_STEP * BATCH + 1, 0] = -1.0
    inp = keras.Input((3,))
    model = keras.Model(inp, keras.layers.Dense(1)(layers.SentLog(name="sent_log")(inp)))
    fit_until_incident(
        lambda: (model, x, {"phase": "forward", "layer": "sent_log"}, ""), str(tmp_path / "run")
    )
    meta = tb_nanwatch.load_bundle(str(tmp_path / "run")).info
    assert {
        "name": "SentLog",
        "registered_name": "h2b_sent>SentLog",
        "module": "h2b_sent_layers",
    } in (meta["custom_objects"])
    assert meta["optimizer_config"]["class_name"] == "SGD"
    shutil.copytree(tmp_path / "run", tmp_path / "sent")
    # Another process: the class is neither registered nor importable.
    monkeypatch.delitem(object_registration.GLOBAL_CUSTOM_OBJECTS, "h2b_sent>SentLog")
    monkeypatch.delitem(sys.modules, "h2b_sent_layers")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    code, out, err = run_cli(str(tmp_path / "sent"))
    assert code == 2 and out == ""
    assert err.strip().count("\n") == 0, err  # one line
    assert "SentLog" in err and "--import h2b_sent_layers" in err
    code, out, err = run_cli(str(tmp_path / "sent"), "--json", "--import", str(source_file))
    assert code == 0, err
    op = json.loads(out)["op"]
    assert (op["type"], op["reproduced"]) == ("Log", True)
    line = 1 + next(i for i, text in enumerate(CUSTOM_MODULE.splitlines()) if "NaN below" in text)
    assert op["source"] == f"{source_file}:{line}"


def test_cli_tries_the_remedies_of_a_sent_run_dir(tmp_path):
    x = _rows()
    x[BAD_STEP * BATCH + 1, 2] = np.nan
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    watch = tb_nanwatch.NanWatch(str(tmp_path / "run"), remedy_trials=False)
    y = np.ones((len(x), 1), "float32")
    model.fit(x, y, batch_size=BATCH, shuffle=False, callbacks=[watch], verbose=0)
    shutil.copytree(tmp_path / "run", tmp_path / "sent")
    code, out, err = run_cli(str(tmp_path / "sent"), "--json")
    assert code == 0, err
    (dropped,) = [t for t in json.loads(out)["trials"] if t["remedy"] == "drop_bad_rows"]
    assert dropped["outcome"] == "fixed"
    with open(tmp_path / "sent" / "repro" / "trials.json") as f:
        assert json.load(f)["trials"][0]["remedy"] == "drop_bad_rows"
    assert not (tmp_path / "run" / "repro" / "trials.json").exists()


def test_a_replay_that_differs_from_an_xla_or_float16_step_says_what_to_try(tmp_path):
    model, _, _ = fit_until_incident(forward_log, str(tmp_path))
    saved = tb_nanwatch.load_bundle(str(tmp_path))
    x, _ = saved.batch
    x[x < 0] = 1.0  # the replay stays finite
    saved.info["run_facts"] = {"jit_compile": True, "dtype_policy": "mixed_float16"}
    origin = replay.replay_step(model, saved)
    assert not origin.reproduced
    assert "jit_compile=False" in origin.detail and "float32 policy" in origin.detail
    saved.info["run_facts"] = {"jit_compile": False, "dtype_policy": "float32"}
    assert "jit_compile" not in replay.replay_step(model, saved).detail
