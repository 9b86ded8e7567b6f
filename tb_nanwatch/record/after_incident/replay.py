"""Names the op and the source line that made an incident's first NaN/Inf, by replay.

After training stopped, :func:`replay_step` re-runs the incident's step once
from its reproduction bundle (the batch and the trainable weights as they were
before the step), on a copy of the model, eagerly, under TensorFlow's own
numeric checks (``tf.debugging.enable_check_numerics``). The first op whose
output holds NaN/Inf stops the replay; its exception carries the op type and,
in its traceback, the user's frame (the innermost one outside TensorFlow, Keras
and tb_nanwatch): the source line. Nothing runs during training, so the watch
costs nothing per step. What TensorFlow's checks print meanwhile (the failing
op's tensors and stack, a hundred lines and more) is kept in the bundle dir
(``replay_tensorflow.txt``, named in ``replay.json``), not printed.

A gradient op TensorFlow defines itself (``SqrtGrad`` for ``tf.sqrt``) has no
user frame: the eager stack runs from the tape into TF's gradient registry. For
those the step is traced once more as a ``tf.function`` under the same checks;
the graph names the failing gradient op (``gradient_tape/<forward scope>/...``)
and its inputs lead to the forward op it differentiates, whose creation stack
(``op.traceback``) holds the user's line. A ``tf.custom_gradient`` backward is
user code, so the eager traceback already names its line.

The replay never changes the model being trained: it clones the model (or, when
the model cannot be cloned, swaps the bundle's weights in and puts every
variable back bitwise afterwards), never applies the optimizer, and never
raises (a failure is a warning and ``None``). It costs one eager step plus one
traced step of the model, in the calling thread: keep it for after training.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import sysconfig
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tb_nanwatch.evidence import run_dir_box
from tb_nanwatch.record.after_incident import bundle_files, captured_output
from tb_nanwatch.record.after_incident.bundle import REPLAY_FILE, ReproBundle, match_arrays
from tb_nanwatch.record.in_step.taps import layer_paths
from tb_nanwatch.record.writing.files import gfile

LossFn = Callable[..., Any]
_CHECK_MARKER = "Detected Infinity or NaN"
_EAGER_OP = re.compile(r'eagerly-executing op "(\w+)"')
_GRAPH_NODE = re.compile(r"Detected at node '?([^'\s]+?)/CheckNumericsV2'? defined at")
_GRADIENT_SCOPE = "gradient_tape/"
_NOT_EXACT = "the bundle is not exact: its batch or weights are not those of the step"
_NO_LOSS = "no loss (a compiled loss or loss_fn): the loss and backward phases were not replayed"
# Why an op is not named when a custom loop's replay had no loss (the record's op "why").
NEEDS_LOSS_FN = "the replay needs the loop's loss: pass loss_fn= to StepWatcher"
# TensorFlow's own output during the replay, kept beside replay.json (not printed).
TENSORFLOW_OUTPUT = "replay_tensorflow.txt"
# How far back through the gradient ops the search for the forward op goes.
_MAX_GRADIENT_OPS = 64


@dataclasses.dataclass(frozen=True)
class OpOrigin:
    """The op that produced the first non-finite value of a replayed step.

    ``type`` and ``name`` are empty when the replay found no non-finite value
    (``reproduced`` is then False). ``source`` is ``"file:line"`` of the
    user's code (for a gradient op: the forward op it differentiates, or the
    user's custom-gradient function), or None when no user frame was found.
    """

    type: str
    name: str
    source: str | None
    phase: str
    reproduced: bool
    detail: str
    layer: str | None = None

    def to_json(self) -> dict:
        """``{"type", "name", "source", "reproduced"}`` plus phase, layer, detail."""
        return dataclasses.asdict(self)

    @property
    def needs_loss(self) -> bool:
        """Not reproduced because no loss was at hand (a custom loop without
        ``loss_fn=``): the loss and backward phases were not replayed."""
        return not self.reproduced and _NO_LOSS in self.detail


@dataclasses.dataclass
class _Found:
    """What the eager replay saw at the first non-finite op."""

    type: str
    phase: str
    source: str | None
    layer: str | None
    name: str = ""


@dataclasses.dataclass
class _Step:
    """The step to replay: a model that may be changed, its loss, the data."""

    model: keras.Model
    loss: Callable[[Any], Any] | None  # y_pred -> scalar loss
    x: Any
    paths: dict[int, str]


def replay_step(
    model: keras.Model, bundle: ReproBundle, loss_fn: LossFn | None = None
) -> OpOrigin | None:
    """Replays ``bundle``'s step on a copy of ``model``; see the module docstring.

    Args:
        model: the trained model (left as it is).
        bundle: the incident's reproduction bundle (``load_bundle``).
        loss_fn: ``loss_fn(y, y_pred[, sample_weight])`` for a custom loop;
            by default a compiled model's own loss.

    Returns:
        The op, or None when there is no op to name (the batch itself is
        non-finite, an update-phase incident) or the replay failed (warned).
    """
    failed: Exception | None = None
    with captured_output.captured() as output:  # TensorFlow's check output, not printed
        try:
            origin = _replay(model, bundle, loss_fn)
        except Exception as error:  # noqa: BLE001 - the replay must never break the caller
            origin, failed = None, error
    _keep_output(bundle, output)
    if failed is not None:
        warnings.warn(f"NanWatch could not replay step {bundle.step}: {failed!r}", stacklevel=2)
    return origin


def _keep_output(bundle: ReproBundle, output: captured_output.Captured) -> None:
    """TensorFlow's output during the replay, into ``<bundle dir>/replay_tensorflow.txt``
    (bounded; it replaces an earlier replay's). Never raises: the replay's answer
    stands without it."""
    if not bundle.directory:
        return
    text = output.text
    if output.dropped_bytes:
        text += f"\n[{output.dropped_bytes} more bytes not kept]\n"
    try:
        bundle_files.write_member(bundle.directory, TENSORFLOW_OUTPUT, text.encode("utf-8"))
    except Exception as error:  # noqa: BLE001 - replay.json's own write says a refused dir
        logging.getLogger("tb_nanwatch").debug("NanWatch kept no replay output: %r", error)


def output_path(directory: str | None) -> str | None:
    """The path of the replay's TensorFlow output in the bundle dir ``directory``,
    None when none was kept."""
    if not directory:
        return None
    try:
        path = bundle_files.member(directory, TENSORFLOW_OUTPUT)
        exists = gfile().exists if run_dir_box.is_remote(path) else os.path.isfile
        return path if exists(path) else None
    except Exception:  # noqa: BLE001 - no path to name
        return None


def write_result(bundle: ReproBundle, origin: OpOrigin | None) -> str | None:
    """Writes ``{"step", "op"}`` to ``<bundle dir>/replay.json``; returns its
    path. Never through a symlink, never outside the run dir: a refused
    write is one warning line and None."""
    if not bundle.directory:
        raise ValueError("bundle has no directory: load it with tb_nanwatch.load_bundle")
    body = {"step": bundle.step, "op": None if origin is None else origin.to_json()}
    if output_path(bundle.directory) is not None:
        body["tensorflow_output"] = TENSORFLOW_OUTPUT  # the check output, kept, not printed
    text = json.dumps(body, indent=1)
    try:
        return bundle_files.write_member(bundle.directory, REPLAY_FILE, text.encode("utf-8"))
    except run_dir_box.RunDirError as error:
        logging.getLogger("tb_nanwatch").warning("NanWatch: %s", error)
        return None


def _replay(model: keras.Model, bundle: ReproBundle, loss_fn: LossFn | None) -> OpOrigin | None:
    incident = bundle.info.get("incident") or {}
    if incident.get("phase") in ("input", "update"):
        return None  # no op to name / the optimizer state is not in the bundle
    if bundle.incomplete_why:
        raise ValueError(bundle.incomplete_why)
    if not all(np.isfinite(a).all() for a in tf.nest.flatten(bundle.batch) if _is_float(a)):
        return None
    if not bundle.weights:
        raise ValueError("the bundle holds no pre-step weights")
    notes = [] if bundle.info.get("exact", True) else [_NOT_EXACT]
    with _replica(model, bundle, loss_fn) as step:
        found = _eager_pass(step)
        if found is not None:
            _name_in_graph(step, found)
        if step.loss is None:
            notes.append(_NO_LOSS)
    origin = _verdict(found, incident, bundle.step, notes)
    if not origin.reproduced:
        hint = not_reproduced_hint(bundle.info.get("run_facts") or {})
        if hint:
            origin = dataclasses.replace(origin, detail=f"{origin.detail}; {hint}")
    return origin


def not_reproduced_hint(facts: dict) -> str | None:
    """What to try when the eager float32-checked replay differs from the
    training: the step ran under XLA or mixed precision."""
    hints = []
    if facts.get("jit_compile"):
        hints.append(
            "the training step ran under XLA (jit_compile=True) and the replay runs "
            "eagerly without it: XLA fuses ops and can overflow where eager does not; "
            "train with jit_compile=False to see whether XLA makes the NaN"
        )
    if "float16" in str(facts.get("dtype_policy") or ""):
        hints.append(
            f"the training ran under mixed precision ({facts['dtype_policy']}) with a "
            "scaled loss, the replay's gradients are not scaled: try the float32 policy "
            "(keras.mixed_precision.set_global_policy('float32')) to see whether float16 "
            "makes the NaN"
        )
    return "; ".join(hints) or None


def _is_float(array: Any) -> bool:
    return isinstance(array, np.ndarray) and np.issubdtype(array.dtype, np.floating)


# -- the copy of the model ----------------------------------------------------


@contextlib.contextmanager
def _replica(model: keras.Model, bundle: ReproBundle, loss_fn: LossFn | None) -> Iterator[_Step]:
    """A model holding the bundle's weights that the replay may change."""
    replica = _clone(model, bundle, loss_fn)
    if replica is not None:
        yield _step(replica, bundle, loss_fn)
        return
    saved = [(v, np.array(v.numpy(), copy=True)) for v in _all_variables(model)]
    try:
        bundle.restore(model)
        yield _step(model, bundle, loss_fn)
    finally:
        for variable, value in saved:
            variable.assign(value)


def _clone(model: keras.Model, bundle: ReproBundle, loss_fn: LossFn | None) -> keras.Model | None:
    """A copy of ``model`` with the bundle's weights, or None when it cannot be copied."""
    try:
        replica = keras.models.clone_model(model)
        replica.set_weights(model.get_weights())
        _load_weights(replica, model, bundle)
        _compile_like(replica, model, loss_fn)
    except Exception:  # noqa: BLE001 - e.g. a subclassed model without get_config
        return None
    return replica


def _load_weights(replica: keras.Model, model: keras.Model, bundle: ReproBundle) -> None:
    """The bundle's weights into ``replica``, matched by their place in ``model``.

    A clone's variable paths can differ from the model's (a nested model's
    variables lose its name), its variable order does not; a model rebuilt
    elsewhere names them differently again (see ``match_arrays``).
    """
    paths = [v.path for v in model.trainable_weights]
    for target, value in match_arrays(bundle.weights, paths, replica.trainable_weights):
        target.assign(value)


def _all_variables(model: keras.Model) -> list:
    unique = {id(v): v for v in [*model.variables, *model.metrics_variables]}
    return list(unique.values())


def _compile_like(replica: keras.Model, model: keras.Model, loss_fn: LossFn | None) -> None:
    """Gives the copy the model's compiled loss (not its optimizer)."""
    if loss_fn is not None or getattr(model, "loss", None) is None:
        return
    weights = model.get_compile_config().get("loss_weights")
    replica.compile(optimizer="sgd", loss=model.loss, loss_weights=weights)


def _step(model: keras.Model, bundle: ReproBundle, loss_fn: LossFn | None) -> _Step:
    batch = bundle.batch if isinstance(bundle.batch, list) else [bundle.batch]
    x, y, sample_weight = (list(batch) + [None, None])[:3]
    loss = None
    if loss_fn is not None and y is not None:
        extra = () if sample_weight is None else (sample_weight,)
        loss = lambda y_pred: loss_fn(y, y_pred, *extra)  # noqa: E731
    elif getattr(model, "loss", None) is not None:
        loss = lambda y_pred: model.compute_loss(  # noqa: E731
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
        )
    return _Step(model, loss, x, layer_paths(model))


# -- the eager replay under check_numerics --------------------------------------


@contextlib.contextmanager
def _numeric_checks() -> Iterator[None]:
    """check_numerics on, traceback filtering off; all restored afterwards."""
    from tensorflow.python.debug.lib import check_numerics_callback

    was_checking = getattr(check_numerics_callback._state, "check_numerics_callback", None)
    keras_filtering = keras.config.is_traceback_filtering_enabled()
    tf_filtering = tf.debugging.is_traceback_filtering_enabled()
    keras.config.disable_traceback_filtering()
    tf.debugging.disable_traceback_filtering()
    tf.debugging.enable_check_numerics()
    try:
        yield
    finally:
        if was_checking is None:
            tf.debugging.disable_check_numerics()
        if keras_filtering:
            keras.config.enable_traceback_filtering()
        if tf_filtering:
            tf.debugging.enable_traceback_filtering()


def _eager_pass(step: _Step) -> _Found | None:
    """Runs forward, loss and backward eagerly; the first non-finite op, if any."""
    phase = "forward"
    with _numeric_checks():
        try:
            with tf.GradientTape() as tape:
                y_pred = step.model(step.x, training=True)
                if step.loss is None:
                    return None
                phase = "loss"
                loss = step.loss(y_pred)
            phase = "backward"
            tape.gradient(loss, step.model.trainable_variables)
        except tf.errors.InvalidArgumentError as error:
            if _CHECK_MARKER not in str(error):
                raise
            return _found_in(error, phase, step.paths)
    return None


def _found_in(error: Exception, phase: str, paths: dict[int, str]) -> _Found:
    """The op type (from the message), the user's line and the layer (from the traceback)."""
    match = _EAGER_OP.search(str(error))
    walked = list(traceback.walk_tb(error.__traceback__))
    layer = None
    for frame, _ in reversed(walked):
        candidate = frame.f_locals.get("self")
        if frame.f_code.co_name == "__call__" and id(candidate) in paths:
            layer = paths[id(candidate)]
            break
    lines = [(frame.f_code.co_filename, line) for frame, line in walked]
    return _Found(match.group(1) if match else "", phase, _user_line(lines), layer)


def _internal_dirs() -> tuple[str, ...]:
    import tb_nanwatch

    packages = (tf, keras, tb_nanwatch)
    dirs = [os.path.dirname(os.path.realpath(p.__file__)) for p in packages]
    dirs.append(os.path.realpath(sysconfig.get_paths()["stdlib"]))
    return tuple(d + os.sep for d in dirs)


def _user_line(lines: list[tuple[str, int]]) -> str | None:
    """``file:line`` of the innermost frame outside TF, Keras, tb_nanwatch, stdlib."""
    internal = _internal_dirs()
    for filename, line in reversed(lines):
        if filename.startswith("<") or os.path.realpath(filename).startswith(internal):
            continue
        return f"{filename}:{line}"
    return None


# -- the traced replay: op names, gradient op -> forward op -------------------------


def _name_in_graph(step: _Step, found: _Found) -> None:
    """Names ``found`` from a traced replay; maps a TF gradient op to its forward op."""
    try:
        op = _failing_graph_op(step)
    except Exception as error:  # noqa: BLE001 - the eager answer stands without a name
        found.name = found.type
        warnings.warn(f"NanWatch could not trace the replayed step: {error!r}", stacklevel=3)
        return
    if op is None or op.type != found.type:
        found.name = found.type
        return
    known = {layer.name for layer in step.model._flatten_layers()}
    top = step.model.name
    found.name = _clean_name(op.name, known, top)
    if found.phase == "backward" and found.source is None:
        forward = _forward_op_of(op)
        if forward is not None:
            found.source = _user_line([(f.filename, f.lineno) for f in forward.traceback])
            found.layer = _layer_of(_clean_name(forward.name, known, top), step.paths)


def _failing_graph_op(step: _Step) -> tf.Operation | None:
    def traced(x):
        with tf.GradientTape() as tape:
            y_pred = step.model(x, training=True)
            loss = step.loss(y_pred) if step.loss is not None else None
        if loss is not None:
            tape.gradient(loss, step.model.trainable_variables)
        return y_pred

    x = tf.nest.map_structure(tf.convert_to_tensor, step.x)
    with _numeric_checks():
        concrete = tf.function(traced).get_concrete_function(x)
        try:
            concrete(x)
        except tf.errors.InvalidArgumentError as error:
            match = _GRAPH_NODE.search(str(error))
            if match is None:
                return None
            try:
                return concrete.graph.get_operation_by_name(match.group(1))
            except KeyError:  # the check names a scope, not an op (a constant's check)
                return None
    return None


def _forward_op_of(gradient_op: tf.Operation) -> tf.Operation | None:
    """The forward op whose gradient ``gradient_op`` computes.

    Gradient ops live in ``gradient_tape/<forward op's scope>/`` and read the
    forward op's outputs (``SqrtGrad`` reads ``Sqrt:0``) or inputs (``Log``'s
    gradient reads ``x``): walk back through the gradient ops to the forward
    tensors they read, then take the forward op of that scope which produced
    or consumed one of them.
    """
    scope = gradient_op.name[len(_GRADIENT_SCOPE) :].rpartition("/")[0]
    pending, seen, read = [gradient_op], set(), []
    while pending and len(seen) < _MAX_GRADIENT_OPS:
        op = pending.pop(0)
        for tensor in op.inputs:
            if tensor.op.name in seen:
                continue
            seen.add(tensor.op.name)
            gradient = tensor.op.name.startswith(_GRADIENT_SCOPE)
            (pending if gradient else read).append(tensor.op if gradient else tensor)
    in_scope = lambda op: op.name.rpartition("/")[0] == scope  # noqa: E731
    for tensor in read:
        if in_scope(tensor.op):
            return tensor.op
    for tensor in read:
        for consumer in tensor.consumers():
            if in_scope(consumer):
                return consumer
    return None


def _clean_name(name: str, known: set[str], top: str) -> str:
    """Drops the top model's scope and the ``_1`` tracing adds to Keras scopes."""
    parts = [_known_scope(p, known) for p in name.split("/")[:-1]] + name.split("/")[-1:]
    start = 1 if parts[0] == _GRADIENT_SCOPE.rstrip("/") else 0
    if len(parts) > start + 1 and parts[start] == top:
        del parts[start]
    return "/".join(parts)


def _known_scope(part: str, known: set[str]) -> str:
    base = re.sub(r"_\d+$", "", part)
    return base if part not in known and base in known else part


def _layer_of(op_name: str, paths: dict[int, str]) -> str | None:
    scope = op_name.removeprefix(_GRADIENT_SCOPE).rpartition("/")[0]
    while scope:
        if scope in paths.values():
            return scope
        scope = scope.rpartition("/")[0]
    return None


# -- the verdict ---------------------------------------------------------------


def _verdict(found: _Found | None, incident: dict, step: int, notes: list[str]) -> OpOrigin:
    where = f"{incident.get('phase')} phase, layer {incident.get('layer')!r}"
    if found is None:
        detail = f"the replay of step {step} stayed finite (the incident: {where})"
        return OpOrigin("", "", None, "", False, "; ".join([detail, *notes]))
    reproduced = found.phase == incident.get("phase") and _same_layer(
        found.layer, incident.get("layer"), found.phase
    )
    seen = f"{found.type} in the {found.phase} phase" + (
        f" of layer {found.layer!r}" if found.layer else ""
    )
    detail = f"replayed step {step}: {seen}" + (
        "" if reproduced else f"; the incident was in the {where}"
    )
    detail = "; ".join([detail, *notes])
    return OpOrigin(
        found.type, found.name, found.source, found.phase, reproduced, detail, found.layer
    )


def _same_layer(found: str | None, recorded: str | None, phase: str) -> bool:
    if phase == "loss" or not found or not recorded:
        return True
    recorded = recorded.split("#")[0]
    return found == recorded or recorded.startswith(found + "/") or found.startswith(recorded + "/")


def describe(step: int, origin: OpOrigin | None) -> str:
    """One paragraph for the console: the op, its source line, reproduced or not."""
    if origin is None:
        return f"step {step}: no op to name (the batch itself, an update-phase incident, or the replay failed)"
    if not origin.type:
        return f"step {step}: not reproduced: {origin.detail}"
    verdict = "reproduced" if origin.reproduced else "NOT reproduced"
    return (
        f"step {step}: first non-finite value from op {origin.type} ({origin.name}), "
        f"{origin.phase} phase\n  source: {origin.source or 'no user frame found'}\n"
        f"  {verdict}: {origin.detail}"
    )
