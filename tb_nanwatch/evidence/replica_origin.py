"""Which replica went non-finite first, under a distribution strategy.

The compiled step records, for each replica, the position (in the schema's
order: input, forward, loss, backward, update) of the first entry that went
non-finite on it (at least the number of entries: none did). The incident
names the replica (and, in a cluster, the worker) where the earliest entry
went first, and what each replica saw first.
"""

from __future__ import annotations

from collections.abc import Sequence

from tb_nanwatch.evidence.schema import Schema


def replica_origin(
    schema: Schema, first_nonfinite: Sequence[float], tasks: list[str] | None = None
) -> dict | None:
    """The incident's ``replica`` fields from each replica's first non-finite
    position ``first_nonfinite``; None with one replica or when none went
    non-finite. ``tasks``: a cluster's tasks in global replica order
    (``"chief_0"``, ``"worker_0"``, ...), which names the worker too."""
    if len(first_nonfinite) <= 1:
        return None
    entries = [e for e in schema.entries if e.kind != "header"]
    ordinals = [round(float(v)) for v in first_nonfinite]
    origin = min(ordinals)
    if origin >= len(entries):
        return None
    at_origin = [r for r, o in enumerate(ordinals) if o == origin]
    view = {
        "replica": at_origin[0],
        "replicas_at_origin": at_origin,
        "num_replicas": len(ordinals),
        "replica_first_nonfinite": [
            None
            if o >= len(entries)
            else {"phase": entries[o].phase, "layer": entries[o].layer, "tensor": entries[o].tensor}
            for o in ordinals
        ],
    }
    if tasks:
        per_worker = max(len(ordinals) // len(tasks), 1)
        view["worker"] = tasks[min(at_origin[0] // per_worker, len(tasks) - 1)]
    return view
