"""An explosion without NaN is announced on the console: one block, once a
run, with the signal, the onset step, the growth, the learning rate and its
jump, the cause and its first remedy, the run dir and the report command;
before any trial output."""

from __future__ import annotations

import scenarios
from scenarios import fit


def test_the_explosion_is_announced_once_with_its_onset(tmp_path, capfd):
    run_dir = tmp_path / "run"
    _, watch, _, _ = fit(scenarios.exploding, run_dir)
    onset = watch.journal.explosion_onset
    assert watch.incident is None and onset is not None
    out, err = capfd.readouterr()
    text = out + err
    heads = [
        line
        for line in text.splitlines()
        if line.startswith("NanWatch:") and " exploded from step " in line
    ]
    assert len(heads) == 1, text
    assert heads[0].startswith(f"NanWatch: {onset['signal']}")
    assert f"exploded from step {onset['step']} " in heads[0]
    block = text[text.index(heads[0]) :]
    assert "growth: " in block and "x its reference level" in block
    assert "learning rate at the onset: 1.6" in block
    assert f"jumped 0.01 -> 1.6 at step {onset['lr_change']['step']}" in block
    assert f"details: tb-nanwatch report {watch.journal.writer.log_dir}" in block
    assert "  cause explosion: " in block
    assert "  first remedy: Fix the learning-rate schedule" in block
    trials_at = text.find("NanWatch trials")
    assert trials_at == -1 or trials_at > text.index(heads[0])
