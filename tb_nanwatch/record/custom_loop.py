"""NanWatch for custom training loops: :class:`StepWatcher`.

The same record as the :class:`~tb_nanwatch.record.callback.NanWatch` callback (input,
every layer's output, the logits, the loss, the gradient w.r.t. every layer's
output and input, every variable's gradient before the update, the weights
after it), the same diagnosis, the same event files, incident and
reproduction bundle, from a few added lines in your own step::

    watcher = tb_nanwatch.StepWatcher("logs/run", model, optimizer)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape, watcher.forward(tape, x, y) as rec:
            y_pred = model(x, training=True)
            loss = rec.loss(loss_fn(y, y_pred), y_pred=y_pred)
        grads = tape.gradient(loss, rec.sources(model.trainable_variables))
        grads = rec.gradients(grads)  # records the backward pass; the weights' gradients
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        rec.after_update()
        return loss

    for x, y in dataset:
        train_step(x, y)
        if watcher.end_step():  # host side: one fetch, diagnosis; True = stop
            break
    watcher.close()

* ``rec.sources(variables)`` returns ``variables`` followed by the watched
  layer tensors: ask the tape for the gradient of all of them in one backward
  pass, then hand the whole list to ``rec.gradients``, which records the
  backward statistics and returns the gradients of ``variables`` alone.
* Mixed precision: take the gradient of ``optimizer.scale_loss(loss)`` (a
  ``LossScaleOptimizer``) and pass the *unscaled* loss to ``rec.loss``; the
  loss scale and skipped steps are read from the optimizer.
* Several outputs: ``rec.loss(total, y_pred=[a, b], outputs={"a": la, "b": lb})``.
* ``tf.distribute``: call ``train_step`` through ``strategy.run`` as usual
  (create the model, optimizer *and* the watcher under ``strategy.scope()``);
  statistics are reduced across replicas inside the step.
* Several steps per ``tf.function`` call (a ``tf.range`` loop inside the
  function): pass ``steps_per_execution=N``; ``end_step()`` then records all
  N steps at once.
* A custom ``keras.Model.train_step`` under ``fit``: use the same calls inside
  your ``train_step`` and pass ``callbacks=[watcher.callback()]`` to ``fit``.
* ``jit_compile=True`` works: the statistics are plain TensorFlow ops.
* Gradient accumulation (several forward/backward passes, one per
  micro-batch, then one ``apply_gradients``): pass ``micro_batches=N`` and
  open one ``watcher.forward`` per micro-batch, in a Python loop inside the
  compiled step; call ``rec.after_update()`` once, after the update::

      watcher = tb_nanwatch.StepWatcher("logs/run", model, optimizer, micro_batches=4)

      @tf.function(jit_compile=True)
      def train_step(xs, ys):  # xs: [4, micro_batch, ...]
          total = [tf.zeros_like(v) for v in model.trainable_variables]
          for i in range(4):  # a Python loop: each micro-batch is traced
              with tf.GradientTape() as tape, watcher.forward(tape, xs[i], ys[i]) as rec:
                  loss = rec.loss(loss_fn(ys[i], model(xs[i], training=True)))
              grads = rec.gradients(tape.gradient(loss, rec.sources(model.trainable_variables)))
              total = [t + g for t, g in zip(total, grads)]
          optimizer.apply_gradients(zip(total, model.trainable_variables))
          rec.after_update()

  The step's record holds every micro-batch's input, forward, loss and
  backward entries (in that order, micro-batch after micro-batch), then the
  update; an incident names its ``micro_batch`` and the bundle holds that
  micro-batch's data. The header's loss is the micro-batches' mean, its
  gradient norm the root of the sum of their squared norms. A step that
  does not run exactly ``micro_batches`` passes, or runs them inside a
  ``tf.while_loop`` (a ``tf.range`` loop), is refused when it is traced
  (:class:`~tb_nanwatch.record.in_step.recorder.StepPatternError`).
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tb_nanwatch.evidence.options import WatchOptions, positive_int
from tb_nanwatch.evidence.remedies import loss_name
from tb_nanwatch.record.after_incident.console import keras_bar_ended, keras_bar_follows
from tb_nanwatch.record.in_step.phase_stats import StepInputs
from tb_nanwatch.record.in_step.recorder import PendingStep, StepPatternError, StepRecorder
from tb_nanwatch.record.in_step.taps import StepTrace
from tb_nanwatch.record.run_info import base_run_info, loss_from_logits
from tb_nanwatch.record.session import (
    NonFiniteError,
    WatchSession,
    check_optimizer,
    check_writable,
)
from tb_nanwatch.record.writing.journal import RunJournal
from tb_nanwatch.record.writing.run_dirs import RunPlacement

__all__ = ["StepWatcher", "StepRecording", "NonFiniteError", "StepPatternError"]

# The recording calls run at trace time as plain Python: autograph need not
# (and should not) rewrite them.
_no_autograph = tf.autograph.experimental.do_not_convert


class StepWatcher:
    """Watches a custom training loop; see the module docstring.

    Args:
        log_dir: run directory (any ``tf.io.gfile`` path).
        model: the ``keras.Model`` being trained (its layers are watched).
        optimizer: the optimizer applying the gradients (a
            ``LossScaleOptimizer`` under mixed precision).
        steps_per_execution: how many train steps run per call of your
            compiled function (the device buffer holds one row per step).
        micro_batches: forward/backward passes per step with gradient
            accumulation (see the module docstring); 1 without.
        on_nonfinite, window, max_consecutive_skips, min_loss_scale,
        snapshot_every, flush_secs, pre_step_weights, explosion_factor,
        rewind_every, rewind_memory_mb, rewind_disk_mb, remedy_trials, trial_budget_s,
        max_skips, max_rewinds: as for
            :class:`~tb_nanwatch.record.callback.NanWatch`. With ``"stop"``,
            :meth:`end_step` returns True; with ``"raise"`` it raises
            :class:`~tb_nanwatch.record.callback.NonFiniteError`. With
            ``"skip"`` the restore happens in ``rec.after_update()`` (call it
            after ``apply_gradients``); with ``"rewind"`` only a remedy that
            needs no new trace of your step applies live (``lower_lr`` with a
            float learning rate); else it skips. :meth:`end_step` returns
            True when ``max_skips`` or ``max_rewinds`` is exceeded.
        loss_fn: optional ``loss_fn(y, y_pred)``, your loop's loss: when
            training stops, the incident's step is replayed with it from its
            bundle to name the op and the source line (see
            :mod:`tb_nanwatch.record.after_incident.replay`); without it only the forward pass is
            replayed.
    """

    def __init__(
        self,
        log_dir: str,
        model: keras.Model,
        optimizer,
        *,
        steps_per_execution: int = 1,
        micro_batches: int = 1,
        on_nonfinite: str = WatchOptions.on_nonfinite,
        window: int = WatchOptions.window,
        max_consecutive_skips: int = WatchOptions.max_consecutive_skips,
        min_loss_scale: float = WatchOptions.min_loss_scale,
        rewind_every: int = WatchOptions.rewind_every,
        rewind_memory_mb: float = WatchOptions.rewind_memory_mb,
        rewind_disk_mb: float = WatchOptions.rewind_disk_mb,
        remedy_trials: bool = WatchOptions.remedy_trials,
        trial_budget_s: float = WatchOptions.trial_budget_s,
        max_skips: int = WatchOptions.max_skips,
        max_rewinds: int = WatchOptions.max_rewinds,
        snapshot_every: int = WatchOptions.snapshot_every,
        flush_secs: float = WatchOptions.flush_secs,
        pre_step_weights: str = WatchOptions.pre_step_weights,
        explosion_factor: float = WatchOptions.explosion_factor,
        loss_fn=None,
    ) -> None:
        options = WatchOptions.from_arguments(locals())
        if loss_fn is not None and not callable(loss_fn):
            raise ValueError(f"loss_fn must be callable or None, got {loss_fn!r}")
        if not isinstance(model, keras.Model):
            raise ValueError(f"model must be a keras.Model, got {type(model).__name__}")
        positive_int("steps_per_execution", steps_per_execution)
        positive_int("micro_batches", micro_batches)
        check_optimizer(optimizer)
        log_dir = check_writable(log_dir)
        self.options = options
        self.model = model
        self.optimizer = optimizer
        self.recorder = StepRecorder(
            model,
            steps_per_execution=steps_per_execution,
            pre_step_weights=options.pre_step_weights,
            micro_batches=micro_batches,
        )
        self.recorder.install()
        info = base_run_info(self.recorder, model, optimizer, options)
        info["loop"] = "custom"
        if micro_batches > 1:
            info["micro_batches"] = micro_batches
        if loss_fn is not None:
            info["loss_from_logits"] = loss_from_logits(loss_fn)
            info["loss_name"] = loss_name(loss_fn)
        self.session = WatchSession(
            log_dir,
            self.recorder,
            options,
            info,
            self.recorder.uninstall,
            RunPlacement(),
        )
        self.session.use_replay_loss(loss_fn)
        self.log_dir = self.session.log_dir

    # -- in the compiled step ------------------------------------------------

    def forward(self, tape: tf.GradientTape, x, y=None, sample_weight=None) -> _Forward:
        """Context manager around the forward pass; yields a :class:`StepRecording`.

        Enter it *inside* the ``GradientTape`` (``with tape, watcher.forward(
        tape, x, y) as rec``) and call the model and the loss within it.
        """
        if not isinstance(tape, tf.GradientTape):
            raise TypeError("forward() needs the GradientTape that records the step")
        data = (x,) if y is None else ((x, y) if sample_weight is None else (x, y, sample_weight))
        return _Forward(self, tape, x, y, data)

    # -- on the host, after each call of the compiled step ---------------------

    @property
    def incident(self) -> dict | None:
        return self.session.incident

    @property
    def journal(self) -> RunJournal | None:
        """The run's record (None until the first step)."""
        return self.session.settled_journal()

    def begin_epoch(self, epoch: int) -> None:
        """Optional: label the following steps with ``epoch`` (batch from 0)."""
        self.session.begin_epoch(epoch)

    def end_step(self) -> bool:
        """Records the steps that ran since the last call (one device read).

        Returns True when an incident was found and ``on_nonfinite="stop"``
        (or ``max_skips``/``max_rewinds`` was exceeded); raises
        :class:`NonFiniteError` with ``"raise"``. Never raises for a
        failure of the watcher itself: it warns once and stops watching.
        """
        if self.recorder.built_for_xla and self.session.journal is None:
            # The step's own tf.function decides, not the model: say what was built.
            self.session.run_info["jit_compile"] = True
        incident = self.session.end_step()
        if incident is not None:
            self.session.raise_if_asked(incident)
        return self.session.stop_requested

    def close(self, status: str | None = None) -> None:
        """Writes the final run summary and releases the layers' wrappers."""
        if self.session.closed:
            return
        self.recorder.uninstall()
        self.session.close(status)

    def __enter__(self) -> StepWatcher:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        status = None
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            status = "interrupted"
        elif exc_type is not None and self.incident is None:
            status = "raised"
        self.close(status)

    def callback(self) -> keras.callbacks.Callback:
        """A Keras callback that calls :meth:`end_step` for ``fit``.

        For models with their own ``train_step`` that use this watcher's
        recording calls inside it: ``fit(..., callbacks=[watcher.callback()])``
        (stops training on an incident with ``on_nonfinite="stop"``, closes
        the record when ``fit`` ends).
        """
        return _WatcherCallback(self)


