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

``record`` itself is in wings named for when their code runs:

* ``record/in_step``: inside the compiled step (taps, the recorder, the
  step's statistics and its device record);
* ``record/stats``: the statistics backends (graph, XLA) and their counts;
* ``record/writing``: writing the record (journal, event files, run dirs,
  crash safety), without TensorFlow;
* ``record/after_incident``: bundles, rewind points, replay, trials and
  recovery;
* the front ends and their session (``callback``, ``custom_loop``,
  ``session`` with ``run_info``, ``summary``) at the top of ``record/``, free
  to use every wing.

A wing imports only the wings listed for it in :data:`WING_MAY_IMPORT`.

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

# The wings of record/ and the other wings each may import (its own always).
WINGS = ("in_step", "stats", "writing", "after_incident")
WING_MAY_IMPORT = {
    "writing": (),
    "stats": (),
    "in_step": ("stats", "writing"),
    "after_incident": ("in_step", "stats", "writing"),
}
FRONT_ENDS = ("callback", "custom_loop", "session", "run_info", "summary")
# Wings that write or judge a run without running a model: no TensorFlow import
# in them, anywhere (synthetic runs for the tests and benchmarks, the writer).
WINGS_WITHOUT_TENSORFLOW = ("writing",)


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


def _dotted(path: Path) -> str:
    dotted = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
    return "tb_nanwatch." + dotted.removesuffix(".__init__")


def _imports_of(path: Path) -> set[str]:
    return imported_names(
        path.read_text(encoding="utf-8"),
        _dotted(path).rsplit(".", 1)[0] if path.name != "__init__.py" else _dotted(path),
    )


def test_record_has_its_wings_and_only_front_ends_at_its_top():
    record = PACKAGE / "record"
    folders = sorted(p.name for p in record.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert folders == sorted(WINGS)
    top = sorted(p.stem for p in record.glob("*.py") if p.name != "__init__.py")
    assert top == sorted(FRONT_ENDS)


@pytest.mark.parametrize("wing", WINGS)
def test_each_wing_of_record_imports_only_the_wings_it_may(wing):
    allowed = {wing, *WING_MAY_IMPORT[wing]}
    forbidden = tuple(f"tb_nanwatch.record.{w}" for w in WINGS if w not in allowed)
    forbidden += tuple(f"tb_nanwatch.record.{m}" for m in FRONT_ENDS)
    if wing in WINGS_WITHOUT_TENSORFLOW:
        forbidden += TENSORFLOW
    broken = []
    for path in sorted((PACKAGE / "record" / wing).rglob("*.py")):
        for name in _imports_of(path):
            if _breaks(name, forbidden):
                broken.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert broken == []


def _module_graph() -> dict[str, set[str]]:
    """Each module of the package and the modules of the package it imports
    (``from pkg import name`` counts as ``pkg.name`` where that is a module)."""
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_dotted(p) for p in paths}
    graph = {}
    for path in paths:
        edges = set()
        for name in _imports_of(path):
            if name in modules:
                edges.add(name)
            elif name.rsplit(".", 1)[0] in modules and name.startswith("tb_nanwatch"):
                edges.add(name.rsplit(".", 1)[0])
        graph[_dotted(path)] = edges - {_dotted(path)}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of ``graph`` (a list of modules), [] when there is none."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_the_cycle_finder_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_circle_inside_the_package():
    # Imports made from the package's own __init__ (the public API) are left
    # out: every module's import of a sibling runs it first, by Python's rule.
    graph = _module_graph()
    graph.pop("tb_nanwatch", None)
    assert _cycle(graph) == []


def _without_tensorflow_modules() -> list[str]:
    names = [_dotted(p) for part in ("evidence", "board") for p in _modules(part)]
    for wing in WINGS_WITHOUT_TENSORFLOW:
        names += [_dotted(p) for p in sorted((PACKAGE / "record" / wing).rglob("*.py"))]
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


def _own_attributes() -> dict[str, set[str]]:
    """Each module's attribute names that its own classes define: what
    ``self.<name> = ...`` sets in a method, and the annotated class fields
    (dataclasses)."""
    owned: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        names: set[str] = set()
        for cls in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(cls, ast.ClassDef):
                continue
            for node in ast.walk(cls):
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    names.add(node.target.id)
                target = node.target if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else None
                for t in [target] if target else getattr(node, "targets", []):
                    if (
                        isinstance(t, ast.Attribute)
                        and isinstance(t.value, ast.Name)
                        and t.value.id == "self"
                    ):
                        names.add(t.attr)
        owned[_dotted(path)] = names
    return owned


def attribute_sets_across_modules(source: str, module: str, owned: dict[str, set[str]]) -> list:
    """The ``x.name = ...`` (and ``setattr(x, "name", ...)``) of ``source``
    where ``x`` is not ``self``/``cls`` and ``name`` is an attribute that only
    another module's classes define: an object of another module's class
    changed from outside, a tie the reader cannot see."""
    mine = owned.get(module, set())
    theirs = set().union(*(names for m, names in owned.items() if m != module)) - mine
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for t in ast.walk(target):
                if not isinstance(t, ast.Attribute) or not isinstance(t.ctx, ast.Store):
                    continue
                if isinstance(t.value, ast.Name) and t.value.id in ("self", "cls"):
                    continue
                if t.attr in theirs:
                    found.append(f"{module}:{node.lineno}: {ast.unparse(t)} = ...")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "setattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in theirs
        ):
            found.append(f"{module}:{node.lineno}: setattr(..., {node.args[1].value!r})")
    return found


