"""bench/compile_phases.py splits an XLA first step by TensorFlow's own compile log."""

from __future__ import annotations

import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH)

from compile_phases import compile_phases, log_seconds, run_child  # noqa: E402


def _log(stamp, entries: list[tuple[float, str]]) -> list[str]:
    return [f"I0000 {stamp(t)}    7876 {message}" for t, message in entries]


def _compile(start: float, lowered: float, backend: float, finished: float, done: float):
    return [
        (start - 0.5, "port.cc:153] oneDNN custom operations are on."),
        (start, "device_compiler.h:551] Instantly compiling for signature: __inference_f"),
        (start + 0.01, "xla_compiler.cc:820] XlaCompiler::CompileFunction __inference_f[]"),
        (lowered, "xla_compiler.cc:923] ===================================================="),
        (backend, "cpu_compiler.cc:2060] Compiling: a_inference_f__.142"),
        (finished, "cpu_compiler.cc:2109] Compilation finished"),
        (done, "device_compiler.h:538] Compilation of XLA executable time: 2 s"),
        (done + 0.1, "device_compiler.h:562] Already Compiled for signature: __inference_f"),
    ]


@pytest.mark.parametrize(
    "stamp",
    [lambda t: f"00:00:{1796509400 + t:.6f}", lambda t: f"23:01:{10 + t:09.6f}"],
    ids=["before-absl-init", "wall-clock"],
)
def test_the_phases_come_from_the_log_timestamps(stamp):
    lines = _log(stamp, _compile(start=1.0, lowered=1.75, backend=2.0, finished=3.25, done=3.5))
    phases = compile_phases(["WARNING: no timestamp here", *lines])
    assert phases == pytest.approx(
        {"tf2xla_s": 0.75, "hlo_s": 0.25, "backend_s": 1.25, "compile_s": 2.5}, abs=1e-6
    )


def test_without_the_cpu_backend_lines_only_the_lowering_and_the_total():
    entries = [e for e in _compile(1.0, 1.75, 2.0, 3.25, 3.5) if "cpu_compiler" not in e[1]]
    phases = compile_phases(_log(lambda t: f"00:00:{t:.6f}", entries))
    assert phases["hlo_s"] is None and phases["backend_s"] is None
    assert phases["tf2xla_s"] == pytest.approx(0.75) and phases["compile_s"] == pytest.approx(2.5)


def test_a_log_without_a_finished_compile_has_no_phases():
    entries = _compile(1.0, 1.75, 2.0, 3.25, 3.5)
    stamp = lambda t: f"00:00:{t:.6f}"  # noqa: E731
    assert compile_phases(_log(stamp, entries[:1])) is None  # no compile started
    assert compile_phases(_log(stamp, entries[:-2])) is None  # started, never done
    assert log_seconds("Traceback (most recent call last):") is None


def test_a_real_first_step_under_xla_is_split_in_full():
    # The markers are TensorFlow's own log lines: this fails if a TensorFlow
    # version stops writing them.
    result = run_child("mlp", "plain", optimizer_built=False)
    assert "error" not in result, result.get("error")
    assert result["xla"] is True
    assert result["tf2xla_s"] > 0 and result["hlo_s"] > 0 and result["backend_s"] > 0
    parts = result["tf2xla_s"] + result["hlo_s"] + result["backend_s"]
    assert parts <= result["compile_s"] + 1e-6 < result["ttfs_s"]
    assert result["outside_s"] == pytest.approx(result["ttfs_s"] - result["compile_s"])
