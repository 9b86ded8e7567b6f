"""The package's parts and who may import whom (docs/design.md).

* ``tb_nanwatch.evidence``: decides (schema, rules, causes); imports neither of
  the other parts, nor TensorFlow, Keras or TensorBoard.
* ``tb_nanwatch.record``: runs in the training process; may import
  ``evidence``, never ``board``.
* ``tb_nanwatch.board``: TensorBoard and the command line's readers; may
  import ``evidence``, never ``record``, never TensorFlow or Keras (a broken
  import in a plugin stops TensorBoard itself).
* ``tb_nanwatch.compat``: front ends for code that is not TF2 Keras (TF1
  graphs); built on ``record`` and ``evidence`` like ``record``'s own, never
  imported by them, never importing ``board``.

Checked twice: statically, on every ``import`` statement of every module
(function-level imports included), and at run time, by importing each module
that must work without TensorFlow in a fresh interpreter.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tb_nanwatch"
PARTS = ("evidence", "record", "board", "compat")
TENSORFLOW = ("tensorflow", "keras", "tf_keras")

# What each part must not import (module prefixes).
FORBIDDEN = {
    "evidence": (
        "tb_nanwatch.record",
        "tb_nanwatch.board",
        "tb_nanwatch.compat",
        "tb_nanwatch.cli",
        "tensorboard",
    )
    + TENSORFLOW,
    "record": ("tb_nanwatch.board", "tb_nanwatch.compat", "tb_nanwatch.cli"),
    "board": ("tb_nanwatch.record", "tb_nanwatch.compat") + TENSORFLOW,
    "compat": ("tb_nanwatch.board", "tb_nanwatch.cli"),
}

# Record modules that write or judge a run without running a model: they must
# import without TensorFlow too (synthetic runs for the tests and benchmarks).
RECORD_WITHOUT_TENSORFLOW = ("journal", "event_writer", "synthetic", "crash_safety")


def _modules(part: str) -> list[Path]:
    return sorted((PACKAGE / part).rglob("*.py"))


def imported_names(source: str, package: str) -> set[str]:
    """Every module an ``import`` statement of ``source`` names (relative ones
    resolved against ``package``), including ``from x import y`` as ``x.y``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _breaks(name: str, forbidden: tuple[str, ...]) -> bool:
    return any(name == f or name.startswith(f + ".") for f in forbidden)


def test_the_checker_sees_nested_and_relative_imports():
    source = "def f():\n    from ..record import journal\n    import tensorflow as tf\n"
    names = imported_names(source, "tb_nanwatch.board")
    assert "tb_nanwatch.record.journal" in names and "tensorflow" in names
    assert _breaks("tb_nanwatch.record.journal", FORBIDDEN["board"])
    assert not _breaks("tb_nanwatch.recorder", FORBIDDEN["board"])


def test_the_package_has_its_parts_and_nothing_else_at_the_top():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert top == ["__init__.py", "cli.py"]
    for part in PARTS:
        assert _modules(part), f"tb_nanwatch/{part}/ is empty"


@pytest.mark.parametrize("part", PARTS)
def test_each_part_imports_only_what_it_may(part):
    broken = []
    for path in _modules(part):
        package = "tb_nanwatch." + ".".join(path.relative_to(PACKAGE).parent.parts)
        for name in imported_names(path.read_text(encoding="utf-8"), package):
            if _breaks(name, FORBIDDEN[part]):
                broken.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert broken == []


def _without_tensorflow_modules() -> list[str]:
    names = []
    for part in ("evidence", "board"):
        for path in _modules(part):
            dotted = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
            names.append("tb_nanwatch." + dotted.removesuffix(".__init__"))
    names += [f"tb_nanwatch.record.{m}" for m in RECORD_WITHOUT_TENSORFLOW]
    return names + ["tb_nanwatch.cli"]


def test_the_modules_without_tensorflow_import_none_at_run_time():
    modules = _without_tensorflow_modules()
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {TENSORFLOW!r})\n"
        "assert not bad, bad[:5]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
