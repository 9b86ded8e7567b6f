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

    NanWatch: first non-finite value at step 1234 (epoch 3, batch 34):
      phase=backward layer=encoder/norm tensor='gradient w.r.t. input of encoder/norm' kind=nan

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

import logging
import posixpath
import sys
import uuid
import warnings

import keras
import tensorflow as tf

from tb_nanwatch.host import (
    WatchHost,
    WatchOptions,
    base_run_info,
)
from tb_nanwatch.journal import RunJournal
from tb_nanwatch.recorder import ROW_KEY, StepRecorder

logger = logging.getLogger("tb_nanwatch")


class NonFiniteError(RuntimeError):
    """Raised by ``on_nonfinite="raise"``; ``.incident`` holds the diagnosis."""

    def __init__(self, incident: dict) -> None:
        super().__init__(describe_incident(incident))
        self.incident = incident


def describe_incident(incident: dict) -> str:
    return (
        f"first non-finite value at step {incident['step']} "
        f"(epoch {incident.get('epoch')}, batch {incident.get('batch')}): "
        f"phase={incident['phase']} layer={incident['layer']} "
        f"tensor={incident['tensor']!r} kind={incident['kind']}"
    )


def check_writable(log_dir: str, argument: str = "log_dir") -> None:
    """Raises ValueError naming ``argument`` unless ``log_dir`` can be written."""
    if not isinstance(log_dir, str) or not log_dir:
        raise ValueError(f"{argument} must be a non-empty path string, got {log_dir!r}")
    probe = posixpath.join(log_dir, f".nanwatch-write-test-{uuid.uuid4().hex}")
    try:
        tf.io.gfile.makedirs(log_dir)
        with tf.io.gfile.GFile(probe, "w") as f:
            f.write("ok")
        tf.io.gfile.remove(probe)
    except Exception as error:  # noqa: BLE001 - any failure means "not writable"
        raise ValueError(f"{argument} {log_dir!r} is not writable: {error}") from None


