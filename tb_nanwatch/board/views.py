"""Builds the JSON bodies of the plugin routes from parsed run data.

Pure functions over :mod:`tb_nanwatch.board.reader` objects, see ``docs/reference/routes.md``.
Values are plain Python (``.tolist()``/``float()``), so TensorBoard's
``Respond`` turns NaN/Inf into ``"NaN"``/``"Infinity"`` strings.
"""

from __future__ import annotations

import dataclasses
import math
import posixpath

import numpy as np

from tb_nanwatch.board.reader import Run
from tb_nanwatch.evidence import diagnosis, recoveries
from tb_nanwatch.evidence.causes.case import output_word
from tb_nanwatch.evidence.recorded import Flight, Series
from tb_nanwatch.evidence.schema import Entry, Schema
from tb_nanwatch.evidence.warning_record import warnings_of

# Columns whose most extreme value is the smallest one.
MIN_COLUMNS = frozenset({"logit_min"})

STEP_ROW_FIELDS = ("nan", "inf", "min", "max", "max_abs", "norm", "value")

# Heatmap columns (steps) at most: a huge ``window`` must not make the
# ``incident`` answer grow with it. The steps kept are those around the incident.
HEATMAP_MAX_STEPS = 256


def _py(value: float) -> float:
    return float(value)


def count_value(value: float) -> int | float:
    """An element count as an int, or the float itself when it is not one."""
    value = float(value)
    if math.isfinite(value) and value == int(value):
        return int(value)
    return value


def max_abs(low: float, high: float) -> float:
    """max(|low|, |high|), NaN if either is NaN."""
    if math.isnan(low) or math.isnan(high):
        return math.nan
    return max(abs(low), abs(high))


def run_entry(run: Run, cause: dict | None = None) -> dict:
    """One element of the ``runs`` route; ``cause`` from :mod:`tb_nanwatch.evidence.causes`."""
    summary = run.summary
    return {
        "run": run.name,
        "steps": int(summary["steps"]),
        "status": str(summary.get("status", "running")),
        "first_nonfinite": summary.get("first_nonfinite"),
        "explosion": summary.get("explosion"),
        "skipped_count": run.skipped_count(),
        "cause": {"id": cause["id"], "summary": cause["summary"]} if cause else None,
        "warning_count": len(warnings_of(summary)),
    }


def bundle_entry(run: Run) -> dict | None:
    """The ``bundle`` of the ``incident`` route: where the reproduction bundle
    is (relative to the run dir), whether it holds exactly the incident step
    (None: not recorded) and the lines of Python that load and replay it (a
    Keras model's ``train_on_batch``; a TF1 graph's ``feed_dict``)."""
    path = run.summary.get("repro_bundle")
    if not isinstance(path, str) or not path:
        return None
    exact = run.summary.get("repro_bundle_exact")
    location = posixpath.normpath(posixpath.join(run.name.replace("\\", "/"), path))
    load = f"bundle = tb_nanwatch.load_bundle({location!r})  # relative to the log dir\n"
    if run.summary.get("loop") == "graph":  # a TF1 graph: no Keras model, a feed_dict
        snippet = load + (
            "feed = {graph.get_tensor_by_name(f'{name}:0'): x for name, x in bundle.x.items()}\n"
            "sess.run(train_op, feed_dict=feed)  # the weights before it: bundle.weights"
        )
    else:
        snippet = load + "bundle.restore(model); model.train_on_batch(*bundle.batch)"
    return {"path": path, "exact": exact if isinstance(exact, bool) else None, "snippet": snippet}


