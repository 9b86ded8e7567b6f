"""One watched training run, shared by both front ends.

:class:`~tb_nanwatch.record.callback.NanWatch` (``fit``) and
:class:`~tb_nanwatch.record.custom_loop.StepWatcher` (custom training loops) are thin
adapters around a :class:`WatchSession`, which owns everything they have in
common: the options (a validated
:class:`~tb_nanwatch.evidence.options.WatchOptions`), turning the rows
the compiled step wrote into the on-disk record (a
:class:`~tb_nanwatch.record.writing.journal.RunJournal`, one device read per execution), the
incident (reproduction bundle, console message, stop / raise / continue),
the report of layers it cannot watch, disabling itself on its own failure
(one ``RuntimeWarning``, training goes on) and the final status.

Under ``MultiWorkerMirroredStrategy`` every worker keeps its own record: the
chief writes the run dir it was given, any other worker writes
``<log_dir>/<task_type>_<task_id>`` (so no two processes ever write the same
event file). The statistics are reduced across all replicas, so each record
holds the merged view; each worker's reproduction bundle holds *its own* data
shard, which is where a bad shard shows up.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import posixpath
import uuid
import warnings
from collections.abc import Callable

import keras
import tensorflow as tf

from tb_nanwatch.evidence.options import WatchOptions
from tb_nanwatch.evidence.replica_origin import replica_origin
from tb_nanwatch.evidence.run_dir_box import is_remote
from tb_nanwatch.evidence.warning_record import warning_entry, warning_line
from tb_nanwatch.record.after_incident import (
    bundle,
    follow_up,
    incident_bundle,
    messages,
    replay,
    trial_remedies,
    trials,
)
from tb_nanwatch.record.after_incident.console import CONSOLE
from tb_nanwatch.record.after_incident.recovery import Recovery
from tb_nanwatch.record.after_incident.rewind_points import RewindNotTaken, RewindRing, SnapshotDisk
from tb_nanwatch.record.after_incident.trial_episodes import trial_data_of_run
from tb_nanwatch.record.in_step.recorder import StepRecorder
from tb_nanwatch.record.writing import crash_safety
from tb_nanwatch.record.writing.event_writer import RunWriter
from tb_nanwatch.record.writing.journal import RunJournal
from tb_nanwatch.record.writing.run_dirs import RunPlacement, worker_info, worker_run_dir

describe_incident = messages.describe_incident  # NonFiniteError's words, and the console's

logger = logging.getLogger("tb_nanwatch")

# The early warnings whose predicted step takes a rewind point just before it.
REWIND_BEFORE = ("schedule_jump", "overflow_forecast")

# The phases whose bundle holds the pre-step weights (see pre_step_weights).
REPLAYED_PHASES = ("input", "forward", "loss", "backward")


class NonFiniteError(RuntimeError):
    """Raised by ``on_nonfinite="raise"``; ``.incident`` holds the diagnosis."""

    def __init__(self, incident: dict) -> None:
        super().__init__(describe_incident(incident))
        self.incident = incident


def check_writable(log_dir: str | os.PathLike, argument: str = "log_dir") -> str:
    """``log_dir`` as a string (``os.PathLike`` accepted), or a ValueError
    naming ``argument`` unless it can be written."""
    if isinstance(log_dir, os.PathLike):
        log_dir = os.fspath(log_dir)
    if not isinstance(log_dir, str) or not log_dir:
        raise ValueError(
            f"{argument} must be a non-empty path (str or os.PathLike), got {log_dir!r}"
        )
    probe = posixpath.join(log_dir, f".nanwatch-write-test-{uuid.uuid4().hex}")
    try:
        tf.io.gfile.makedirs(log_dir)
        with tf.io.gfile.GFile(probe, "w") as f:
            f.write("ok")
        tf.io.gfile.remove(probe)
    except Exception as error:  # noqa: BLE001 - any failure means "not writable"
        raise ValueError(f"{argument} {log_dir!r} is not writable: {error}") from None
    return log_dir


def check_optimizer(optimizer) -> None:
    """A ValueError naming ``optimizer`` unless it is a Keras optimizer."""
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError(
            "optimizer must be the keras.optimizers.Optimizer that applies the gradients "
            f"(a LossScaleOptimizer under mixed precision), got {optimizer!r}"
        )


def warn_stopped_watching(reason: str, stacklevel: int = 3) -> None:
    """The one warning the watcher gives when it stops watching on its own failure."""
    warnings.warn(f"NanWatch stopped watching: {reason}", RuntimeWarning, stacklevel=stacklevel)


def report_not_watched(not_watched: list[str]) -> None:
    """Tells the user, once per run, what is not watched one by one (and why)."""
    if not_watched:
        logger.warning(
            "NanWatch does not watch these layers or inputs one by one (the run summary's not_watched "
            "says the same): %s",
            "; ".join(not_watched),
        )


class WatchSession:
    """One watched run: the recorder's rows in, the record and decisions out.

    ``release`` undoes the front end's instrumentation; the session calls it
    when it stops watching (its own failure, ``"raise"``). ``placement`` is
    the watcher's :class:`~tb_nanwatch.record.writing.run_dirs.RunPlacement`: the session
    writes to its next stage dir.
    """

    def __init__(
        self,
        log_dir: str,
        recorder: StepRecorder,
        options: WatchOptions,
        run_info: dict,
        release: Callable[[], None],
        placement: RunPlacement,
    ) -> None:
        self.recorder = recorder
        self.options = options
        self.worker = worker_info(recorder.strategy)
        self.log_dir = placement.next_stage(worker_run_dir(log_dir, self.worker))
        self.run_info = {**run_info, "stage": placement.stage}
        if self.worker is not None:
            self.run_info["worker"] = self.worker.name
            self.run_info["chief"] = self.worker.is_chief
            self.run_info["workers"] = self.worker.tasks
        self._release = release
        # A custom loop's loss, for the replay (a compiled model has its own;
        # see use_replay_loss).
        self.replay_loss: Callable | None = None
        self.journal: RunJournal | None = None
        self.incident: dict | None = None
        self._explosion_announced = False  # the explosion's console block, once a run
        self.disabled = False
        self._write_fault_warned = False  # a log dir that cannot be written: one warning a run
        self.closed = False
        self.step = 0
        self.epoch = 0
        self.batch_in_epoch = 0
        # Rewind points: snapshots every rewind_every steps (None when off).
        self.rewind: RewindRing | None = None
        if options.rewind_every:
            # A local run dir: each snapshot to a file, written in the background.
            disk = None
            if not is_remote(self.log_dir):
                disk = SnapshotDisk(self.log_dir, options.rewind_disk_mb)
            self.rewind = RewindRing(
                options.rewind_every,
                options.rewind_memory_mb,
                recorder.steps_per_execution,
                disk,
            )
            recorder.use_rewind_points(self.rewind)
        # "skip"/"rewind": the compiled step undoes a non-finite step; the
        # host side counts, rewinds and stops (record/after_incident/recovery.py).
        if options.recovers and not hasattr(recorder.device, "pre_step_pairs"):
            raise ValueError(
                f"on_nonfinite={options.on_nonfinite!r} undoes a step inside a Keras model's "
                "compiled step (fit or a StepWatcher loop); here use 'stop', 'raise' or 'continue'"
            )
        if options.recovers:
            recorder.undo_nonfinite_steps()
        self.recovery: Recovery | None = None
        if options.recovers:
            self.recovery = Recovery(self, trial_data=self.trial_data)
            self.run_info.update(self.recovery.summary())  # none yet, said from the start
        # Whether the last end_step asked the front end to stop training.
        self.stop_requested = False

    def use_replay_loss(self, loss_fn: Callable | None) -> None:
        """The loss a custom loop computes, for the replay and the trials."""
        self.replay_loss = loss_fn

    # -- per step ----------------------------------------------------------------

    def begin_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.batch_in_epoch = 0

    def end_step(self) -> dict | None:
        """Records every step the compiled function ran since the last call.

        Returns the first new incident after saving its bundle and printing it
        (the front end then stops, or calls :meth:`raise_incident`); None
        otherwise. A failure of the watcher itself disables it (one warning).
        """
        self.stop_requested = False
        if self.disabled or self.closed:
            return None
        if self.recorder.trace_error is not None:
            self.disable(f"could not build its statistics: {self.recorder.trace_error!r}")
            return None
        try:
            incident = self._record_new_steps()
            self._keep_rewind_points()
        except Exception as error:  # noqa: BLE001 - never break the user's training
            self.disable(f"recording failed: {error!r}")
            return None
        self._announce_warnings()
        if incident is not None:
            self.incident = incident
            CONSOLE.lines(self._incident_message(incident))
        self._announce_explosion()
        if self.recovery is not None and self.recovery.after_steps():
            self.stop_requested = True
        elif incident is not None and self.options.on_nonfinite == "stop":
            self.stop_requested = True
        return incident

    def _incident_message(self, incident: dict) -> list[str]:
        """The incident's console block: what, when, where, the cause and its
        first remedy, the run dir, the report command and the bundle."""
        bundle_path = None
        if self.journal.repro_bundle:
            bundle_path = posixpath.join(self.log_dir, self.journal.repro_bundle)
        return messages.incident_block(incident, self._cause_lines(), self.log_dir, bundle_path)

    def _cause_lines(self) -> list[str]:
        """The cause and its first remedy (and whether it will be tried). Never raises."""
        try:
            cause = self.journal.cause()
            return messages.cause_lines(cause, self._trial_plan(messages.first_remedy_id(cause)))
        except Exception as error:  # noqa: BLE001 - the message must not fail
            return [f"  cause: not judged ({error!r})"]

    def _trial_plan(self, remedy: str | None) -> str:
        """Whether the remedy ``remedy`` will be tried, in words."""
        if remedy is None or trial_remedies.is_advice(remedy):
            return "advice: nothing to try on a re-run"
        if not isinstance(self.recorder.model, keras.Model):
            return "not tried: the trials re-run a Keras model"
        if not self.options.remedy_trials:
            return "not tried: remedy_trials=False"
        if self.worker is not None:
            return "not tried on a worker of a cluster"
        if self.options.on_nonfinite == "rewind":
            return "tried now, on a re-run of the recorded steps"
        return "tried when training ends, on a re-run of the recorded steps"

    def _announce_warnings(self) -> None:
        """One console line for each early warning raised since the last call
        (the journal raises at most one a kind a run). Never raises."""
        if self.journal is None:
            return
        fresh = self.journal.early_warnings.take_fresh()
        try:
            for found in fresh:
                CONSOLE.lines(f"NanWatch {warning_line(warning_entry(found))}")
        except Exception as error:  # noqa: BLE001 - the message must not fail
            warnings.warn(f"NanWatch could not print an early warning: {error!r}", stacklevel=3)
        # A rewind point just before a foreseen trouble, whether or not its line printed.
        if self.rewind is not None and self.options.on_nonfinite == "rewind":
            for found in fresh:
                foreseen = found.get("predicted_step")
                if foreseen is not None and found.get("kind") in REWIND_BEFORE:
                    self.rewind.expect_trouble(foreseen)

    def _announce_explosion(self) -> None:
        """One console block, once a run, when the journal confirmed an
        explosion onset before any incident (an incident has its own message).
        Never raises."""
        journal = self.journal
        if self._explosion_announced or journal is None:
            return
        onset = journal.explosion_onset
        if onset is None or self.incident is not None or journal.first_nonfinite:
            return
        self._explosion_announced = True
        try:
            lr = self._lr_at(int(onset["step"]))
            CONSOLE.lines(messages.explosion_block(onset, self._cause_lines(), lr, self.log_dir))
        except Exception as error:  # noqa: BLE001 - the message must not fail
            warnings.warn(f"NanWatch could not describe the explosion: {error!r}", stacklevel=3)

    def _lr_at(self, step: int) -> float | None:
        """The recorded learning rate of ``step`` (from the flight window), or None."""
        try:
            value = self.journal.flight_values("lr").get(step)
        except Exception:  # noqa: BLE001 - no rate recorded
            return None
        return value if value is not None and math.isfinite(value) and value > 0 else None

    @property
    def stops_training(self) -> bool:
        """Whether an incident was found and ``on_nonfinite="stop"``, or a
        recovering watcher gave up (``max_skips``, ``max_rewinds``)."""
        if self.recovery is not None and self.recovery.stop_reason is not None:
            return True
        return self.incident is not None and self.options.on_nonfinite == "stop"

    def raise_if_asked(self, incident: dict) -> None:
        """With ``on_nonfinite="raise"``: closes the record and raises."""
        if self.options.on_nonfinite == "raise":
            self._release()
            self.close("raised")
            raise NonFiniteError(incident)

    def _record_new_steps(self) -> dict | None:
        # With steps_per_execution > 1 this runs once per execution and
        # records every step of it (the device buffer holds one row a step).
        rows = self.recorder.device.fetch_rows()
        if rows and self.journal is None:
            self.journal = self._open_journal()
        first_incident = None
        for vector, replica_first_nonfinite in rows:
            if self.rewind is not None:
                self.rewind.note_step(self.step, vector, self.recorder.schema)
            if self.recovery is not None:
                self.recovery.note(self.step, vector, self.recorder.schema)
            incident = self.journal.submit(
                self.step,
                self.epoch,
                self.batch_in_epoch,
                vector,
                extra=replica_origin(
                    self.recorder.schema,
                    replica_first_nonfinite,
                    None if self.worker is None else self.worker.tasks,
                ),
            )
            self.step += 1
            self.batch_in_epoch += 1
            if incident is not None and first_incident is None:
                first_incident = incident
        return first_incident

    def _keep_rewind_points(self) -> None:
        """Takes the snapshot that is due; saves the rewind point of an explosion
        the journal confirmed (one a run; an explosion confirmed by the steps
        still queued is saved first, while the older snapshot is kept)."""
        ring = self.rewind
        if ring is None or self.journal is None:
            return
        due = ring.due(self.step)
        if not ring.tried:
            if due:
                self.journal.settle()
            onset = self.journal.explosion_onset
            if onset is not None:
                self._save_rewind_point(self.step - 1, int(onset["step"]))
        if due:
            model, optimizer = self.recorder.model, self.recorder.optimizer
            ring.take(self.step, model, optimizer, self.recorder.device)

    def _save_rewind_point(self, through: int, onset: int | None) -> None:
        """Saves the rewind point for the steps through ``through`` into the run
        dir; its relative path (or why there is none) goes into the run
        summary as ``rewind_point`` (``rewind_point_not_taken``). Never raises."""
        ring = self.rewind
        if ring is None or self.journal is None:
            return
        try:
            found = {"rewind_point": ring.save(self.log_dir, self.recorder.device, through, onset)}
        except RewindNotTaken as why:
            found = {"rewind_point": None, "rewind_point_not_taken": str(why)}
        except Exception as error:  # noqa: BLE001 - never break the user's training
            self._warn_failed("save the rewind point", error, stacklevel=5)
            found = {"rewind_point": None, "rewind_point_not_taken": f"failed: {error!r}"}
        # A new dict: the journal's worker may be writing the summary from the old one.
        self.journal.update_run_info(**found)

    def settled_journal(self) -> RunJournal | None:
        """The journal with every step submitted so far recorded (what the
        front ends' ``journal`` shows), None before the first step."""
        journal = self.journal
        if journal is not None and not journal.closed:
            try:
                journal.settle()
            except Exception as error:  # noqa: BLE001 - never break the user's training
                self.disable(f"recording failed: {error!r}")
        return journal

    def _open_journal(self) -> RunJournal:
        info = dict(self.run_info)
        not_watched = self.recorder.not_watched()
        if not_watched:
            info["not_watched"] = not_watched
        report_not_watched(not_watched)
        journal = RunJournal(
            self.log_dir,
            self.recorder.schema,
            info,
            self.options,
            writer=RunWriter(self.log_dir),
            before_incident=self._bundle_or_warning,
        )
        # Ctrl-C in a notebook ends fit without on_train_end: see crash_safety.
        crash_safety.close_when_call_ends(journal)
        return journal

    def _bundle_or_warning(self, incident: dict) -> tuple[str, bool] | None:
        """The reproduction bundle's (relative path, exact), or None after a warning."""
        try:
            return self._save_bundle(incident)
        except Exception as error:  # noqa: BLE001
            self._warn_failed("save the reproduction bundle", error, stacklevel=6)
            return None

    def _warn_failed(self, what: str, error: Exception, stacklevel: int) -> None:
        """``NanWatch could not WHAT``, one warning; a log dir that cannot be written
        (read-only, no permission, full) is one fault, warned about once a run, though
        the rewind point, the bundle and the trials each fail on it."""
        if _cannot_write(error):
            if self._write_fault_warned:
                return
            self._write_fault_warned = True
            what += f" (the log dir {self.log_dir} cannot be written; nothing more is saved there)"
        warnings.warn(
            f"NanWatch could not {what}: {error!r}", RuntimeWarning, stacklevel=stacklevel
        )

    def _warn_after_training(self, stage: str, error: Exception) -> None:
        """A failure of the replay or the trials after training: one warning."""
        what = "replay the incident" if stage == "replay" else "try the remedies"
        # The frame that closed the session (here, this one, follow_up's two, close).
        self._warn_failed(what, error, stacklevel=6)

    def _save_bundle(self, incident: dict) -> tuple[str, bool]:
        """Writes the rewind point, then the reproduction bundle and the model
        beside it (for ``tb-nanwatch replay`` elsewhere)."""
        onset = (self.journal.explosion_onset or {}).get("step")
        self._save_rewind_point(incident["step"], None if onset is None else int(onset))
        relative, exact = incident_bundle.save_incident_bundle(
            self.log_dir,
            incident,
            self.recorder,
            self.options.pre_step_weights,
            None if self.worker is None else self.worker.name,
        )
        bundle.save_model(
            posixpath.join(self.log_dir, relative), self.recorder.model, self.replay_loss
        )
        return relative, exact

    # -- failure and the end -------------------------------------------------------

    def disable(self, reason: str) -> None:
        """Stops watching after the watcher's own failure: one warning, no raise."""
        if not self.disabled:
            warn_stopped_watching(reason, stacklevel=4)
        self.disabled = True
        self._release()

    def final_status(self) -> str:
        """ "stopped" after an incident, "terminated" when training went on
        after a SIGTERM (a user's handler) and ended, else "finished"."""
        if self.stops_training:
            return "stopped"
        return "terminated" if crash_safety.sigterm_received() else "finished"

    def close(self, status: str | None = None) -> None:
        """Writes the final run summary (``status``: "stopped"/"finished" by
        default), then tries the remedies: the replay names the incident's op
        for the record, the trials run after the record is safe on disk (they
        take a while; ``record/after_incident/follow_up.py``)."""
        self.closed = True
        try:
            self._close_and_try(status)
        finally:
            ring = getattr(self, "rewind", None)
            if ring is not None:
                ring.close()  # the snapshot files go; the saved rewind point stays

    def _close_and_try(self, status: str | None) -> None:
        if self.journal is None or self.journal.closed:
            return
        self.settled_journal()  # a failure of the worker thread is warned about, not lost
        self._announce_warnings()
        self._announce_explosion()
        done = follow_up.replay_then_trials(
            self.recorder.model,
            self.replay_loss,
            self.log_dir,
            replay=self._bundle_to_replay(),
            trials=self._trial_input,
            hooks=follow_up.Hooks(
                named=self._name_the_op,
                then=lambda: self._close_record(status),
                failed=self._warn_after_training,
                progress=CONSOLE.progress,
            ),
        )
        if done.trials:
            follow_up.print_tried(done.trials, self.log_dir)

    def _close_record(self, status: str | None) -> bool:
        """The late rewind point, then the final summary; False when the
        record could not be closed (the watcher stops, one warning)."""
        self._late_rewind_point()
        try:
            self.journal.close(status or self.final_status())
        except Exception as error:  # noqa: BLE001
            self.disable(f"could not close the record: {error!r}")
            return False
        self._announce_explosion()  # a climb the end of the run confirmed
        return True

    def _late_rewind_point(self) -> None:
        """An explosion the journal confirmed after the last step's check: its
        rewind point is saved now, before the final summary names it. Without
        a bundle (an explosion) the model goes beside the rewind point, for
        ``tb-nanwatch replay`` elsewhere. Never raises."""
        ring = getattr(self, "rewind", None)
        onset = self.journal.explosion_onset
        if ring is not None and not ring.tried and onset and not self.journal.first_nonfinite:
            self._save_rewind_point(self.step - 1, int(onset["step"]))
        where = self.journal.run_info.get("rewind_point")
        if not where or self.journal.repro_bundle or self.worker is not None:
            return
        try:
            bundle.save_model(
                posixpath.join(self.log_dir, where),
                self.recorder.model,
                self.replay_loss,
                getattr(self.recorder, "optimizer", None),
                meta_file=bundle.MODEL_META,
            )
        except Exception as error:  # noqa: BLE001 - never break the end of training
            warnings.warn(
                f"NanWatch could not save the model beside the rewind point: {error!r}",
                RuntimeWarning,
                stacklevel=3,
            )

    def _trial_input(self) -> follow_up.TrialInput | None:
        """After training stopped at an incident or an explosion: what the
        remedy trials need (``record/after_incident/trials.py``); None when they
        are off, ran already or have nothing to follow."""
        journal = self.journal
        incident, onset = journal.first_nonfinite, journal.explosion_onset
        if not self.options.remedy_trials or self.worker is not None:
            return None
        if self.recovery is not None and self.recovery.trials_ran:
            return None  # run at the incident, to choose the rewind's remedy
        if incident is None and onset is None:
            return None
        step = (incident or onset)["step"]
        return follow_up.TrialInput(journal.cause(), step, self.options, self.trial_data)

    def trial_data(self) -> trials.TrialData:
        """The bundle, the rewind point (or why none), the recorded losses and
        the optimizer for the trials."""
        optimizer = getattr(self.recorder, "optimizer", None)
        optimizer = optimizer or getattr(self.recorder.model, "optimizer", None)
        saved = None
        if self.journal.repro_bundle:
            saved = bundle.load_bundle(posixpath.join(self.log_dir, self.journal.repro_bundle))
        losses = self.journal.flight_values("loss")
        summary = self.journal.summary()
        if self.options.rewind_every == 0:
            summary = {"rewind_point_not_taken": "rewind points are off (rewind_every=0)"}
        # This process wrote the rewind point, within rewind_disk_mb: not a
        # stranger's file, so not held to the bundles' byte limit.
        disk = int(self.options.rewind_disk_mb * 2**20)
        return trial_data_of_run(self.log_dir, summary, saved, losses, optimizer, disk)

    def _bundle_to_replay(self) -> Callable[[], bundle.ReproBundle] | None:
        """After training: the incident's exact bundle, whose step the replay
        re-runs to name the op and the source line (no per-step cost); None
        when there is none to replay."""
        incident = self.journal.first_nonfinite
        if (
            incident is None
            or not self.journal.repro_bundle
            or not self.journal.repro_bundle_exact
            or incident["phase"] not in REPLAYED_PHASES
            or self.worker is not None  # no eager work beside a multi-worker cluster's peers
            or not isinstance(self.recorder.model, keras.Model)  # a tf_keras model: no replay
        ):
            return None
        path = posixpath.join(self.log_dir, self.journal.repro_bundle)
        return lambda: bundle.load_bundle(path)

    def _name_the_op(self, origin: replay.OpOrigin | None) -> None:
        """The replay's op goes into the incident record (and one console line)."""
        if origin is None:
            return
        incident = self.journal.first_nonfinite
        op = origin.to_json()
        incident["op"] = {key: op[key] for key in ("type", "name", "source", "reproduced")}
        if origin.needs_loss:
            incident["op"]["why"] = replay.NEEDS_LOSS_FN  # a custom loop without loss_fn=
        directory = posixpath.join(self.log_dir, self.journal.repro_bundle)
        kept = replay.output_path(directory)
        CONSOLE.lines(messages.replay_line(incident["step"], origin, kept))


_WRITE_FAULTS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT})


def _cannot_write(error: BaseException) -> bool:
    """Whether ``error`` says the log dir cannot be written (not a failure of its own)."""
    if isinstance(error, tf.errors.PermissionDeniedError):
        return True
    return isinstance(error, OSError) and error.errno in _WRITE_FAULTS
