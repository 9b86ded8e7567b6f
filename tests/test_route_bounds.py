"""The routes bound their answers (issue 17, item 7): a long run's timeline
at the largest ``max_points`` stays small, more is refused with 400, and the
incident's heatmap does not grow with the flight window."""

from __future__ import annotations

import numpy as np
import pytest
from nanwatch_testlib import PLUGIN, get_json, route_client

from tb_nanwatch.board import plugin, views
from tb_nanwatch.evidence.recorded import Flight
from tb_nanwatch.record.writing.synthetic import build_schema, write_synthetic_run

MAX_ANSWER_BYTES = 2_000_000
LONG_STEPS = 3 * plugin.MAX_MAX_POINTS + 5


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    root = tmp_path_factory.mktemp("long")
    write_synthetic_run(str(root / "long"), LONG_STEPS, num_layers=2, snapshot_every=10_000)
    return route_client(root)


def test_the_largest_timeline_answer_stays_small(client):
    response = client.get(f"{PLUGIN}/timeline?run=long&max_points={plugin.MAX_MAX_POINTS}")
    assert response.status_code == 200
    assert len(response.get_data()) <= MAX_ANSWER_BYTES
    body = get_json(client, f"{PLUGIN}/timeline?run=long&max_points={plugin.MAX_MAX_POINTS}")
    assert len(body["steps"]) <= plugin.MAX_MAX_POINTS
    assert body["bucket"] == 4  # ceil(LONG_STEPS / MAX_MAX_POINTS)
    assert body["total_steps"] == LONG_STEPS


def test_an_exact_window_of_the_largest_size(client):
    start = LONG_STEPS - plugin.MAX_MAX_POINTS
    body = get_json(
        client,
        f"{PLUGIN}/timeline?run=long&start={start}&end={LONG_STEPS}"
        f"&max_points={plugin.MAX_MAX_POINTS}",
    )
    assert body["bucket"] == 1
    assert body["steps"] == list(range(start, LONG_STEPS))


@pytest.mark.parametrize("asked", [plugin.MAX_MAX_POINTS + 1, 200_000])
def test_more_points_are_refused_naming_the_parameter(client, asked):
    body = get_json(client, f"{PLUGIN}/timeline?run=long&max_points={asked}", status=400)
    assert "max_points" in body["error"] and str(plugin.MAX_MAX_POINTS) in body["error"]


def _flight(steps: int, first_step: int = 0) -> Flight:
    schema = build_schema(3)
    return Flight(first_step, np.zeros((steps, schema.size), np.float32), schema)


def test_the_heatmap_shows_at_most_its_bound_around_the_incident():
    flight = _flight(5000, first_step=100)
    body = views.heatmap(flight, {"step": 2100, "layer": None, "phase": "forward"})
    assert len(body["steps"]) == views.HEATMAP_MAX_STEPS
    assert body["steps"] == list(range(body["steps"][0], body["steps"][0] + len(body["steps"])))
    middle = body["steps"][len(body["steps"]) // 2]
    assert middle == 2100
    assert all(len(row) == views.HEATMAP_MAX_STEPS for row in body["forward_max_abs"])


def test_the_heatmap_without_incident_shows_the_last_steps():
    body = views.heatmap(_flight(1000), None)
    assert body["steps"][-1] == 999 and len(body["steps"]) == views.HEATMAP_MAX_STEPS
    small = views.heatmap(_flight(20), None)
    assert small["steps"] == list(range(20))
