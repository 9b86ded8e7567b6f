"""The heatmap has input rows, and no gradient reads as null, never as a
dead (zero) gradient (issue 15, item 4)."""

from __future__ import annotations

import math

import numpy as np
from nanwatch_testlib import base_vector

from tb_nanwatch.board import views
from tb_nanwatch.evidence.recorded import Flight
from tb_nanwatch.record.synthetic import build_schema


def _flight_with_input_nan(bad_step: int) -> tuple[Flight, str]:
    schema = build_schema(3, num_inputs=2)
    matrix = np.stack([base_vector(schema, step) for step in range(4)])
    target = schema.find(kind="input")[1]
    matrix[bad_step, target.index("nan")] = 1
    matrix[bad_step, target.index("min")] = math.nan
    return Flight(0, matrix, schema), target.layer


def test_inputs_and_targets_are_the_first_rows_with_null_gradients():
    flight, bad_input = _flight_with_input_nan(2)
    body = views.heatmap(flight, {"step": 2, "layer": bad_input, "phase": "input"})
    assert body["input_rows"] == 2
    assert body["layers"][:2] == ["input_0", "input_1"]
    for row in range(body["input_rows"]):
        assert body["grad_norm"][row] == [None] * 4  # no gradient, not a dead one
        assert all(v is not None for v in body["forward_max_abs"][row])
    origin_row = body["layers"].index(body["origin"]["layer"])
    assert body["nonfinite"][origin_row] == [0, 0, 1, 0]
    assert math.isnan(body["forward_max_abs"][origin_row][2])


def test_layer_rows_keep_their_recorded_gradient_norms():
    flight, _ = _flight_with_input_nan(1)
    body = views.heatmap(flight, None)
    layer_rows = body["grad_norm"][body["input_rows"] :]
    assert layer_rows and all(v == 0.5 for row in layer_rows for v in row)
