"""Writes synthetic NaN Watch runs, without TensorFlow, for benchmarks and tests.

The run goes through the real :class:`~tb_nanwatch.journal.RunJournal`, so its
files are exactly what a watched training run writes.
"""

from __future__ import annotations

import numpy as np

from tb_nanwatch.journal import JournalSettings, RunJournal
from tb_nanwatch.schema import Schema


def build_schema(num_layers: int, num_inputs: int = 1) -> Schema:
    """A schema for a chain of ``num_layers`` dense layers named by path."""
    schema = Schema()
    schema.add("header", "header", None, "step header")
    names = [f"model/block{i // 4}/layer{i}" for i in range(num_layers)]
    for i in range(num_inputs):
        schema.add("input", "input", f"input_{i}", f"model input input_{i}")
    for name in names:
        schema.add("forward", "activation", name, f"output of {name}")
    schema.add("forward", "logits", names[-1], f"logits of {names[-1]}")
    schema.add("loss", "loss", None, "total loss")
    schema.add("loss", "loss", names[-1], f"loss of output {names[-1]}")
    for name in reversed(names):
        schema.add("backward", "grad_out", name, f"gradient w.r.t. output of {name}")
        schema.add("backward", "grad_var", name, f"gradient of {name}/kernel")
        schema.add("backward", "grad_in", name, f"gradient w.r.t. input of {name}")
    for name in names:
        schema.add("update", "weights", name, f"{name}/kernel after update")
    return schema


def write_synthetic_run(
    log_dir: str,
    steps: int,
    num_layers: int = 10,
    incident_step: int | None = None,
    incident_layer: int = 0,
    seed: int = 0,
    snapshot_every: int = 1000,
) -> dict:
    """Writes a run of ``steps`` steps; a forward NaN at ``incident_step``.

    Returns the journal summary. Training stops at the incident, like
    ``on_nonfinite="stop"``.
    """
    rng = np.random.default_rng(seed)
    schema = build_schema(num_layers)
    layer_names = [e.layer for e in schema.find(kind="activation")]
    journal = RunJournal(
        log_dir,
        schema,
        {"model": "synthetic", "layers": layer_names, "framework": "synthetic"},
        JournalSettings(snapshot_every=snapshot_every, flush_secs=1e9),
    )
    header = schema.header().offset
    activations = schema.find(kind="activation")
    status = "finished"
    # Vectorized, draw for draw the same values as a loop over the entries
    # (one uniform draw per min/max entry and per norm/value entry, in entry
    # order, then the loss and the gradient norm): fast enough for the
    # 100,000-step, 200-layer benchmark run.
    drawn = [
        (e.offset, e.kind in ("activation", "input", "logits"))
        for e in schema.entries
        if e.kind in ("activation", "input", "logits", "grad_out", "grad_var", "grad_in", "loss")
    ]
    spread_draw = np.array([i for i, (_, spread) in enumerate(drawn) if spread], np.intp)
    spread_at = np.array([o + 2 for o, spread in drawn if spread], np.intp)
    norm_draw = np.array([i for i, (_, spread) in enumerate(drawn) if not spread], np.intp)
    norm_at = np.array([o + 2 for o, spread in drawn if not spread], np.intp)
    for step in range(steps):
        vector = np.zeros(schema.size, np.float32)
        draws = rng.random(len(drawn) + 2)
        spread = 1.0 + draws[spread_draw]
        vector[spread_at] = -spread
        vector[spread_at + 1] = spread
        vector[norm_at] = 0.1 + 0.01 * draws[norm_draw]
        loss = 2.0 * np.exp(-step / max(steps, 1)) + 0.05 * draws[-2]
        vector[header : header + 6] = (loss, 1.0 + draws[-1], 1e-3, 0.0, 0.0, step)
        if step == incident_step:
            entry = activations[incident_layer]
            vector[entry.offset] = 3.0
            vector[entry.offset + 2 : entry.offset + 4] = np.nan
            vector[header] = np.nan
        incident = journal.record(step, step // 1000, step % 1000, vector)
        if incident is not None:
            status = "stopped"
            break
    journal.close(status)
    return journal.summary()
