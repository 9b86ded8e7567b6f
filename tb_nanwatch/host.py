"""The host side shared by :class:`~tb_nanwatch.callback.NanWatch` (``fit``)
and :class:`~tb_nanwatch.custom_loop.StepWatcher` (custom training loops).

:class:`WatchHost` fetches the rows the compiled step wrote (one transfer per
execution), feeds them to a :class:`~tb_nanwatch.journal.RunJournal` step by
step, adds the per-replica view to an incident, and saves the reproduction
bundle. Both front ends stop, raise or continue on their own terms.

Under ``MultiWorkerMirroredStrategy`` every worker keeps its own record: the
chief writes the run dir it was given, any other worker writes
``<log_dir>/<task_type>_<task_id>`` (so no two processes ever write the same
event file). The statistics are reduced across all replicas, so each record
holds the merged view; each worker's reproduction bundle holds *its own* data
shard, which is where a bad shard shows up.
"""

from __future__ import annotations

import dataclasses
import posixpath

import keras
import numpy as np
import tensorflow as tf

from tb_nanwatch import bundle
from tb_nanwatch.event_writer import RunWriter
from tb_nanwatch.journal import JournalSettings, RunJournal
from tb_nanwatch.recorder import PRE_STEP_WEIGHTS, StepRecorder

ON_NONFINITE = ("stop", "raise", "continue")


def _positive_int(name: str, value, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if allow_zero else 1):
        bound = ">= 0" if allow_zero else ">= 1"
        raise ValueError(f"{name} must be an int {bound}, got {value!r}")
    return value


@dataclasses.dataclass
class WatchOptions:
    """The options NanWatch and StepWatcher share (see NanWatch's docstring)."""

    on_nonfinite: str = "stop"
    window: int = 32
    max_consecutive_skips: int = 20
    min_loss_scale: float = 1.0
    snapshot_every: int = 1000
    flush_secs: float = 10.0
    pre_step_weights: str = "on_suspect"
    explosion_factor: float = 1e3

    def __post_init__(self) -> None:
        if self.on_nonfinite not in ON_NONFINITE:
            raise ValueError(
                f"on_nonfinite must be one of {ON_NONFINITE}, got {self.on_nonfinite!r}"
            )
        if self.pre_step_weights not in PRE_STEP_WEIGHTS:
            raise ValueError(
                f"pre_step_weights must be one of {PRE_STEP_WEIGHTS}, got {self.pre_step_weights!r}"
            )
        _positive_int("window", self.window)
        _positive_int("max_consecutive_skips", self.max_consecutive_skips, allow_zero=True)
        _positive_int("snapshot_every", self.snapshot_every, allow_zero=True)
        if not isinstance(self.flush_secs, (int, float)) or self.flush_secs <= 0:
            raise ValueError(f"flush_secs must be a positive number, got {self.flush_secs!r}")
        if not isinstance(self.explosion_factor, (int, float)) or self.explosion_factor <= 10:
            raise ValueError(
                f"explosion_factor must be a number > 10, got {self.explosion_factor!r}"
            )
        if not isinstance(self.min_loss_scale, (int, float)) or self.min_loss_scale < 0:
            raise ValueError(f"min_loss_scale must be a number >= 0, got {self.min_loss_scale!r}")


@dataclasses.dataclass
class WorkerInfo:
    """Where this process sits in a multi-worker cluster."""

    task_type: str
    task_id: int
    is_chief: bool
    tasks: list[str]  # every task, in global replica order ("chief_0", "worker_0", ...)

    @property
    def name(self) -> str:
        return f"{self.task_type}_{self.task_id}"


