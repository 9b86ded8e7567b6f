"""Every option is checked at construction, with a message naming it."""

from __future__ import annotations

import math
import pathlib

import keras
import pytest

import tb_nanwatch
from tb_nanwatch.record.session import MAX_WINDOW

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
