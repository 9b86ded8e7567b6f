"""The heatmap has input rows, and no gradient reads as null, never as a
dead (zero) gradient; a layer's gradient cell is what its backward pass
computed, so the origin of a backward NaN is the row the NaN is seen in."""

from __future__ import annotations

import math

import numpy as np
from nanwatch_testlib import base_vector

from tb_nanwatch.board import views
from tb_nanwatch.evidence import diagnosis
from tb_nanwatch.evidence.recorded import Flight
from tb_nanwatch.record.writing.synthetic import build_schema


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


def test_layer_rows_show_the_norm_of_what_their_backward_pass_computed():
    flight, _ = _flight_with_input_nan(1)
    schema = flight.schema
    # Each layer's own gradients: w.r.t. its input and its kernel, as one vector.
    edit = {"grad_in": 3.0, "grad_var": 4.0, "grad_out": 100.0}
    for entry in schema.entries:
        if entry.kind in edit:
            flight.matrix[:, entry.index("norm")] = edit[entry.kind]
    body = views.heatmap(flight, None)
    layer_rows = body["grad_norm"][body["input_rows"] :]
    assert layer_rows and all(v == 5.0 for row in layer_rows for v in row)


def test_a_backward_origin_is_the_row_its_nan_is_seen_in():
    """The NaN the middle layer's backward pass made is its gradient w.r.t.
    its input (also the gradient w.r.t. the first layer's output): the NaN
    cell is on the origin's row, the layer after it stays finite."""
    schema = build_schema(3)
    layers = [e.layer for e in schema.find(kind="activation")]
    matrix = np.stack([base_vector(schema, step) for step in range(4)])
    bad = 3

    def poison(kind: str, layer: str) -> None:
        entry = next(e for e in schema.find(kind=kind) if e.layer == layer)
        matrix[bad, entry.index("nan")] = 4
        matrix[bad, entry.index("norm")] = math.nan

    poison("grad_in", layers[1])
    poison("grad_out", layers[0])
    poison("grad_var", layers[0])
    flight = Flight(0, matrix, schema)
    origin = diagnosis.find_origin(schema, matrix[bad])
    assert origin["layer"] == layers[1] and origin["phase"] == "backward"
    body = views.heatmap(flight, {"step": bad, **origin})
    rows = {name: body["layers"].index(name) for name in layers}
    column = body["steps"].index(bad)
    assert math.isnan(body["grad_norm"][rows[layers[1]]][column])  # the origin's cell
    assert math.isfinite(body["grad_norm"][rows[layers[2]]][column])  # before it, backward
    assert math.isnan(body["grad_norm"][rows[layers[0]]][column])  # after it: it spread
    assert all(math.isfinite(v) for v in body["grad_norm"][rows[layers[1]]][:column])
