"""NanWatch: a Keras callback that finds where NaN/Inf is born.

What you get
------------
For every training batch NanWatch records, inside the compiled train step,
the finiteness of every tensor that matters: the model inputs, each layer's
output (in execution order, nested models included, named by path such as
``backbone/block2_conv``), the logits before a final sigmoid/softmax, each
output's loss, the gradient with respect to each layer's output and input, each
variable's gradient before the optimizer applies it, and each variable after the
update, plus the learning rate and, under mixed precision, the loss scale.

When the first non-finite value appears, NanWatch tells you *where it was
born*: the first non-finite tensor in the order input -> forward -> loss ->
backward -> update. For example::

    NanWatch: first non-finite value (nan) at step 1234 (epoch 3, batch 34), born in the
      backward phase, at layer encoder/norm (gradient w.r.t. input of encoder/norm)

reads: every input, activation and the loss of step 1234 were finite; going
backwards from the loss, the first gradient that was not finite is the one
flowing out of ``encoder/norm`` into its input: that layer's backward op (a
``sqrt`` at 0, say) made the NaN.

It also flags an *explosion onset* (loss, gradient norm or logits climbing
by orders of magnitude) before anything is non-finite, lists mixed-precision
steps skipped by the loss scaler without calling them incidents, and writes it
all to TensorBoard event files in ``log_dir`` (the "NaN Watch" tab), with the
last ``window`` steps of per-layer statistics and a reproduction bundle (the
offending batch and the weights before the offending step) next to them.

Example::

    model.fit(x, y, epochs=5, callbacks=[tb_nanwatch.NanWatch("logs/run1")])
    # then: tensorboard --logdir logs    or    tb-nanwatch report logs
"""

from __future__ import annotations

import dataclasses
import logging
import sys

import keras
import tensorflow as tf

from tb_nanwatch.evidence.options import WatchOptions
from tb_nanwatch.record.after_incident.console import keras_bar_ended, keras_bar_follows
from tb_nanwatch.record.in_step import legacy_keras, schedule_ahead, train_step
from tb_nanwatch.record.in_step.recorder import StepRecorder
from tb_nanwatch.record.run_info import base_run_info
from tb_nanwatch.record.session import (
    NonFiniteError,
    WatchSession,
    check_writable,
    warn_stopped_watching,
)
from tb_nanwatch.record.writing.journal import RunJournal
from tb_nanwatch.record.writing.run_dirs import RunPlacement

__all__ = ["NanWatch", "NonFiniteError"]

logger = logging.getLogger("tb_nanwatch")