def test_the_attribute_checker_sees_a_set_across_modules():
    owned = {"a": {"rewind"}, "b": {"other"}}
    source = "def attach(recorder, ring):\n    recorder.rewind = ring\n    self.other = 1\n"
    assert attribute_sets_across_modules(source, "b", owned) == ["b:2: recorder.rewind = ..."]
    assert attribute_sets_across_modules(source, "a", owned) == []


def test_no_module_sets_attributes_on_an_object_of_another_modules_class():
    owned = _own_attributes()
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += attribute_sets_across_modules(
            path.read_text(encoding="utf-8"), _dotted(path), owned
        )
    assert found == []


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_functions() -> dict[str, set[str]]:
    """Each module's private names (``_name``, not dunders): its functions,
    its classes' methods, and its module-level classes and constants."""
    found: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        names = set()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef)):
                names.update(
                    f.name
                    for f in node.body
                    if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(f.name)
                )
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and _private(node.name):
                names.add(node.name)
            targets = node.targets if isinstance(node, ast.Assign) else []
            targets += [node.target] if isinstance(node, ast.AnnAssign) else []
            names.update(t.id for t in targets if isinstance(t, ast.Name) and _private(t.id))
        found[_dotted(path)] = names
    return found


def private_uses_across_modules(source: str, module: str, private: dict[str, set[str]]) -> list:
    """Where ``source`` reaches a private name of another module: an
    ``x._name`` (x not ``self``/``cls``) that only another module defines, or
    ``from m import _name``."""
    theirs = set().union(*(n for m, n in private.items() if m != module)) - private.get(
        module, set()
    )
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in theirs:
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tb_nanwatch"):
            found += [
                f"{module}:{node.lineno}: from {node.module} import {a.name}"
                for a in node.names
                if a.name.startswith("_") and not a.name.startswith("__")
            ]
    return found


def test_the_private_use_checker_sees_a_call_across_modules():
    private = {"a": {"_trial_data"}, "b": set()}
    source = "def f(session):\n    return session._trial_data()\n"
    assert private_uses_across_modules(source, "b", private) == ["b:2: session._trial_data"]
    assert private_uses_across_modules(source, "a", private) == []


def test_no_module_calls_a_private_function_of_another_module():
    private = _private_functions()
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += private_uses_across_modules(
            path.read_text(encoding="utf-8"), _dotted(path), private
        )
    assert found == []
