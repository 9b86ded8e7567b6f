"""Eight replicas (MirroredStrategy over 8 logical CPU devices, the layout of
a TPU v3-8): ``fit`` and a custom loop, healthy and with one bad shard. The
incident names the replica whose shard went non-finite first."""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "eight_replicas_worker.py")
sys.path.insert(0, HERE)

from eight_replicas_worker import REPLICAS, STEPS, ZERO_ROW, ZERO_STEP  # noqa: E402
from nanwatch_testlib import run_worker  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("eight")
    result = out / "result.json"
    return run_worker([WORKER, str(result), str(out / "logs")], result, timeout=600)


@pytest.mark.parametrize("front_end", ["fit", "loop"])
def test_healthy_eight_replica_runs_stay_healthy(runs, front_end):
    assert runs["num_replicas"] == REPLICAS
    healthy = runs[f"{front_end}_healthy"]
    assert healthy["incident"] is None and healthy["steps"] == STEPS


@pytest.mark.parametrize("front_end", ["fit", "loop"])
def test_the_incident_names_the_replica_whose_shard_went_non_finite_first(runs, front_end):
    incident = runs[f"{front_end}_bad"]["incident"]
    assert (incident["step"], incident["phase"], incident["layer"]) == (
        ZERO_STEP,
        "forward",
        "ratio",
    )
    assert incident["num_replicas"] == REPLICAS
    assert incident["replica"] == ZERO_ROW and incident["replicas_at_origin"] == [ZERO_ROW]
    first = incident["replica_first_nonfinite"]
    assert first[ZERO_ROW]["phase"] == "forward" and first[ZERO_ROW]["layer"] == "ratio"
    # Every other shard was finite up to the update (the summed gradients reach every replica).
    for replica, seen in enumerate(first):
        if replica != ZERO_ROW:
            assert seen is None or seen["phase"] in ("backward", "update"), (replica, seen)