class NanWatch(keras.callbacks.Callback):
    """Records where NaN/Inf is born during ``fit``; writes it for TensorBoard.

    Works for Keras 3 models and for ``tf_keras`` (Keras 2) ones, chosen by
    what the model is (see :mod:`~tb_nanwatch.record.in_step.legacy_keras` for what a
    tf_keras model does not get).

    Args:
        log_dir: run directory for the event files and reproduction bundle
            (any ``tf.io.gfile`` path: local, ``gs://``, ...).
        on_nonfinite: ``"stop"`` (default) ends training after the step,
            ``"raise"`` raises :class:`NonFiniteError`, ``"continue"`` keeps
            training and recording. The incident is on disk before any of them.
            ``"skip"``: a step whose input, forward pass, loss or gradients
            are non-finite is not applied (the weights, the optimizer's slots
            and its iterations stay as before it, restored on the device; a
            loss scaler's own skipped steps are left to it); training goes on.
            ``"rewind"``: at an incident or an explosion, the remedy trials
            run at once; the weights and optimizer state go back to the last
            rewind point before the onset, the best remedy shown to work that
            applies to a live run (``lower_lr``, ``fix_schedule``,
            ``clip_gradients``, ``raise_epsilon``) is set on the optimizer,
            and training goes on (the batches since the rewind point are not
            trained on again); without such a remedy it skips like ``"skip"``.
        window: steps of full per-layer statistics kept in the flight recorder
            and written with the incident.
        max_consecutive_skips: mixed-precision steps skipped by the loss scaler
            in a row before it counts as an incident (0: never).
        min_loss_scale: a skipped step whose loss scale has fallen below this
            floor is an incident (float16 cannot hold even the unscaled
            gradients); 0 turns the check off.
        snapshot_every: write a full per-layer snapshot every N steps (0: never).
        flush_secs: flush the on-disk record at least this often.
        pre_step_weights: which weights the reproduction bundle holds.
            ``"on_suspect"`` (default) copies them on the device, before the
            update, only in a step whose input..backward is non-finite: an
            exact bundle for those phases (with the optimizer's state) at no
            per-step cost; an update-phase incident gets the batch but no
            weights (the copy would have to be made before the update could
            be seen to fail; its trials start from the rewind point).
            ``"every_step"`` copies the weights and the optimizer's state
            before every step (a copy of each, each step); ``"off"``.
        explosion_factor: how far above its reference level a signal must
            climb to be an explosion (see ``diagnosis.ExplosionDetector``).
        rewind_every: take a rewind point (a host copy of the weights and the
            optimizer's state, plus the batches since) every N steps; the last
            two are kept. The remedy trials start from it (0: never).
        rewind_memory_mb: the most host memory the rewind points may hold
            at once (one snapshot, written to disk in the background, on a
            local run dir; two on a remote one; plus the batch ring); above it
            no rewind point is kept and the trials that need one say
            ``not_tried`` and why.
        rewind_disk_mb: the most disk the rewind points may use under the run
            dir (4 x the weights and optimizer state, plus the batch ring);
            above it no rewind point is kept, and why is said once.
        remedy_trials: after training stops at an incident or an explosion,
            try each applicable remedy on a copy of the model and report which
            kept the run finite (False: off).
        trial_budget_s: the wall-clock budget of all remedy trials of a run.
        max_skips: with ``"skip"`` or ``"rewind"``, the most non-finite steps
            skipped in a run; one more stops training (status "stopped").
        max_rewinds: with ``"rewind"``, the most rewinds in a run; the next
            incident or explosion stops training.
    """

    def __init__(
        self,
        log_dir: str,
        on_nonfinite: str = WatchOptions.on_nonfinite,
        window: int = WatchOptions.window,
        max_consecutive_skips: int = WatchOptions.max_consecutive_skips,
        snapshot_every: int = WatchOptions.snapshot_every,
        flush_secs: float = WatchOptions.flush_secs,
        pre_step_weights: str = WatchOptions.pre_step_weights,
        explosion_factor: float = WatchOptions.explosion_factor,
        min_loss_scale: float = WatchOptions.min_loss_scale,
        rewind_every: int = WatchOptions.rewind_every,
        rewind_memory_mb: float = WatchOptions.rewind_memory_mb,
        rewind_disk_mb: float = WatchOptions.rewind_disk_mb,
        remedy_trials: bool = WatchOptions.remedy_trials,
        trial_budget_s: float = WatchOptions.trial_budget_s,
        max_skips: int = WatchOptions.max_skips,
        max_rewinds: int = WatchOptions.max_rewinds,
    ) -> None:
        super().__init__()
        self.options = WatchOptions.from_arguments(locals())
        self.log_dir = check_writable(log_dir)
        self._placement = RunPlacement()
        self._recorder: StepRecorder | None = None
        self._session: WatchSession | None = None
        self._siblings: list = []
        # (what the compiled step was built from, its recorder, the train
        # function): a later fit of the same model reuses them.
        self._compiled: tuple | None = None
        self._said_legacy = False  # the tf_keras warning, given once

    # tf_keras' CallbackList asks these of every callback (Keras 3 does not).
    _supports_tf_logs = False

    def _implements_train_batch_hooks(self) -> bool:
        return True

    def _implements_test_batch_hooks(self) -> bool:
        return False

    def _implements_predict_batch_hooks(self) -> bool:
        return False

    @property
    def incident(self) -> dict | None:
        """The first incident of the last ``fit``, or None."""
        return self._session.incident if self._session is not None else None

    @property
    def journal(self) -> RunJournal | None:
        """The record of the last ``fit`` (None until its first step)."""
        return self._session.settled_journal() if self._session is not None else None

    # -- lifecycle -----------------------------------------------------------

    def on_train_begin(self, logs=None) -> None:
        model = self.model
        step = _step_module(model)
        self._check_model(model, step)
        previous, self._session = self._session, None
        if previous is not None:
            # Closed already, unless the previous fit raised and Keras skipped
            # on_train_end (see crash_safety).
            previous.close("raised")
            if previous.disabled or self._recorder.trace_error is not None:
                self._compiled = None  # a failed watcher starts afresh
        if step.overrides_train_step(model):
            warn_stopped_watching(
                f"{type(model).__name__} overrides train_step, which NanWatch cannot "
                "instrument from outside; nothing is watched. Use tb_nanwatch.StepWatcher "
                "inside your train_step instead."
            )
            return
        self._siblings = _sibling_callbacks(self)
        try:
            built_from = _compiled_step_sources(model)
            kept = self._compiled
            self._compiled = None
            if kept is not None and _same_sources(kept[0], built_from):
                self._recorder, compiled = kept[1], kept[2]
                self._recorder.device.start_over()
            else:
                compiled = None
                self._recorder = StepRecorder(
                    model,
                    steps_per_execution=step.steps_per_execution(model),
                    pre_step_weights=self.options.pre_step_weights,
                )
            self._recorder.install()
            options = self._options_for(model)
            run_info = base_run_info(self._recorder, model, model.optimizer, options)
            planned = schedule_ahead.planned_steps(getattr(self, "params", None))
            run_info["warnings"] = schedule_ahead.schedule_warnings(model.optimizer, planned)
            if step is legacy_keras:
                run_info["framework"] = (
                    f"tf_keras {_tf_keras_version()} / tensorflow {tf.__version__}"
                )
            self._session = WatchSession(
                self.log_dir,
                self._recorder,
                options,
                run_info,
                self._restore_model,
                self._placement,
            )
            compiled = step.instrument(model, self._recorder, compiled)
            self._compiled = (built_from, self._recorder, compiled)
            if self._session.recovery is not None and step is train_step:
                self._session.recovery.use_retrace(self._retrace)
        except Exception as error:  # noqa: BLE001 - never break the user's fit
            self._restore_model()
            warn_stopped_watching(f"could not instrument the train step: {error!r}")
            self._session = None

    def _check_model(self, model, step) -> None:
        """A ValueError unless ``fit`` can be watched as the options ask."""
        if model is None or not step.is_compiled(model):
            raise ValueError(
                "model must be compiled with an optimizer before fit() with NanWatch "
                "(call model.compile(optimizer=..., loss=...))"
            )
        if step is legacy_keras and self.options.recovers:
            raise ValueError(
                f"on_nonfinite={self.options.on_nonfinite!r} needs a Keras 3 model (a tf_keras "
                "optimizer's state is not copied before a step); use 'stop', 'raise' or 'continue'"
            )

    def on_epoch_begin(self, epoch, logs=None) -> None:
        keras_bar_ended()  # Keras' bar ended its line at the epoch's end
        if self._session is not None:
            self._session.begin_epoch(epoch)

    def on_train_batch_end(self, batch, logs=None) -> None:
        # With steps_per_execution > 1 this runs once per execution and
        # records every step of it.
        session = self._session
        if session is None:
            return
        try:
            incident = session.end_step()
            if session.stop_requested:
                recovery = session.recovery
                gave_up = recovery is not None and recovery.stop_step is not None
                self._protect_siblings(recovery.stop_step if gave_up else session.incident["step"])
                self.model.stop_training = True
            if incident is not None:
                session.raise_if_asked(incident)
        finally:
            keras_bar_follows(getattr(self, "params", None))

    def on_train_end(self, logs=None) -> None:
        keras_bar_ended()
        self._restore_model()
        if self._session is not None:
            self._session.close()

    def _protect_siblings(self, step: int) -> None:
        """Keeps BackupAndRestore's last good backup when we stop training.

        Stopping runs ``on_epoch_end`` (which would save the non-finite
        weights over the backup) and ``on_train_end`` (which deletes it).
        """
        for callback in self._siblings:
            if isinstance(callback, keras.callbacks.BackupAndRestore):
                callback.delete_checkpoint = False
                callback._save_model = lambda: None
                logger.warning(
                    "NanWatch kept BackupAndRestore's backup in %s (from before step %d)",
                    callback.backup_dir,
                    step,
                )

    def _retrace(self) -> None:
        """Traces the train step again (a rewind set an optimizer setting that
        is read at trace time); later fits of this model reuse the new one."""
        compiled = train_step.instrument(self.model, self._recorder, None)
        built_from = self._compiled[0] if self._compiled else _compiled_step_sources(self.model)
        self._compiled = (built_from, self._recorder, compiled)

    def _options_for(self, model) -> WatchOptions:
        """The options, less what a tf_keras model cannot have (said once)."""
        if not legacy_keras.is_legacy_model(model):
            return self.options
        if not self._said_legacy:
            self._said_legacy = True
            logger.warning(
                "NanWatch watches this tf_keras model without %s.", legacy_keras.NOT_UNDER_TF_KERAS
            )
        return dataclasses.replace(self.options, rewind_every=0, remedy_trials=False)

    def _restore_model(self) -> None:
        _step_module(self.model).restore(self.model)
        if self._recorder is not None:
            self._recorder.uninstall()


