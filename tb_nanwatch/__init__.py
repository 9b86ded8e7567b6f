"""tb_nanwatch: find the step, phase and layer where NaN/Inf is born.

The recorder (``NanWatch``, ``StepWatcher``, ``summary``, ``load_bundle``) needs
TensorFlow and is imported lazily, so that the TensorBoard plugin and the CLI,
which live in this package too, never import TensorFlow.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "NanWatch": "tb_nanwatch.record.callback",
    "StepWatcher": "tb_nanwatch.record.custom_loop",
    "load_bundle": "tb_nanwatch.record.after_incident.bundle",
    "ReproBundle": "tb_nanwatch.record.after_incident.bundle",
    "summary": "tb_nanwatch.record.summary",
    "compat": "tb_nanwatch.compat",
}
_MODULES = frozenset({"summary", "compat"})

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'tb_nanwatch' has no attribute {name!r}")
    module = importlib.import_module(_LAZY[name])
    value = module if name in _MODULES else getattr(module, name)
    globals()[name] = value
    return value
