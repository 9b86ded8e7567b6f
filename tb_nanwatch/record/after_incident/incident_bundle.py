"""The incident's reproduction bundle, gathered from the device record.

The compiled step kept the batch of the non-finite step and the weights (and
the optimizer's state) from just before it; this reads them from the device
record once, at the incident, and writes them as a bundle
(:func:`~tb_nanwatch.record.after_incident.bundle.save_bundle`). The bundle is
*exact* when its batch and weights are those of the incident's step.
"""

from __future__ import annotations

from tb_nanwatch.record.after_incident import bundle
from tb_nanwatch.record.in_step.recorder import StepRecorder
from tb_nanwatch.record.in_step.taps import variable_path


def save_incident_bundle(
    log_dir: str,
    incident: dict,
    recorder: StepRecorder,
    pre_step_weights: str,
    worker: str | None = None,
) -> tuple[str, bool]:
    """Writes the bundle of ``incident`` under ``log_dir``; returns its path
    relative to ``log_dir`` and whether it is exact. ``pre_step_weights``:
    the option (``"on_suspect"`` keeps no weights for an update-phase
    incident); ``worker``: this process's task in a cluster."""
    device = recorder.device
    weights, batch, structure = device.pre_step_state()
    optimizer = device.pre_step_optimizer()
    batch_step, weights_step = device.stashed_steps()
    names = [variable_path(v) for v in recorder.watched_weights]
    if not weights:
        weights_step = None
    if pre_step_weights == "on_suspect" and incident["phase"] == "update":
        weights, weights_step = [], None
    if weights_step is None:
        optimizer = {}
    exact = batch_step == incident["step"] and (
        weights_step is None or weights_step == incident["step"]
    )
    info = {
        "weights_before_step": weights_step,  # the bundle layout's key
        "batch_of_step": batch_step,
        "exact": exact,
        "pre_step_weights": pre_step_weights,
        "incident": incident,
        "optimizer": optimizer,  # save_bundle writes it as arrays, not into bundle.json
    }
    strategy = recorder.strategy
    if strategy.num_replicas_in_sync > 1:
        info["batch_shards"] = (
            f"the shards of this process's replicas, concatenated "
            f"({len(strategy.extended.worker_devices)} replica(s))"
        )
    if worker is not None:
        info["worker"] = worker
    if device.batch_not_kept_why is not None:
        info["batch_incomplete"] = device.batch_not_kept_why
    weights_by_name = dict(zip(names, weights, strict=False))
    relative = bundle.save_bundle(
        log_dir, incident["step"], weights_by_name, batch, structure, info
    )
    return relative, exact
