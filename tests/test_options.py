"""Every option is checked at construction, with a message naming it."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import pathlib
import re

import keras
import numpy as np
import pytest
from nanwatch_testlib import base_vector, write_vector_run

import tb_nanwatch
from tb_nanwatch.evidence import diagnosis
from tb_nanwatch.evidence.options import MAX_WINDOW, WatchOptions
from tb_nanwatch.record.writing.journal import RunJournal
from tb_nanwatch.record.writing.synthetic import build_schema

BAD_OPTIONS = [
    ("flush_secs", math.nan),
    ("flush_secs", math.inf),
    ("flush_secs", 0),
    ("flush_secs", True),
    ("flush_secs", "10"),
    ("explosion_factor", math.nan),
    ("explosion_factor", math.inf),
    ("explosion_factor", 10),
    ("explosion_factor", True),
    ("min_loss_scale", math.nan),
    ("min_loss_scale", -1.0),
    ("min_loss_scale", True),
    ("window", 10**12),
    ("window", MAX_WINDOW + 1),
    ("window", 0),
    ("window", True),
    ("window", 2.0),
    ("max_consecutive_skips", -1),
    ("max_consecutive_skips", True),
    ("snapshot_every", False),
    ("snapshot_every", 1.5),
    ("on_nonfinite", "ignore"),
    ("pre_step_weights", "always"),
]


def _model() -> keras.Model:
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, name="d")])
    model.compile(optimizer="sgd", loss="mse")
    return model


@pytest.mark.parametrize(("name", "value"), BAD_OPTIONS)
def test_nanwatch_refuses_a_bad_option_naming_it(tmp_path, name, value):
    with pytest.raises(ValueError, match=name):
        tb_nanwatch.NanWatch(str(tmp_path / "run"), **{name: value})


@pytest.mark.parametrize(("name", "value"), BAD_OPTIONS)
def test_step_watcher_refuses_a_bad_option_naming_it(tmp_path, name, value):
    model = _model()
    with pytest.raises(ValueError, match=name):
        tb_nanwatch.StepWatcher(str(tmp_path / "run"), model, model.optimizer, **{name: value})


@pytest.mark.parametrize("optimizer", ["adam", None, 1])
def test_step_watcher_refuses_what_is_not_a_keras_optimizer(tmp_path, optimizer):
    with pytest.raises(ValueError, match="optimizer must be"):
        tb_nanwatch.StepWatcher(str(tmp_path / "run"), _model(), optimizer)


def test_good_bounds_are_accepted(tmp_path):
    watch = tb_nanwatch.NanWatch(
        str(tmp_path / "run"),
        window=MAX_WINDOW,
        flush_secs=0.001,
        min_loss_scale=0,
        explosion_factor=10.5,
        max_consecutive_skips=0,
        snapshot_every=0,
    )
    assert watch.options.window == MAX_WINDOW and watch.options.flush_secs == 0.001


def test_a_pathlike_log_dir_is_accepted_and_written(tmp_path):
    import numpy as np

    log_dir = tmp_path / "logs" / "run"
    watch = tb_nanwatch.NanWatch(log_dir)
    assert watch.log_dir == str(log_dir)
    model = _model()
    x = np.ones((16, 3), "float32")
    model.fit(x, x[:, :1], batch_size=8, verbose=0, callbacks=[watch])
    assert watch.journal.steps == 2 and any(log_dir.glob("*.nanwatch"))
    watcher = tb_nanwatch.StepWatcher(pathlib.Path(tmp_path / "loop"), model, model.optimizer)
    assert watcher.log_dir == str(tmp_path / "loop")
    watcher.close()


def test_a_log_dir_that_is_not_a_path_is_refused(tmp_path):
    with pytest.raises(ValueError, match="log_dir"):
        tb_nanwatch.NanWatch(42)


# -- one default per option ------------------------------------------------------

OPTION_NAMES = [f.name for f in dataclasses.fields(WatchOptions)]


def _option_defaults(front_end) -> dict:
    """The keyword defaults of ``front_end``'s constructor that are options."""
    parameters = inspect.signature(front_end.__init__).parameters
    return {name: p.default for name, p in parameters.items() if name in OPTION_NAMES}