def worker_info(strategy) -> WorkerInfo | None:
    """The cluster position under MultiWorkerMirroredStrategy, else None."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None:
        return None
    try:
        spec = resolver.cluster_spec().as_dict()
    except Exception:  # noqa: BLE001
        return None
    if not spec or resolver.task_type is None:
        return None
    tasks = [f"chief_{i}" for i in range(len(spec.get("chief", [])))]
    tasks += [f"worker_{i}" for i in range(len(spec.get("worker", [])))]
    if len(tasks) <= 1:
        return None
    task_type, task_id = str(resolver.task_type), int(resolver.task_id or 0)
    is_chief = task_type == "chief" or (
        task_type == "worker" and task_id == 0 and "chief" not in spec
    )
    return WorkerInfo(task_type, task_id, is_chief, tasks)


def worker_run_dir(log_dir: str, info: WorkerInfo | None) -> str:
    """The chief (or a single process) writes ``log_dir``; others a subdir."""
    if info is None or info.is_chief:
        return log_dir
    return posixpath.join(log_dir, info.name)


def base_run_info(recorder: StepRecorder, model, optimizer, options: WatchOptions) -> dict:
    """The run summary fields both front ends write."""
    strategy = recorder.strategy
    info = {
        "model": getattr(model, "name", type(model).__name__),
        "framework": f"keras {keras.__version__} / tensorflow {tf.__version__}",
        "layers": recorder.tapped_layers,
        "optimizer": type(optimizer).__name__ if optimizer is not None else None,
        "jit_compile": bool(getattr(model, "jit_compile", False)),
        "steps_per_execution": recorder.capacity,
        "replicas": strategy.num_replicas_in_sync,
        "strategy": type(strategy).__name__,
        "on_nonfinite": options.on_nonfinite,
    }
    not_watched = recorder.not_watched()
    if not_watched:
        info["not_watched"] = not_watched
    return info


class WatchHost:
    """Turns the recorder's rows into the on-disk record of one run."""

    def __init__(
        self,
        log_dir: str,
        recorder: StepRecorder,
        options: WatchOptions,
        run_info: dict,
        trainable_weights,
    ) -> None:
        self.recorder = recorder
        self.options = options
        self.worker = worker_info(recorder.strategy)
        self.log_dir = worker_run_dir(log_dir, self.worker)
        self.run_info = dict(run_info)
        if self.worker is not None:
            self.run_info["worker"] = self.worker.name
            self.run_info["chief"] = self.worker.is_chief
            self.run_info["workers"] = self.worker.tasks
        self._weights = trainable_weights  # callable -> list of variables
        self.journal: RunJournal | None = None
        self.incident: dict | None = None
        self.step = 0
        self.epoch = 0
        self.batch_in_epoch = 0

    def begin_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.batch_in_epoch = 0

    def record_new_steps(self) -> dict | None:
        """Records every step written since the last call; the first incident."""
        rows = self.recorder.fetch_rows()
        if rows and self.journal is None:
            self.journal = self.open_journal()
        first_incident = None
        for vector, first_bad in rows:
            incident = self.journal.record(
                self.step,
                self.epoch,
                self.batch_in_epoch,
                vector,
                extra=self._replica_view(first_bad),
            )
            self.step += 1
            self.batch_in_epoch += 1
            if incident is not None and first_incident is None:
                first_incident = incident
        if first_incident is not None:
            self.incident = first_incident
        return first_incident

    def open_journal(self) -> RunJournal:
        info = dict(self.run_info)
        not_watched = self.recorder.not_watched()
        if not_watched:
            info["not_watched"] = not_watched
        o = self.options
        return RunJournal(
            self.log_dir,
            self.recorder.schema,
            info,
            JournalSettings(
                window=o.window,
                snapshot_every=o.snapshot_every,
                max_consecutive_skips=o.max_consecutive_skips,
                min_loss_scale=o.min_loss_scale,
                flush_secs=o.flush_secs,
                explosion_factor=o.explosion_factor,
            ),
            writer=RunWriter(self.log_dir),
        )

    def _replica_view(self, first_bad: np.ndarray) -> dict | None:
        """Which replica went non-finite first (only with several replicas)."""
        if len(first_bad) <= 1:
            return None
        entries = [e for e in self.recorder.schema.entries if e.kind != "header"]
        ordinals = [round(float(v)) for v in first_bad]
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
                else {
                    "phase": entries[o].phase,
                    "layer": entries[o].layer,
                    "tensor": entries[o].tensor,
                }
                for o in ordinals
            ],
        }
        if self.worker is not None:
            per_worker = max(len(ordinals) // len(self.worker.tasks), 1)
            view["worker"] = self.worker.tasks[
                min(at_origin[0] // per_worker, len(self.worker.tasks) - 1)
            ]
        return view

    def save_bundle(self, incident: dict) -> None:
        """Writes the reproduction bundle (batch and pre-step weights)."""
        weights, batch, structure = self.recorder.pre_step_state()
        batch_step, weights_step = self.recorder.stashed_steps()
        variables = self.recorder.watched_weights
        names = [v.path for v in (variables if variables is not None else self._weights())]
        if not weights:
            weights_step = None
        if self.options.pre_step_weights == "on_suspect" and incident["phase"] == "update":
            weights, weights_step = [], None
        exact = batch_step == incident["step"] and (
            weights_step is None or weights_step == incident["step"]
        )
        info = {
            "weights_before_step": weights_step,
            "batch_of_step": batch_step,
            "exact": exact,
            "pre_step_weights": self.options.pre_step_weights,
            "incident": incident,
        }
        if self.recorder.strategy.num_replicas_in_sync > 1:
            info["batch_shards"] = (
                f"the shards of this process's replicas, concatenated "
                f"({len(self.recorder.strategy.extended.worker_devices)} replica(s))"
            )
        if self.worker is not None:
            info["worker"] = self.worker.name
        relative = bundle.save_bundle(
            self.log_dir,
            incident["step"],
            dict(zip(names, weights, strict=False)),
            batch,
            structure,
            info,
        )
        self.journal.set_repro_bundle(relative)

    def close(self, status: str) -> None:
        if self.journal is not None and not getattr(self.journal, "closed", False):
            self.journal.close(status)
