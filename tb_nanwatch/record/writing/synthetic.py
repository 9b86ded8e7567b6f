"""Writes synthetic NaN Watch runs, without TensorFlow, for benchmarks and tests.

The run goes through the real :class:`~tb_nanwatch.record.writing.journal.RunJournal`, so its
files are exactly what a watched training run writes.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tb_nanwatch.evidence.options import WatchOptions
from tb_nanwatch.evidence.schema import BEFORE_FINAL_ACTIVATION, Schema
from tb_nanwatch.record.writing.journal import RunJournal


def build_schema(num_layers: int, num_inputs: int = 1) -> Schema:
    """A schema for a chain of ``num_layers`` dense layers named by path."""
    schema = Schema()
    schema.add("header", "header", None, "step header")
    names = [f"model/block{i // 4}/layer{i}" for i in range(num_layers)]
    for i in range(num_inputs):
        schema.add("input", "input", f"input_{i}", f"model input input_{i}")
    for name in names:
        schema.add("forward", "activation", name, f"output of {name}")
    logits = f"logits of model output {names[-1]} {BEFORE_FINAL_ACTIVATION}"
    schema.add("forward", "logits", names[-1], logits)
    schema.add("loss", "loss", None, "total loss")
    schema.add("loss", "loss", names[-1], f"loss of output {names[-1]}")
    for name in reversed(names):
        schema.add("backward", "grad_out", name, f"gradient w.r.t. output of {name}")
        schema.add("backward", "grad_var", name, f"gradient of {name}/kernel")
        schema.add("backward", "grad_in", name, f"gradient w.r.t. input of {name}")
    for name in names:
        schema.add("update", "weights", name, f"{name}/kernel after update")
    return schema


@dataclasses.dataclass(frozen=True)
class SyntheticRun:
    """A synthetic run: ``steps`` steps of a chain of ``num_layers`` dense
    layers, with a forward NaN in layer ``incident_layer`` at ``incident_step``
    (None: a healthy run)."""

    steps: int
    num_layers: int = 10
    incident_step: int | None = None
    incident_layer: int = 0
    seed: int = 0
    snapshot_every: int = WatchOptions.snapshot_every

    def write(self, log_dir: str) -> dict:
        """Writes the run through a real journal; returns its summary.

        Training stops at the incident, like ``on_nonfinite="stop"``.
        """
        schema = build_schema(self.num_layers)
        layer_names = [e.layer for e in schema.find(kind="activation")]
        journal = RunJournal(
            log_dir,
            schema,
            {"model": "synthetic", "layers": layer_names, "framework": "synthetic"},
            WatchOptions(snapshot_every=self.snapshot_every, flush_secs=1e9),
        )
        vectors = _Vectors(schema, self.steps, np.random.default_rng(self.seed))
        status = "finished"
        for step in range(self.steps):
            vector = vectors.healthy(step)
            if step == self.incident_step:
                vectors.break_activation(vector, self.incident_layer)
            if journal.record(step, step // 1000, step % 1000, vector) is not None:
                status = "stopped"
                break
        journal.close(status)
        return journal.summary()


def write_synthetic_run(log_dir: str, steps: int, **options) -> dict:
    """Writes ``SyntheticRun(steps, **options)`` to ``log_dir``; its summary."""
    return SyntheticRun(steps, **options).write(log_dir)


class _Vectors:
    """Draws the per-step vectors of a synthetic run.

    Vectorized, draw for draw the same values as a loop over the entries (one
    uniform draw per min/max entry and per norm/value entry, in entry order,
    then the loss and the gradient norm): fast enough for the 100,000-step,
    200-layer benchmark run.
    """

    SPREAD_KINDS = ("activation", "input", "logits")
    SCALAR_FIELD = {"grad_out": "norm", "grad_var": "norm", "grad_in": "norm", "loss": "value"}

    def __init__(self, schema: Schema, steps: int, rng: np.random.Generator) -> None:
        self.schema = schema
        self.steps = steps
        self.rng = rng
        drawn = [
            e for e in schema.entries if e.kind in self.SPREAD_KINDS + tuple(self.SCALAR_FIELD)
        ]
        spread = [i for i, e in enumerate(drawn) if e.kind in self.SPREAD_KINDS]
        scalar = [i for i, e in enumerate(drawn) if e.kind not in self.SPREAD_KINDS]
        self.draws = len(drawn)
        self.spread_draw = np.array(spread, np.intp)
        self.min_at = np.array(schema.indices([drawn[i] for i in spread], "min"), np.intp)
        self.max_at = np.array(schema.indices([drawn[i] for i in spread], "max"), np.intp)
        self.scalar_draw = np.array(scalar, np.intp)
        self.scalar_at = np.array(
            [drawn[i].index(self.SCALAR_FIELD[drawn[i].kind]) for i in scalar], np.intp
        )
        header = ("loss", "grad_norm", "lr", "loss_scale", "skipped", "iterations")
        self.header_at = np.array([schema.header_index(f) for f in header], np.intp)

    def healthy(self, step: int) -> np.ndarray:
        vector = np.zeros(self.schema.size, np.float32)
        draws = self.rng.random(self.draws + 2)
        spread = 1.0 + draws[self.spread_draw]
        vector[self.min_at] = -spread
        vector[self.max_at] = spread
        vector[self.scalar_at] = 0.1 + 0.01 * draws[self.scalar_draw]
        loss = 2.0 * np.exp(-step / max(self.steps, 1)) + 0.05 * draws[-2]
        vector[self.header_at] = (loss, 1.0 + draws[-1], 1e-3, 0.0, 0.0, step)
        return vector

    def break_activation(self, vector: np.ndarray, layer: int) -> None:
        """Three NaN elements in the output of activation ``layer``, and a NaN loss."""
        entry = self.schema.find(kind="activation")[layer]
        vector[entry.index("nan")] = 3.0
        vector[[entry.index("min"), entry.index("max")]] = np.nan
        vector[self.schema.header_index("loss")] = np.nan
