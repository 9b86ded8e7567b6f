"""Which replica went non-finite first (evidence/replica_origin.py), without TensorFlow."""

from __future__ import annotations

from test_causes import make_schema

from tb_nanwatch.evidence.replica_origin import replica_origin

SCHEMA = make_schema(layers=["a", "b"])
ENTRIES = [e for e in SCHEMA.entries if e.kind != "header"]
NONE = len(ENTRIES)  # a replica where nothing went non-finite


def _position(layer: str, kind: str) -> int:
    return next(i for i, e in enumerate(ENTRIES) if e.layer == layer and e.kind == kind)


def test_one_replica_or_nothing_non_finite_names_no_replica():
    assert replica_origin(SCHEMA, [_position("a", "activation")]) is None
    assert replica_origin(SCHEMA, [NONE, NONE, NONE]) is None


def test_the_replica_whose_entry_came_first_in_the_step_is_the_origin():
    forward_b, backward_a = _position("b", "activation"), _position("a", "grad_out")
    view = replica_origin(SCHEMA, [backward_a, forward_b, NONE, forward_b])
    assert view["replica"] == 1 and view["replicas_at_origin"] == [1, 3]
    assert view["num_replicas"] == 4
    seen = view["replica_first_nonfinite"]
    assert seen[2] is None
    assert (seen[0]["phase"], seen[0]["layer"]) == ("backward", "a")
    assert (seen[1]["phase"], seen[1]["layer"]) == ("forward", "b")
    assert "worker" not in view


def test_in_a_cluster_the_worker_of_the_origin_replica_is_named():
    forward_a = _position("a", "activation")
    tasks = ["chief_0", "worker_0"]  # two replicas each, in global replica order
    view = replica_origin(SCHEMA, [NONE, NONE, forward_a, NONE], tasks)
    assert view["replica"] == 2 and view["worker"] == "worker_0"
    view = replica_origin(SCHEMA, [NONE, forward_a, NONE, NONE], tasks)
    assert view["worker"] == "chief_0"
