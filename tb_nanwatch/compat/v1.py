"""NanWatch for TF1 graph-mode training: :class:`GraphWatcher`.

For code built on ``tf.compat.v1`` placeholders, a ``Session`` and
``feed_dict``, with a ``tf.compat.v1.train`` optimizer. Hand the loss to the
watcher and let it make the train op in place of ``optimizer.minimize``::

    from tb_nanwatch.compat.v1 import GraphWatcher

    watch = GraphWatcher("logs/run", loss, outputs={"p_pred": p_pred})
    train_op = watch.minimize(tf.compat.v1.train.AdamOptimizer(0.01))
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for batch in batches:
            _, l = sess.run([train_op, loss], feed_dict={pixels: batch})
            if watch.end_step():  # True: stop (on_nonfinite="stop")
                break
    watch.close()

or, under ``MonitoredTrainingSession``, ``hooks=[watch.hook()]`` (the hook
records each step and asks the session to stop).

The step's statistics are computed in the train op and handed to the host
inside the user's own ``sess.run`` (one read of a small vector; no second
run). The record is the TF2 one: the same run dir, tab, report, export and
causes. Inputs are named by their placeholders (``pixels``), layers by the
name scopes of their ops (``encoder/dense1``), gradients and updates by
their variables. Limits: the graph must run in this process (the hand-over
is a ``tf.numpy_function``); a tensor read by several scopes has one
gradient (the sum over its readers), so its input gradient is the same for
each; ``tf.while_loop`` bodies are seen as the loop op, not scope by scope;
the incident's op and source line are not replayed (the scope names where).
"""

from __future__ import annotations

import dataclasses
import os
import posixpath

import numpy as np
import tensorflow as tf

from tb_nanwatch.compat.graph_layout import graph_layout, variable_name
from tb_nanwatch.compat.graph_rows import GraphRows
from tb_nanwatch.compat.graph_step import GraphStep, GraphStepBuilder
from tb_nanwatch.evidence.options import WatchOptions
from tb_nanwatch.record.after_incident import bundle
from tb_nanwatch.record.in_step.phase_stats import STATS_SCOPE
from tb_nanwatch.record.session import NonFiniteError, WatchSession, check_writable
from tb_nanwatch.record.stats.backend import DeviceFacts
from tb_nanwatch.record.stats.graph import GraphStats
from tb_nanwatch.record.writing.journal import RunJournal
from tb_nanwatch.record.writing.run_dirs import RunPlacement

__all__ = ["GraphWatcher", "NonFiniteError"]


