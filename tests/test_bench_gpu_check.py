"""The GPU check (``python bench/realistic.py --gpu``) says why there is no
GPU table instead of measuring the CPU under a GPU heading."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH)

import realistic  # noqa: E402


def _fake_python(tmp_path, stdout: str, stderr: str = "", code: int = 0) -> str:
    """An executable standing in for an interpreter: prints what TensorFlow would."""
    path = tmp_path / "python"
    path.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        f"print({stdout!r})\n"
        f"print({stderr!r}, file=sys.stderr)\n"
        f"sys.exit({code})\n"
    )
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize(
    ("stdout", "stderr", "code", "gpus", "reason"),
    [
        ("", "ModuleNotFoundError: No module named 'tensorflow'", 1, [], "does not import"),
        ('{"version": "2.21.0", "cuda": false, "gpus": []}', "", 0, [], "without CUDA"),
        ('{"version": "2.21.0", "cuda": true, "gpus": []}', "", 0, [], "sees no GPU"),
        (
            '{"version": "2.21.0", "cuda": true, "gpus": ["/physical_device:GPU:0"]}',
            "",
            0,
            ["/physical_device:GPU:0"],
            "",
        ),
    ],
)
def test_gpu_names_says_why_there_is_none(tmp_path, stdout, stderr, code, gpus, reason):
    found, why = realistic.gpu_names(_fake_python(tmp_path, stdout, stderr, code))
    assert found == gpus
    assert (reason in why) if reason else why == ""
    if code:
        assert "No module named 'tensorflow'" in why  # the interpreter's own words


def test_the_gpu_check_refuses_to_measure_without_a_gpu():
    gpus, why = realistic.gpu_names()
    if gpus:  # a GPU machine: the check would measure; here it must have found one
        assert why == ""
        return
    out = subprocess.run(
        [sys.executable, os.path.join(BENCH, "realistic.py"), "--gpu", "--models", "mlp"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stdout.strip() == f"No GPU table: {why}."
