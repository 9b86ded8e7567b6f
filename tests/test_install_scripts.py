"""The README's commands on a machine with only the system's python3.

The install scripts run in a clean environment (``env -i``, PATH=/usr/bin:/bin,
so ``python3`` is Debian's, which refuses ``pip install`` outside a virtual
environment: PEP 668) on a copy of scripts/, with NANWATCH_VENV_ONLY=1 so that
they stop once they have chosen their Python instead of downloading TensorFlow.
"""

from __future__ import annotations

import base64
import hashlib
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SYSTEM_PYTHON = Path("/usr/bin/python3")
README_COMMANDS = ("scripts/demo.sh", "scripts/test.sh")

pytestmark = pytest.mark.skipif(
    not SYSTEM_PYTHON.exists(), reason="needs a system /usr/bin/python3 (Debian)"
)


def copy_scripts(dest: Path) -> Path:
    dest.mkdir()
    shutil.copytree(ROOT / "scripts", dest / "scripts")
    return dest


def run_clean(repo: Path, script: str, **env: str) -> subprocess.CompletedProcess:
    clean = {"PATH": "/usr/bin:/bin", "HOME": str(repo), "NANWATCH_VENV_ONLY": "1", **env}
    return subprocess.run(
        ["env", "-i", *(f"{k}={v}" for k, v in clean.items()), "bash", script],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=300,
    )


def chosen_python(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stdout + result.stderr
    (line,) = [x for x in result.stdout.splitlines() if x.startswith("Python: ")]
    return line.removeprefix("Python: ")


def probe_wheel(folder: Path) -> Path:
    """A minimal pure-Python wheel, so that pip installs without a network."""
    files = {
        "nanwatch_probe.py": b"VALUE = 42\n",
        "nanwatch_probe-0.1.dist-info/METADATA": (
            b"Metadata-Version: 2.1\nName: nanwatch-probe\nVersion: 0.1\n"
        ),
        "nanwatch_probe-0.1.dist-info/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = "".join(
        f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}\n"
        for name, data in files.items()
    )
    files["nanwatch_probe-0.1.dist-info/RECORD"] = (
        record + "nanwatch_probe-0.1.dist-info/RECORD,,\n"
    ).encode()
    path = folder / "nanwatch_probe-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
    return path


@pytest.fixture(scope="module")
def fresh_repo(tmp_path_factory) -> Path:
    """A copy of scripts/ on which the demo command ran once, with no venv active."""
    repo = copy_scripts(tmp_path_factory.mktemp("fresh") / "repo")
    result = run_clean(repo, "scripts/demo.sh")
    assert "No virtual environment is active: creating one in" in result.stdout
    assert chosen_python(result) == str(repo / ".venv" / "bin" / "python")
    return repo


def _python_output(python, code: str) -> subprocess.CompletedProcess:
    """``python -c code``, checked, with its output as text."""
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True)


def test_a_fresh_checkout_gets_a_project_venv_built_on_the_system_python(fresh_repo):
    venv_python = fresh_repo / ".venv" / "bin" / "python"
    prefixes = _python_output(
        str(venv_python), "import sys; print(sys.prefix); print(sys.base_prefix)"
    ).stdout.split()
    assert prefixes[0] == str(fresh_repo / ".venv")
    base = _python_output(str(SYSTEM_PYTHON), "import sys; print(sys.base_prefix)").stdout.strip()
    assert prefixes[1] == base


def test_pip_in_the_project_venv_is_not_refused(fresh_repo, tmp_path):
    wheel = probe_wheel(tmp_path)
    venv_python = str(fresh_repo / ".venv" / "bin" / "python")
    install = subprocess.run(
        [venv_python, "-m", "pip", "install", "--no-index", "--no-deps", str(wheel)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    assert "externally-managed-environment" not in install.stdout + install.stderr
    value = _python_output(venv_python, "import nanwatch_probe; print(nanwatch_probe.VALUE)")
    assert value.stdout.strip() == "42"


def test_the_system_python_itself_refuses_pip_here(tmp_path):
    """The situation the venv exists for (PEP 668), when the system Python has pip at all."""
    marker = _python_output(
        str(SYSTEM_PYTHON), "import sysconfig; print(sysconfig.get_path('stdlib'))"
    ).stdout.strip()
    has_pip = subprocess.run([str(SYSTEM_PYTHON), "-m", "pip", "--version"], capture_output=True)
    if not (Path(marker) / "EXTERNALLY-MANAGED").exists() or has_pip.returncode != 0:
        pytest.skip("this system Python is not an externally managed one with pip")
    refused = subprocess.run(
        [str(SYSTEM_PYTHON), "-m", "pip", "install", "--no-index", str(probe_wheel(tmp_path))],
        capture_output=True,
        text=True,
    )
    assert refused.returncode != 0
    assert "externally-managed-environment" in refused.stdout + refused.stderr


@pytest.mark.parametrize("script", README_COMMANDS)
def test_both_readme_commands_reuse_the_project_venv(fresh_repo, script):
    config = fresh_repo / ".venv" / "pyvenv.cfg"
    created = config.stat().st_mtime_ns
    result = run_clean(fresh_repo, script)
    assert "using the project's" in result.stdout
    assert chosen_python(result) == str(fresh_repo / ".venv" / "bin" / "python")
    assert config.stat().st_mtime_ns == created


@pytest.mark.parametrize("script", README_COMMANDS)
def test_an_active_venv_is_used_and_no_project_venv_made(fresh_repo, tmp_path, script):
    repo = copy_scripts(tmp_path / "repo")
    venv = fresh_repo / ".venv"
    result = run_clean(repo, script, VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}:/usr/bin:/bin")
    assert f"Using the active virtual environment {venv}" in result.stdout
    assert chosen_python(result) == str(venv / "bin" / "python")
    assert not (repo / ".venv").exists()


def test_a_broken_active_venv_is_a_clear_error(tmp_path):
    repo = copy_scripts(tmp_path / "repo")
    result = run_clean(repo, "scripts/install.sh", VIRTUAL_ENV=str(tmp_path / "gone"))
    assert result.returncode != 0
    assert f"VIRTUAL_ENV is set to {tmp_path / 'gone'}, which has no bin/python" in result.stderr
    assert not (repo / ".venv").exists()


def test_ci_runs_the_readme_test_command():
    readme_commands = [
        line.strip()
        for line in (ROOT / "README.md").read_text().splitlines()[:12]
        if line.startswith("    bash scripts/")
    ]
    assert readme_commands == ["bash scripts/demo.sh", "bash scripts/test.sh"]
    ci_commands = [
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert ci_commands[-1] == readme_commands[1]
