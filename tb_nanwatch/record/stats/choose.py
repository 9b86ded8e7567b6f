"""The choice of a statistics backend for the step being built.

Kept apart from :mod:`~tb_nanwatch.record.stats.backend`, which both backends
import, so that no module of ``stats/`` imports one that imports it back.
"""

from __future__ import annotations

from tb_nanwatch.record.stats.backend import DeviceFacts, StatsBackend, in_xla
from tb_nanwatch.record.stats.graph import GraphStats
from tb_nanwatch.record.stats.xla import XlaStats


def for_current_graph(facts: DeviceFacts | None = None) -> StatsBackend:
    """A fresh backend for the step being built: XLA's when XLA compiles it."""
    return XlaStats(facts) if in_xla() else GraphStats(facts)