class NanWatch(keras.callbacks.Callback):
    """Records where NaN/Inf is born during ``fit``; writes it for TensorBoard.

    Args:
        log_dir: run directory for the event files and reproduction bundle
            (any ``tf.io.gfile`` path: local, ``gs://``, ...).
        on_nonfinite: ``"stop"`` (default) ends training after the step,
            ``"raise"`` raises :class:`NonFiniteError`, ``"continue"`` keeps
            training and recording. The incident is on disk before any of them.
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
            exact bundle for those phases at no per-step cost; an
            update-phase incident gets the batch but no weights (replaying an
            update would also need the optimizer's state, which the bundle
            does not hold). ``"every_step"`` copies them before every step
            (a copy of every trainable weight, each step); ``"off"``.
        explosion_factor: how far above its reference level a signal must
            climb to be an explosion (see ``diagnosis.ExplosionDetector``).
    """

    def __init__(
        self,
        log_dir: str,
        on_nonfinite: str = "stop",
        window: int = 32,
        max_consecutive_skips: int = 20,
        snapshot_every: int = 1000,
        flush_secs: float = 10.0,
        pre_step_weights: str = "on_suspect",
        explosion_factor: float = 1e3,
        min_loss_scale: float = 1.0,
    ) -> None:
        super().__init__()
        self.options = WatchOptions(
            on_nonfinite=on_nonfinite,
            window=window,
            max_consecutive_skips=max_consecutive_skips,
            min_loss_scale=min_loss_scale,
            snapshot_every=snapshot_every,
            flush_secs=flush_secs,
            pre_step_weights=pre_step_weights,
            explosion_factor=explosion_factor,
        )
        check_writable(log_dir)
        self.log_dir = log_dir
        self.incident: dict | None = None
        self.journal: RunJournal | None = None
        self._recorder: StepRecorder | None = None
        self._host: WatchHost | None = None
        self._disabled = False
        self._siblings: list = []

    # -- lifecycle -----------------------------------------------------------

    def on_train_begin(self, logs=None) -> None:
        model = self.model
        if model is None or not getattr(model, "compiled", False) or model.optimizer is None:
            raise ValueError(
                "model must be compiled with an optimizer before fit() with NanWatch "
                "(call model.compile(optimizer=..., loss=...))"
            )
        from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

        if type(model).train_step is not TensorFlowTrainer.train_step:
            self._disable(
                f"{type(model).__name__} overrides train_step, which NanWatch cannot "
                "instrument from outside; nothing is watched. Use tb_nanwatch.StepWatcher "
                "inside your train_step instead."
            )
            return
        self._siblings = _sibling_callbacks(self)
        self.incident = None
        if self.journal is not None:  # crash safety: the previous fit raised and
            try:  # Keras skipped on_train_end; see tb_nanwatch.crash_safety
                self.journal.close("raised")
            except Exception as error:  # noqa: BLE001
                warnings.warn(
                    f"NanWatch could not close the previous record: {error!r}", stacklevel=2
                )
        self.journal = None
        try:
            self._recorder = StepRecorder(
                model,
                steps_per_execution=getattr(model, "steps_per_execution", 1) or 1,
                pre_step_weights=self.options.pre_step_weights,
            )
            self._recorder.install()
            self._host = WatchHost(
                self.log_dir,
                self._recorder,
                self.options,
                base_run_info(self._recorder, model, model.optimizer, self.options),
                lambda: model.trainable_weights,
            )
            object.__setattr__(model, "train_step", self._recorder.keras_train_step)
            model.make_train_function(force=True)
            model.train_function = _handing_over(model.train_function, self._recorder)
        except Exception as error:  # noqa: BLE001 - never break the user's fit
            self._restore_model()
            self._disable(f"could not instrument the train step: {error!r}")

    def on_epoch_begin(self, epoch, logs=None) -> None:
        if self._host is not None:
            self._host.begin_epoch(epoch)

    def on_train_batch_end(self, batch, logs=None) -> None:
        if self._disabled or self._recorder is None:
            return
        if self._recorder.trace_error is not None:
            self._disable(f"could not build its statistics: {self._recorder.trace_error!r}")
            return
        incident = None
        try:
            incident = self._record_new_steps()
        except Exception as error:  # noqa: BLE001
            self._disable(f"recording failed: {error!r}")
            return
        if incident is not None:
            self._on_incident(incident)

    def on_train_end(self, logs=None) -> None:
        self._restore_model()
        if self.journal is not None:
            status = (
                "stopped" if self.incident and self.options.on_nonfinite == "stop" else "finished"
            )
            try:
                self.journal.close(status)
            except Exception as error:  # noqa: BLE001
                self._disable(f"could not close the record: {error!r}")

    # -- recording -------------------------------------------------------------

    def _record_new_steps(self) -> dict | None:
        # With steps_per_execution > 1 this runs once per execution and
        # records every step of it (the device buffer holds one row a step).
        host = self._host
        opened = host.journal is not None
        incident = host.record_new_steps()
        self.journal = host.journal
        if not opened and host.journal is not None:
            not_watched = self._recorder.not_watched()
            if not_watched:
                logger.warning(
                    "NanWatch does not watch these layers one by one (their calls run inside "
                    "an inner loop or function, e.g. an RNN cell, or they were not called in "
                    "training); the layer around them is watched: %s",
                    ", ".join(not_watched),
                )
        return incident

    def _on_incident(self, incident: dict) -> None:
        self.incident = incident
        try:
            self._host.save_bundle(incident)
        except Exception as error:  # noqa: BLE001
            warnings.warn(
                f"NanWatch could not save the reproduction bundle: {error!r}",
                RuntimeWarning,
                stacklevel=2,
            )
        print(f"NanWatch: {describe_incident(incident)}", file=sys.stderr)
        if self.options.on_nonfinite == "stop":
            self._protect_siblings(incident)
            self.model.stop_training = True
        elif self.options.on_nonfinite == "raise":
            self._restore_model()
            if self.journal is not None:
                self.journal.close("raised")
            raise NonFiniteError(incident)

    def _protect_siblings(self, incident: dict) -> None:
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
                    incident["step"],
                )

    # -- failure handling --------------------------------------------------------

    def _disable(self, reason: str) -> None:
        if not self._disabled:
            warnings.warn(f"NanWatch stopped watching: {reason}", RuntimeWarning, stacklevel=2)
        self._disabled = True
        self._restore_model()

    def _restore_model(self) -> None:
        model = self.model
        if model is not None and "train_step" in model.__dict__:
            del model.__dict__["train_step"]
            model.make_train_function(force=True)
        if self._recorder is not None:
            self._recorder.uninstall()


def _handing_over(train_function, recorder: StepRecorder):
    """Wraps Keras' train function: the step's row, returned under
    ``ROW_KEY``, goes to the recorder and never reaches the logs."""

    def train_function_without_row(iterator):
        logs = train_function(iterator)
        if isinstance(logs, dict) and ROW_KEY in logs:
            logs = dict(logs)
            recorder.hand_over(logs.pop(ROW_KEY))
        return logs

    return train_function_without_row


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