def _step_module(model):
    """The module that instruments ``model``'s train step: tf_keras' or Keras 3's."""
    return legacy_keras if legacy_keras.is_legacy_model(model) else train_step


def _tf_keras_version() -> str:
    return str(getattr(sys.modules.get("tf_keras"), "__version__", "?"))


def _compiled_step_sources(model: keras.Model) -> tuple:
    """What the compiled train step is built from: a later ``fit`` reuses it
    while each is the same (``compile`` makes a new loss and metrics, a
    change of ``trainable`` new trainable weights)."""
    return (
        model.optimizer,
        getattr(model, "_compile_loss", None),
        getattr(model, "_compile_metrics", None),
        *model.trainable_weights,
        bool(getattr(model, "jit_compile", False)),
        getattr(model, "steps_per_execution", 1),
        bool(getattr(model, "run_eagerly", False)),
        getattr(model, "distribute_strategy", None),
    )


def _same_sources(before: tuple, now: tuple) -> bool:
    return len(before) == len(now) and all(
        a is b or (isinstance(a, (bool, int)) and a == b) for a, b in zip(before, now, strict=True)
    )


def _sibling_callbacks(callback: keras.callbacks.Callback) -> list:
    """The other callbacks of the running fit (found on the call stack)."""
    frame = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        callbacks = getattr(owner, "callbacks", None)
        if isinstance(callbacks, list) and any(c is callback for c in callbacks):
            return [c for c in callbacks if c is not callback]
        frame = frame.f_back
    return []