def reduce_column(values: np.ndarray, starts: np.ndarray, use_min: bool) -> np.ndarray:
    """Most extreme value per bucket; any non-finite value wins over finite ones.

    ``starts`` are the row indices where buckets begin (sorted, first is 0).
    Precedence within a bucket: NaN, then the infinity on the extreme side,
    then the other infinity, then the finite extreme.
    """
    values = values.astype(np.float64, copy=False)
    has_nan = np.logical_or.reduceat(np.isnan(values), starts)
    has_pos = np.logical_or.reduceat(values == np.inf, starts)
    has_neg = np.logical_or.reduceat(values == -np.inf, starts)
    finite = np.isfinite(values)
    if use_min:
        extreme = np.minimum.reduceat(np.where(finite, values, np.inf), starts)
        first_inf, second_inf = (has_neg, -np.inf), (has_pos, np.inf)
    else:
        extreme = np.maximum.reduceat(np.where(finite, values, -np.inf), starts)
        first_inf, second_inf = (has_pos, np.inf), (has_neg, -np.inf)
    return np.select(
        [has_nan, first_inf[0], second_inf[0]],
        [np.nan, first_inf[1], second_inf[1]],
        default=extreme,
    )


def timeline(
    run: Run,
    series: Series,
    start: int | None,
    end: int | None,
    max_points: int,
    recorded_steps: list[int],
) -> dict:
    """The ``timeline`` route: steps ``[start, end)`` reduced to buckets."""
    summary = run.summary
    last = int(series.steps[-1]) + 1 if len(series) else 0
    start = (int(series.steps[0]) if len(series) else 0) if start is None else start
    end = max(last, int(summary["steps"])) if end is None else end
    end = max(end, start)
    bucket = max(1, -(-(end - start) // max_points))
    lo, hi = np.searchsorted(series.steps, [start, end])
    steps = series.steps[lo:hi]
    columns: dict[str, list] = {}
    out_steps: list[int] = []
    if len(steps):
        bucket_index = (steps - start) // bucket
        starts = np.flatnonzero(np.r_[True, bucket_index[1:] != bucket_index[:-1]])
        out_steps = (start + bucket_index[starts] * bucket).tolist()
        for name, values in series.columns.items():
            reduced = reduce_column(values[lo:hi], starts, name in MIN_COLUMNS)
            columns[name] = reduced.tolist()
    else:
        columns = {name: [] for name in series.columns}
    return {
        "run": run.name,
        "start": int(start),
        "end": int(end),
        "bucket": int(bucket),
        "steps": out_steps,
        "columns": columns,
        "total_steps": int(summary["steps"]),
        "first_nonfinite": summary.get("first_nonfinite"),
        "explosion": summary.get("explosion"),
        "skipped_ranges": run.skipped_ranges(),
        "recorded_steps": recorded_steps,
        "output_word": output_word(summary, run.schema),
        "recoveries": [
            {**r, "label": recoveries.marker_label(r)} for r in recoveries.recoveries(summary)
        ],
        "warnings": warnings_of(summary),
    }


def step_rows(schema: Schema, vector: np.ndarray) -> list[dict]:
    """The per-layer table of one step, in diagnosis order (header left out).

    A row's ``nan``/``inf`` counts are exactly what the diagnosis reads
    (``diagnosis.is_nonfinite``): the frontend marks a row non-finite when
    one of them is non-zero.
    """
    rows = []
    for entry in schema.diagnosed():
        values = schema.values(vector, entry)
        row: dict = {
            "phase": entry.phase,
            "kind": entry.kind,
            "layer": entry.layer,
            "tensor": entry.tensor,
        }
        for name in STEP_ROW_FIELDS:
            row[name] = None
        for name, value in values.items():
            row[name] = count_value(value) if name in ("nan", "inf") else _py(value)
        if "min" in values and "max" in values:
            row["max_abs"] = max_abs(values["min"], values["max"])
        rows.append(row)
    return rows


def heatmap_inputs(schema: Schema) -> list[str]:
    """The model's inputs and targets, by name: the heatmap's first rows."""
    return list(dict.fromkeys(e.layer for e in schema.entries if e.phase == "input" and e.layer))


def heatmap_layers(schema: Schema) -> list[str]:
    """Rows in diagnosis order: inputs and targets, forward activations, then
    the layers seen only in the backward pass or the update."""
    forward = [
        e.layer
        for e in schema.entries
        if e.phase == "forward" and e.kind == "activation" and e.layer
    ]
    rest = [e.layer for e in schema.entries if e.phase in ("backward", "update") and e.layer]
    return list(dict.fromkeys(heatmap_inputs(schema) + forward + rest))


@dataclasses.dataclass
class _LayerEntries:
    """The entries of one heatmap row (one layer)."""

    activations: list[Entry] = dataclasses.field(default_factory=list)
    computed_grads: list[Entry] = dataclasses.field(default_factory=list)
    owned: list[Entry] = dataclasses.field(default_factory=list)

    def cells(self, schema: Schema, vector: np.ndarray) -> tuple[float | None, float | None, int]:
        """(forward max |x|, gradient norm, non-finite 0|1) of one step."""
        forward = None
        if self.activations:
            forward = max(
                (max_abs(*_min_max(schema, vector, e)) for e in self.activations),
                key=lambda v: math.inf if math.isnan(v) else v,
            )
        grad = self.gradient_norm(schema, vector) if self.computed_grads else None
        nonfinite = any(diagnosis.entry_nonfinite(vector, e) for e in self.owned)
        return forward, grad, 1 if nonfinite else 0

    def gradient_norm(self, schema: Schema, vector: np.ndarray) -> float:
        """The norm of what the layer's backward pass computed: the gradients
        w.r.t. its input and its weights, as one vector. NaN when one has a
        NaN, so the row of a backward origin is the one its NaN is seen in
        (the gradient w.r.t. a layer's output is the next layer's doing)."""
        norms = []
        for entry in self.computed_grads:
            values = schema.values(vector, entry)
            if values["nan"] or math.isnan(values["norm"]):
                return math.nan
            norms.append(float(values["norm"]))
        return _py(math.hypot(*norms))


def _layer_entries(schema: Schema, layers: list[str]) -> dict[str, _LayerEntries]:
    by_layer = {name: _LayerEntries() for name in layers}
    for entry in schema.diagnosed():
        if entry.layer not in by_layer:
            continue
        if entry.kind == "logits":
            continue  # named by model output, not by layer path
        row = by_layer[entry.layer]
        row.owned.append(entry)
        if entry.kind in ("activation", "input"):  # an input has no gradient: null
            row.activations.append(entry)
        elif entry.kind in ("grad_in", "grad_var"):
            row.computed_grads.append(entry)
    return by_layer


def heatmap_steps(flight: Flight, incident: dict | None) -> slice:
    """The flight rows the heatmap shows: all, or the ``HEATMAP_MAX_STEPS``
    consecutive ones centred on the incident (the last ones without one)."""
    count = flight.matrix.shape[0]
    if count <= HEATMAP_MAX_STEPS:
        return slice(0, count)
    center = count - 1
    if incident and flight.vector(int(incident["step"])) is not None:
        center = int(incident["step"]) - flight.first_step
    start = min(max(0, center - HEATMAP_MAX_STEPS // 2), count - HEATMAP_MAX_STEPS)
    return slice(start, start + HEATMAP_MAX_STEPS)


def heatmap(flight: Flight, incident: dict | None) -> dict:
    """Per-layer, per-step view of the flight-recorder window.

    A cell is non-finite exactly when one of the layer's entries is
    (``diagnosis.entry_nonfinite``), the rule that finds the incident.
    """
    schema = flight.schema
    layers = heatmap_layers(schema)
    by_layer = _layer_entries(schema, layers)
    shown = heatmap_steps(flight, incident)
    forward_max_abs, grad_norm, nonfinite = [], [], []
    for name in layers:
        cells = [by_layer[name].cells(schema, vector) for vector in flight.matrix[shown]]
        forward_max_abs.append([c[0] for c in cells])
        grad_norm.append([c[1] for c in cells])
        nonfinite.append([c[2] for c in cells])
    origin = None
    if incident:
        origin = {
            "layer": incident.get("layer"),
            "step": incident.get("step"),
            "phase": incident.get("phase"),
        }
    return {
        "steps": flight.steps[shown],
        "layers": layers,
        "input_rows": len(heatmap_inputs(schema)),
        "forward_max_abs": forward_max_abs,
        "grad_norm": grad_norm,
        "nonfinite": nonfinite,
        "origin": origin,
    }


def _min_max(schema: Schema, vector: np.ndarray, entry: Entry) -> tuple[float, float]:
    values = schema.values(vector, entry)
    return values["min"], values["max"]
