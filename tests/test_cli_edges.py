"""The command line at its edges, as a new user meets them: ``replay``'s own
line breaks, ``report | head -1``, a TensorFlow-free install, and
``tb_nanwatch.compat.v1`` reached from the package (issue 56)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tb_nanwatch import cli
from tb_nanwatch.record.writing.synthetic import write_synthetic_run

ROOT = Path(__file__).resolve().parent.parent


def _python(code: str, **kwargs) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, text=True, timeout=120, **kwargs
    )


def test_replay_breaks_its_own_lines_and_escapes_the_names(tmp_path, monkeypatch):
    from tb_nanwatch.record.after_incident import bundle, replay

    saved = bundle.ReproBundle(step=7, batch=None, weights={}, info={}, directory=str(tmp_path))
    origin = replay.OpOrigin(
        type="Log",
        name="dense/\x1b[2JLog",
        source="train.py:12",
        phase="forward",
        reproduced=True,
        detail="log of 0",
    )
    monkeypatch.setattr(bundle, "load_bundle", lambda run_dir: saved)
    monkeypatch.setattr(bundle, "load_model", lambda *args, **kwargs: (None, None))
    monkeypatch.setattr(cli, "_replay_then_trials", lambda *args: (origin, None))
    out, err = io.StringIO(), io.StringIO()
    assert cli.main(["replay", str(tmp_path), "--no-trials"], out=out, err=err) == 0
    text = out.getvalue()
    assert "\\x0a" not in text
    lines = text.splitlines()
    assert lines[0].startswith("step 7: first non-finite value from op Log")
    assert "\\x1b[2J" in lines[0] and "\x1b" not in text  # a name from the run dir stays inert
    assert lines[1] == "  source: train.py:12"
    assert lines[2] == "  reproduced: log of 0"


def test_report_into_a_closed_pipe_exits_quietly(tmp_path):
    write_synthetic_run(str(tmp_path / "run"), 50, incident_step=30)
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader (``head -1``) is gone before the report is written
    try:
        result = _python(
            f"import sys; from tb_nanwatch import cli; sys.exit(cli.main(['report', {str(tmp_path)!r}]))",
            stdout=write_end,
            stderr=subprocess.PIPE,
        )
    finally:
        os.close(write_end)
    assert "Traceback" not in result.stderr and "BrokenPipeError" not in result.stderr
    assert result.returncode in (0, cli.EXIT_BROKEN_PIPE)


_WITHOUT_TENSORFLOW = textwrap.dedent(
    """
    import sys

    class NoTensorFlow:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in ("tensorflow", "keras", "tf_keras"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoTensorFlow())
    """
)


def test_replay_without_tensorflow_is_one_clear_line(tmp_path):
    result = _python(
        _WITHOUT_TENSORFLOW
        + f"from tb_nanwatch import cli\nsys.exit(cli.main(['replay', {str(tmp_path)!r}]))\n",
        capture_output=True,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        "tb-nanwatch replay needs TensorFlow: pip install 'tb_nanwatch[tensorflow-cpu]' (or tensorflow)"
    )


def test_compat_is_reached_from_the_package_and_v1_only_when_touched():
    result = _python(
        _WITHOUT_TENSORFLOW
        + textwrap.dedent(
            """
            import tb_nanwatch
            compat = tb_nanwatch.compat
            assert compat.__name__ == "tb_nanwatch.compat"
            assert "tb_nanwatch.compat.v1" not in sys.modules
            try:
                compat.v1
            except ModuleNotFoundError as error:
                print("v1 needs", error.name)
            """
        ),
        capture_output=True,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "v1 needs tensorflow"


def test_compat_v1_graph_watcher_as_users_write_it():
    import tb_nanwatch

    assert tb_nanwatch.compat.v1.GraphWatcher.__name__ == "GraphWatcher"
    with pytest.raises(AttributeError):
        tb_nanwatch.compat.v2  # noqa: B018
