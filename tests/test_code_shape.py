"""The package stays readable: no function over 60 lines or 6 parameters.

The rule covers every module of ``tb_nanwatch/``; the public constructors of
``NanWatch`` and ``StepWatcher`` are excepted (their signatures are the API).
``self``/``cls`` are not counted as parameters.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tb_nanwatch"
MAX_LINES = 60
MAX_PARAMETERS = 6
# The public constructors keep their documented signatures (one keyword per option).
PUBLIC_CONSTRUCTORS = {
    ("record/callback", "__init__"),
    ("record/custom_loop", "__init__"),
    ("compat/v1", "__init__"),
}
MODULES = sorted(
    path.relative_to(PACKAGE).with_suffix("").as_posix() for path in PACKAGE.rglob("*.py")
)


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    args = function.args
    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    names += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
    return [name for name in names if name not in ("self", "cls")]


def oversized_functions(source: str, exempt: frozenset[str] = frozenset()) -> list[str]:
    """``name: why`` for each function of ``source`` over the limits."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name in exempt:
            continue
        lines = node.end_lineno - node.lineno + 1
        parameters = len(_parameters(node))
        if lines > MAX_LINES or parameters > MAX_PARAMETERS:
            found.append(
                f"{node.name} (line {node.lineno}): {lines} lines, {parameters} parameters"
            )
    return found


def test_the_check_finds_a_long_function_and_a_wide_one():
    long_body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    source = f"def long():\n{long_body}\n\ndef wide(self, a, b, c, d, e, f, g):\n    pass\n"
    found = oversized_functions(source)
    assert [f.split(" ")[0] for f in found] == ["long", "wide"]


def test_every_module_is_checked():
    assert {"record/callback", "evidence/causes/__init__", "board/plugin", "cli"} <= set(MODULES)


@pytest.mark.parametrize("module", MODULES)
def test_functions_are_short_and_take_few_parameters(module):
    source = (PACKAGE / f"{module}.py").read_text(encoding="utf-8")
    exempt = frozenset(name for owner, name in PUBLIC_CONSTRUCTORS if owner == module)
    assert oversized_functions(source, exempt) == []