class _SessionFacts(DeviceFacts):
    """The device facts, probed in a session of their own graph (eager
    execution may be disabled: a TF1 program)."""

    @property
    def minmax_propagates_nan(self) -> bool:
        return self._probe()[0]

    @property
    def host_only(self) -> bool:
        return self._probe()[1]

    def _probe(self) -> tuple[bool, bool]:
        found = self.__dict__.get("_probed")
        if found is None:
            graph = tf.Graph()
            with graph.as_default():
                checks = []
                for size in (7, 4099):
                    for where in (0, size // 2, size - 1):
                        probe = tf.tensor_scatter_nd_update(
                            tf.range(size, dtype=tf.float32), [[where]], [float("nan")]
                        )
                        checks += [tf.math.is_nan(tf.reduce_min(probe))]
                        checks += [tf.math.is_nan(tf.reduce_max(probe))]
                with tf.compat.v1.Session(graph=graph) as sess:
                    nan_kept = bool(np.all(sess.run(checks)))
                    devices = [d.device_type for d in sess.list_devices()]
            found = (nan_kept, not any(d in ("GPU", "TPU") for d in devices))
            self.__dict__["_probed"] = found
        return found


@dataclasses.dataclass(frozen=True)
class _Weight:
    path: str


class _GraphRecorder:
    """What a :class:`~tb_nanwatch.record.session.WatchSession` reads of its
    recorder, for a graph: the rows, the schema, the failure to build."""

    def __init__(self, rows: GraphRows, variables: list) -> None:
        self.device = rows
        self.schema = None
        self.trace_error: Exception | None = None
        self.model = None
        self.optimizer = None
        self.strategy = tf.distribute.get_strategy()
        self.watched_weights = [_Weight(variable_name(v)) for v in variables]
        self.tapped_layers: list[str] = []
        self.unwatched: list[str] = []

    def not_watched(self) -> list[str]:
        return list(self.unwatched)


class _GraphSession(WatchSession):
    """The session of a graph: its bundle holds the fed batch by placeholder
    name and the weights by variable name; there is no Keras model to save
    or replay."""

    def _save_bundle(self, incident: dict) -> tuple[str, bool]:
        rows: GraphRows = self.recorder.device
        captured = rows.capture_of(incident["step"])
        weights, batch = captured if captured is not None else ([], [])
        if self.options.pre_step_weights == "off":
            weights = []
        structure = {name: i for i, name in enumerate(rows.input_names)} if batch else None
        info = {
            "weights_before_step": incident["step"] if weights else None,
            "batch_of_step": incident["step"] if batch else None,
            "exact": captured is not None,
            "pre_step_weights": self.options.pre_step_weights,
            "incident": incident,
            "graph": True,
        }
        by_name = dict(zip(rows.variable_names, weights, strict=False))
        relative = bundle.save_bundle(
            self.log_dir, incident["step"], by_name, batch, structure, info
        )
        return relative, captured is not None

    def _bundle_to_replay(self) -> None:
        """Not replayed for a graph: the scope in the incident names the place."""


class GraphWatcher:
    """Watches a TF1 graph's training; see the module docstring.

    Args:
        log_dir: run directory (any ``tf.io.gfile`` path).
        loss: the scalar (or per-example) loss tensor the optimizer minimizes.
        outputs: optional model outputs ``{name: tensor}`` (or one tensor),
            recorded as logits entries (a sigmoid's or softmax's input).
        on_nonfinite, window, snapshot_every, flush_secs, explosion_factor:
            as for :class:`~tb_nanwatch.record.callback.NanWatch`.
        pre_step_weights: ``"on_suspect"`` (default) hands the fed batch and
            the weights before the step to the host on a step that may be
            non-finite (the reproduction bundle); ``"every_step"`` on every
            step; ``"off"``: the batch only.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike,
        loss: tf.Tensor,
        *,
        outputs=None,
        on_nonfinite: str = WatchOptions.on_nonfinite,
        window: int = WatchOptions.window,
        snapshot_every: int = WatchOptions.snapshot_every,
        flush_secs: float = WatchOptions.flush_secs,
        pre_step_weights: str = WatchOptions.pre_step_weights,
        explosion_factor: float = WatchOptions.explosion_factor,
    ) -> None:
        self.options = WatchOptions(
            on_nonfinite=on_nonfinite,
            window=window,
            snapshot_every=snapshot_every,
            flush_secs=flush_secs,
            pre_step_weights=pre_step_weights,
            explosion_factor=explosion_factor,
            rewind_every=0,  # rewind points and remedy trials need a Keras model
            remedy_trials=False,
        )
        if not isinstance(loss, tf.Tensor) or not tf.is_symbolic_tensor(loss):
            raise ValueError(
                "loss must be a graph tensor (TF1 graph mode: build it under a tf.Graph or "
                f"with eager execution disabled), got {loss!r}"
            )
        if not loss.dtype.is_floating:
            raise ValueError(f"loss must be a float tensor, got {loss.dtype.name}")
        self.loss = loss
        self.outputs = _named_outputs(outputs)
        self.log_dir = check_writable(log_dir)
        self._placement = RunPlacement()
        self.session: _GraphSession | None = None
        self._train_op: tf.Operation | None = None

    # -- building the graph ------------------------------------------------------

    def minimize(self, optimizer, var_list=None, global_step=None, name=None) -> tf.Operation:
        """``optimizer.minimize(loss, global_step, var_list)`` with the
        statistics in it: the train op to run once a step."""
        if not isinstance(optimizer, tf.compat.v1.train.Optimizer):
            raise ValueError(
                "optimizer must be a tf.compat.v1.train.Optimizer (AdamOptimizer, ...), "
                f"got {optimizer!r}"
            )
        if self._train_op is not None:
            raise ValueError("minimize() was called already: one train op per GraphWatcher")
        graph = self.loss.graph
        with graph.as_default():
            variables = _variables(var_list)
            layout = graph_layout(self.loss, variables, STATS_SCOPE)
            names = [t.op.name for t in layout.placeholders]
            rows = GraphRows([variable_name(v) for v in variables], names)
            recorder = _GraphRecorder(rows, variables)
            recorder.tapped_layers = [s.name for s in layout.scopes]
            stats = GraphStats(_SessionFacts())
            step = GraphStep(self.loss, layout, variables, self.outputs, rows)
            builder = GraphStepBuilder(step, stats, self.options.pre_step_weights)
            self._train_op = builder.train_op(optimizer, global_step, name)
            recorder.schema = builder.builder.schema
        info = _run_info(self.loss, optimizer, recorder, self.options)
        self.session = _GraphSession(
            self.log_dir, recorder, self.options, info, lambda: None, self._placement
        )
        self.log_dir = self.session.log_dir
        return self._train_op

    # -- on the host, after each sess.run ----------------------------------------

    @property
    def incident(self) -> dict | None:
        return self.session.incident if self.session is not None else None

    @property
    def journal(self) -> RunJournal | None:
        """The run's record (None until the first step)."""
        return self.session.settled_journal() if self.session is not None else None

    def begin_epoch(self, epoch: int) -> None:
        """Optional: label the following steps with ``epoch`` (batch from 0)."""
        if self.session is not None:
            self.session.begin_epoch(epoch)

    def end_step(self, sess=None) -> bool:
        """Records the steps run since the last call (their vectors came with
        the train op). True when an incident was found and
        ``on_nonfinite="stop"``; raises :class:`NonFiniteError` with
        ``"raise"``. ``sess`` is accepted for symmetry and not used."""
        if self.session is None:
            raise RuntimeError("call watch.minimize(optimizer) and run its train op first")
        incident = self.session.end_step()
        if incident is None:
            return False
        self.session.raise_if_asked(incident)
        return self.session.stops_training

    def hook(self) -> tf.compat.v1.train.SessionRunHook:
        """A ``SessionRunHook`` for ``MonitoredTrainingSession``: records each
        step after it ran, asks the session to stop on an incident (with
        ``"stop"``), writes the summary when the session ends."""
        return _WatchHook(self)

    def close(self, status: str | None = None) -> None:
        """Writes the final run summary."""
        if self.session is not None and not self.session.closed:
            self.session.close(status)

    def __enter__(self) -> GraphWatcher:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close("raised" if exc_type is not None and self.incident is None else None)


class _WatchHook(tf.compat.v1.train.SessionRunHook):
    def __init__(self, watch: GraphWatcher) -> None:
        self.watch = watch

    def after_run(self, run_context, run_values) -> None:
        if self.watch.session is not None and self.watch.end_step():
            run_context.request_stop()

    def end(self, session) -> None:
        self.watch.close()


def _named_outputs(outputs) -> dict[str, tf.Tensor]:
    if outputs is None:
        return {}
    if isinstance(outputs, tf.Tensor):
        return {outputs.op.name: outputs}
    if isinstance(outputs, dict) and all(isinstance(t, tf.Tensor) for t in outputs.values()):
        return {str(k): v for k, v in outputs.items()}
    raise ValueError(f"outputs must be a tensor or a dict of tensors, got {outputs!r}")


def _variables(var_list) -> list:
    """The trainable variables (those ``minimize`` would use without ``var_list``)."""
    if var_list is None:
        var_list = tf.compat.v1.trainable_variables() + tf.compat.v1.get_collection(
            tf.compat.v1.GraphKeys.TRAINABLE_RESOURCE_VARIABLES
        )
    seen, out = set(), []
    for v in tf.nest.flatten(var_list):
        if id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    if not out:
        raise ValueError("var_list: there are no trainable variables to minimize")
    return out


def _run_info(loss, optimizer, recorder: _GraphRecorder, options: WatchOptions) -> dict:
    return {
        "model": posixpath.dirname(loss.op.name) or "graph",
        "framework": f"tensorflow {tf.__version__} (TF1 graph)",
        "loop": "graph",
        "layers": recorder.tapped_layers,
        "optimizer": type(optimizer).__name__,
        "jit_compile": False,
        "steps_per_execution": 1,
        "replicas": 1,
        "strategy": None,
        "on_nonfinite": options.on_nonfinite,
        "dtype_policy": None,
        "loss_from_logits": None,
    }