@pytest.mark.parametrize("front_end", ["NanWatch", "StepWatcher"])
def test_a_front_end_takes_every_option_with_the_options_default(front_end):
    defaults = _option_defaults(getattr(tb_nanwatch, front_end))
    assert sorted(defaults) == sorted(OPTION_NAMES)
    assert defaults == {f.name: f.default for f in dataclasses.fields(WatchOptions)}


def test_the_defaults_are_the_documented_ones(tmp_path):
    # The reference's option table documents every option and its default.
    page = pathlib.Path(__file__).resolve().parents[1] / "docs" / "reference" / "options.md"
    rows = re.findall(r"^\| `(\w+)` \| `([^`]+)` \|", page.read_text(), flags=re.MULTILINE)
    documented = {name: ast.literal_eval(default) for name, default in rows}
    defaults = {f.name: f.default for f in dataclasses.fields(WatchOptions)}
    assert {name: documented.get(name) for name in defaults} == defaults
    assert tb_nanwatch.NanWatch(str(tmp_path / "run")).options == WatchOptions()


def test_options_are_normalised_and_frozen():
    options = WatchOptions(window=np.int64(5), min_loss_scale=0, flush_secs=np.float32(2))
    assert type(options.window) is int and options.window == 5
    assert type(options.min_loss_scale) is float and type(options.flush_secs) is float
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.window = 7


def _skipped_below_one(schema, step: int) -> np.ndarray:
    vector = base_vector(schema, step)
    vector[schema.header_index("skipped")] = 1.0
    vector[schema.header_index("loss_scale")] = 0.5
    return vector


def test_a_journal_without_options_keeps_the_users_loss_scale_floor(tmp_path):
    schema = build_schema(2)
    journal = RunJournal(str(tmp_path / "run"), schema, {"model": "m"})
    assert journal.options == WatchOptions() and journal.options.min_loss_scale == 1.0
    incident = journal.record(0, 0, 0, _skipped_below_one(schema, 0))
    journal.close()
    assert incident is not None and "below the floor 1" in incident["note"]


def test_a_loss_scale_floor_of_zero_turns_the_check_off(tmp_path):
    schema = build_schema(2)
    journal = RunJournal(
        str(tmp_path / "run"), schema, {"model": "m"}, WatchOptions(min_loss_scale=0)
    )
    incident = journal.record(0, 0, 0, _skipped_below_one(schema, 0))
    journal.close()
    assert incident is None and journal.skipped_steps == [0]


# -- the explosion rule's reference is not the flight window ----------------------


def test_the_explosion_detector_names_its_reference_steps():
    parameters = inspect.signature(diagnosis.ExplosionDetector).parameters
    assert "reference_steps" in parameters and "window" not in parameters
    assert parameters["factor"].default == WatchOptions.explosion_factor
    with pytest.raises(ValueError, match="reference_steps"):
        diagnosis.ExplosionDetector(reference_steps=0)


def _climbs(step, vector, schema):
    if step >= 60:
        loss = 10.0 ** min(step - 59, 6)
        vector[schema.header_index("loss")] = loss
        total = next(e for e in schema.entries if e.kind == "loss" and e.layer is None)
        vector[total.index("value")] = loss


def test_the_flight_window_does_not_change_the_explosion_onset(tmp_path):
    short = write_vector_run(str(tmp_path / "short"), 80, _climbs, window=2)
    long = write_vector_run(str(tmp_path / "long"), 80, _climbs, window=200)
    assert (short["window"], long["window"]) == (2, 200)
    assert short["explosion"] is not None
    assert short["explosion"] == long["explosion"]


def test_the_run_summary_holds_the_explosion_factor(tmp_path):
    summary = write_vector_run(str(tmp_path / "run"), 3, explosion_factor=50)
    assert summary["explosion_factor"] == 50.0
