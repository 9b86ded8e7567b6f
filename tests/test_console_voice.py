"""One voice on the console: an incident's ``fit`` prints one NanWatch block,
the replay's op and the trials in at most ~15 lines, each NanWatch line on a
line of its own (never glued to Keras' progress bar), and none of TensorFlow's
numeric-check dump (kept in the bundle dir instead)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import scenarios
from nanwatch_testlib import worker_env

import tb_nanwatch
from tb_nanwatch.record.after_incident import captured_output, console
from tb_nanwatch.record.after_incident.replay import TENSORFLOW_OUTPUT

TENSORFLOW_DUMP = ("Detected Infinity or NaN", "Stack trace of op's creation", "CheckNumerics")
MAX_NANWATCH_LINES = 15


def nanwatch_lines(text: str) -> list[str]:
    """The lines NanWatch wrote: its own (``NanWatch...``) and their indented details."""
    return [line for line in text.splitlines() if line.startswith(("NanWatch", "  "))]


def glued(text: str) -> list[str]:
    """Lines where a NanWatch line does not start the line (glued to another writer's)."""
    return [
        line
        for line in text.splitlines()
        if "NanWatch" in line and not line.startswith(("NanWatch", "  "))
    ]


@pytest.mark.parametrize("verbose", [0, 1])
def test_an_incident_fit_says_one_block_and_no_tensorflow_dump(
    tmp_path, capfd, monkeypatch, verbose
):
    # Keras' bar (stdout) and NanWatch (stderr) into one stream, in the order written.
    monkeypatch.setattr(sys, "stderr", sys.stdout)
    keras.utils.set_random_seed(0)
    model, kwargs, truth = scenarios.loss_log_zero()
    run_dir = str(tmp_path / "run")
    watch = tb_nanwatch.NanWatch(run_dir, trial_budget_s=scenarios.TRIAL_BUDGET_S)
    model.fit(**kwargs, callbacks=[watch], verbose=verbose)
    assert watch.incident["step"] == truth["step"]
    out, err = capfd.readouterr()
    text = out + err
    for mark in TENSORFLOW_DUMP:
        assert mark not in text, text
    ours = nanwatch_lines(text)
    assert 0 < len(ours) <= MAX_NANWATCH_LINES, "\n".join(ours)
    assert glued(text) == [], text
    heads = [line for line in ours if line.startswith("NanWatch: first non-finite")]
    assert len(heads) == 1
    block = "\n".join(ours)
    assert "  first remedy: " in block and "tried when training ends" in block
    assert f"details: tb-nanwatch report {run_dir}" in block
    assert "NanWatch replay: step 5: first non-finite value from op Log" in block
    assert "NanWatch remedies, tried on a re-run of the recorded steps: " in block
    directory = tb_nanwatch.load_bundle(run_dir).directory
    assert os.path.join(directory, TENSORFLOW_OUTPUT) in block


# A user's process: TensorFlow's C++ log on (the tests' conftest turns it down).
USER_FIT = """
import sys, keras, scenarios, tb_nanwatch
keras.utils.set_random_seed(0)
model, kwargs, _ = scenarios.loss_log_zero()
watch = tb_nanwatch.NanWatch(sys.argv[1], trial_budget_s=scenarios.TRIAL_BUDGET_S)
model.fit(**kwargs, callbacks=[watch], verbose=1)
"""


def test_tensorflows_check_output_is_kept_in_the_bundle_not_printed(tmp_path):
    run_dir = str(tmp_path / "run")
    env = dict(worker_env(), TF_CPP_MIN_LOG_LEVEL="0")
    done = subprocess.run(
        [sys.executable, "-c", USER_FIT, run_dir],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # one stream, in the order written, as on a terminal
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stdout[-4000:]
    for mark in TENSORFLOW_DUMP:
        assert mark not in done.stdout, done.stdout
    assert 0 < len(nanwatch_lines(done.stdout)) <= MAX_NANWATCH_LINES, done.stdout
    assert glued(done.stdout) == [], done.stdout
    directory = tb_nanwatch.load_bundle(run_dir).directory
    with open(os.path.join(directory, TENSORFLOW_OUTPUT)) as f:
        kept = f.read()
    assert "Detected Infinity or NaN" in kept and "Stack trace of op's creation" in kept
    with open(os.path.join(directory, "replay.json")) as f:
        assert json.load(f)["tensorflow_output"] == TENSORFLOW_OUTPUT


def test_skip_lines_are_never_glued_to_the_progress_bar(tmp_path, capfd, monkeypatch):
    monkeypatch.setattr(sys, "stderr", sys.stdout)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 4)).astype("float32")
    x[3 * 8 + 2, 1] = np.nan
    x[5 * 8 + 2, 1] = np.nan
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    watch = tb_nanwatch.NanWatch(str(tmp_path), on_nonfinite="skip", remedy_trials=False)
    # Slower than the bar's update interval (0.05 s): the bar draws after every step.
    slow = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: time.sleep(0.06))
    y = np.ones((48, 1), "float32")
    model.fit(x, y, batch_size=8, shuffle=False, callbacks=[slow, watch], verbose=1)
    text = capfd.readouterr().out
    lines = text.splitlines()
    for step in (3, 5):
        assert any(line.startswith(f"NanWatch: step {step} was not applied") for line in lines)
    assert glued(text) == [], text


# -- the console itself -------------------------------------------------------------


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_one_updating_line_on_a_terminal(monkeypatch):
    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    voice = console.Console()
    voice.progress("NanWatch trial 1/2: a")
    voice.progress("NanWatch trial 2/2: b")
    voice.lines(["NanWatch remedies: done"])
    assert screen.getvalue() == (
        "\r\x1b[KNanWatch trial 1/2: a\r\x1b[KNanWatch trial 2/2: b\nNanWatch remedies: done\n"
    )


def test_progress_is_one_line_each_elsewhere_and_starts_after_the_bar(monkeypatch):
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    voice = console.Console()
    voice.others_wrote()  # Keras' bar left the cursor mid-line
    voice.progress("NanWatch trial 1/2: a")
    voice.progress("NanWatch trial 2/2: b")
    voice.others_wrote()
    voice.at_line_start()  # the bar ended its line
    voice.lines("NanWatch: done")
    assert log.getvalue() == "\nNanWatch trial 1/2: a\nNanWatch trial 2/2: b\nNanWatch: done\n"


def test_captured_keeps_what_is_written_to_the_descriptors(capfd):
    with captured_output.captured() as found:
        os.write(2, b"from C++ on fd 2\n")
        os.write(1, b"from C on fd 1\n")
        print("from Python", file=sys.stderr)
    print("after", file=sys.stderr)
    out, err = capfd.readouterr()
    assert "from" not in out + err and "after" in err
    assert found.text.splitlines() == ["from C++ on fd 2", "from C on fd 1", "from Python"]