class _Forward:
    def __init__(self, watcher: StepWatcher, tape, x, y, data) -> None:
        self.watcher = watcher
        self.tape = tape
        self.x, self.y, self.data = x, y, data
        self._recording = None

    def __enter__(self) -> StepRecording:
        recorder, session = self.watcher.recorder, self.watcher.session
        if not recorder.taps.installed and not (session.disabled or session.closed):
            recorder.install()
        self._recording = recorder.taps.recording(self.tape)
        trace = self._recording.__enter__()
        return StepRecording(self.watcher, trace, self.x, self.y, self.data)

    def __exit__(self, *exc) -> None:
        self._recording.__exit__(*exc)


class StepRecording:
    """The per-step handle yielded by :meth:`StepWatcher.forward`.

    A failure inside the watcher's own statistics never breaks the step: it is
    remembered, the step runs unchanged, and the next ``end_step()`` warns and
    stops watching.
    """

    def __init__(self, watcher: StepWatcher, trace: StepTrace, x, y, data) -> None:
        self.watcher = watcher
        self.trace = trace
        self.x, self.y, self.data = x, y, data
        self.y_pred = None
        self.total_loss = None
        self.variables: list | None = None
        self._pending: PendingStep | None = None

    @_no_autograph
    def loss(self, value, y_pred=None, outputs: dict | None = None):
        """Records the (unscaled) loss and returns it unchanged.

        ``y_pred``: the model's output(s), for the logits entries;
        ``outputs``: optional per-output losses ``{name: loss}``.
        """
        self.total_loss = value
        self.y_pred = y_pred
        for name, item in (outputs or {}).items():
            self.trace.losses.append((str(name), item))
        return value

    @_no_autograph
    def sources(self, variables) -> list:
        """``variables`` followed by the watched layer tensors: pass this list
        to ``tape.gradient`` and its result to :meth:`gradients`."""
        self.variables = list(variables)
        return self.variables + self.watcher.recorder.watched_tensors(self.trace)

    @_no_autograph
    def gradients(self, all_grads) -> list:
        """Records input..backward statistics; returns the variables' gradients."""
        if self.variables is None:
            raise ValueError("call rec.sources(variables) and differentiate w.r.t. its result")
        recorder = self.watcher.recorder
        all_grads = list(all_grads)
        n = len(self.variables)
        if len(all_grads) != n + len(recorder.watched_tensors(self.trace)):
            raise ValueError(
                "rec.gradients() needs the gradients of every tensor rec.sources() returned"
            )
        if self.total_loss is None:
            recorder.fail_trace(ValueError("rec.loss(...) was not called in the step"))
            return all_grads[:n]
        inputs = StepInputs(
            trace=self.trace,
            x=self.x,
            y=self.y,
            y_pred=self.y_pred if self.y_pred is not None else [],
            loss=self.total_loss,
            weights=self.variables,
            grads=all_grads,
            optimizer=self.watcher.optimizer,
            data=self.data,
            model=self.watcher.model,
        )
        self._pending = recorder.guarded(recorder.before_update, inputs)
        if self._pending is None:
            return all_grads[:n]
        return self._pending.weight_gradients

    @_no_autograph
    def after_update(self) -> None:
        """Records the weights after the update and writes the step's row."""
        if self._pending is not None:
            recorder = self.watcher.recorder
            recorder.guarded(recorder.after_update, self._pending, self.variables)


class _WatcherCallback(keras.callbacks.Callback):
    def __init__(self, watcher: StepWatcher) -> None:
        super().__init__()
        self.watcher = watcher

    def on_epoch_begin(self, epoch, logs=None) -> None:
        keras_bar_ended()
        self.watcher.begin_epoch(epoch)

    def on_train_batch_end(self, batch, logs=None) -> None:
        try:
            if self.watcher.end_step() and self.model is not None:
                self.model.stop_training = True
        finally:
            keras_bar_follows(getattr(self, "params", None))

    def on_train_end(self, logs=None) -> None:
        keras_bar_ended()
        self.watcher.close()
