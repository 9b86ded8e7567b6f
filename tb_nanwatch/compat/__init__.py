"""NanWatch for code that is not TF2 Keras: ``tb_nanwatch.compat.v1`` (TF1
graph-mode code: placeholders, ``Session``, ``feed_dict``, a
``tf.compat.v1.train`` optimizer's ``minimize``, ``MonitoredTrainingSession``).

A front end like :mod:`tb_nanwatch.record`'s callback and custom-loop watcher:
the same statistics, run dir, record, tab, report, export and causes.
"""

from __future__ import annotations

import importlib

__all__ = ["v1"]


def __getattr__(name: str):
    """``tb_nanwatch.compat.v1``, imported (with TensorFlow) when first touched."""
    if name != "v1":
        raise AttributeError(f"module 'tb_nanwatch.compat' has no attribute {name!r}")
    return importlib.import_module("tb_nanwatch.compat.v1")
