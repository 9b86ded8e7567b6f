"""Reproduction bundles: the batch and the weights that produced an incident.

Saved in ``<run dir>/repro/step_<N>/`` as ``bundle.npz`` (arrays) and
``bundle.json`` (names, the batch structure, what was captured), so the run
dir stays self-contained. Reload with one line::

    bundle = tb_nanwatch.load_bundle("logs/run1")   # the run dir or the bundle dir

then ``bundle.restore(model)`` puts the weights as they were *before* the
offending step back into the model, and ``model.train_on_batch(*bundle.batch)``
replays the step.

The model may travel with the bundle (``save_model``: ``model.keras`` beside
it, or the reason it could not be saved in ``bundle.json``), so that
``tb-nanwatch replay RUN_DIR`` works on a run dir someone sent; the replay's
answer is written beside it as ``replay.json`` (``tb_nanwatch.record.after_incident.replay``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import posixpath
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np

from tb_nanwatch.evidence import limits, run_dir_box
from tb_nanwatch.record.after_incident import bundle_files
from tb_nanwatch.record.after_incident.bundle_files import BUNDLE_DIR

MODEL_FILE = "model.keras"
# Beside a rewind point without a bundle (an explosion): what bundle.json says of the model.
MODEL_META = "model.json"
REWIND_DIR = "repro/rewind"
REPLAY_FILE = "replay.json"


def rebuild_batch(structure: Any, flat: list[np.ndarray]) -> Any:
    """The nested batch from its flat arrays and ``structure`` (tuples as lists)."""
    items = iter(flat)

    def build(node):
        if isinstance(node, dict):
            # tf.nest flattens dicts in sorted key order.
            return {k: build(node[k]) for k in sorted(node)}
        if isinstance(node, list):
            return [build(v) for v in node]
        if node is None:
            return None
        return next(items)

    return build(structure)


def jsonable_structure(structure: Any) -> Any:
    """A batch's nest structure as JSON, a 0 for each tensor (None stays None)."""
    if isinstance(structure, dict):
        return {str(k): jsonable_structure(v) for k, v in structure.items()}
    if isinstance(structure, (list, tuple)):
        return [jsonable_structure(v) for v in structure]
    return None if structure is None else 0


def _loadable(array: np.ndarray) -> np.ndarray:
    """``array`` as a reader loads it without pickles: a string tensor's object
    array of bytes as a fixed-width bytes array (TensorFlow reads it back as
    ``tf.string``); other object arrays as they are (the loader refuses them)."""
    array = np.asarray(array)
    if array.dtype == object and all(isinstance(v, bytes) for v in array.flat):
        return array.astype(np.bytes_)
    return array


def save_bundle(
    run_dir: str,
    step: int,
    weights: dict[str, np.ndarray],
    batch: list[np.ndarray],
    batch_structure: Any,
    info: dict,
) -> str:
    """Writes a bundle; returns its path relative to ``run_dir``.

    ``info`` goes into ``bundle.json``, except ``info["optimizer"]`` (when
    given): the optimizer's variables before the step by path (slots and
    iterations), written as the arrays ``optimizer/<path>`` and listed in
    ``bundle.json``'s ``"optimizer_variables"``.
    """
    info = dict(info)
    optimizer: dict[str, np.ndarray] = info.pop("optimizer", None) or {}
    relative = posixpath.join(BUNDLE_DIR, f"step_{step:09d}")
    directory = posixpath.join(run_dir, relative)
    arrays = {f"batch/{i}": _loadable(a) for i, a in enumerate(batch) if a is not None}
    arrays.update({f"weights/{name}": a for name, a in weights.items()})
    arrays.update({f"optimizer/{name}": np.asarray(a) for name, a in optimizer.items()})
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    bundle_files.write_member(directory, "bundle.npz", buffer.getvalue())
    meta = {
        "step": step,
        "batch_structure": jsonable_structure(batch_structure),
        "batch_size": len(batch),
        "batch_not_kept": [i for i, a in enumerate(batch) if a is None],
        "weights": list(weights),
        "optimizer_variables": list(optimizer),
        **info,
    }
    text = json.dumps(meta, indent=1, allow_nan=True)
    bundle_files.write_member(directory, "bundle.json", text.encode("utf-8"))
    return relative


@dataclasses.dataclass
class ReproBundle:
    """The offending batch and the weights before the offending step."""

    step: int
    batch: Any  # the step's data as the train step got it: (x, y) or (x, y, sample_weight)
    weights: dict[str, np.ndarray]  # by Keras variable path
    info: dict
    directory: str = ""  # where it was loaded from
    # The optimizer's variables before the step, by path ({} when not recorded).
    optimizer: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    @property
    def x(self) -> Any:
        return self.batch[0] if isinstance(self.batch, list) else self.batch

    @property
    def incomplete_why(self) -> str | None:
        """Why the bundle cannot re-run its step (its batch is not held whole:
        a sparse or ragged part), None when it can."""
        why = self.info.get("batch_incomplete")
        return f"the bundle does not hold the whole batch: {why}" if why else None

    @property
    def y(self) -> Any:
        return self.batch[1] if isinstance(self.batch, list) and len(self.batch) > 1 else None

    def restore(self, model) -> None:
        """Assigns the saved weights to ``model``'s variables of the same path."""
        if not self.weights:
            raise ValueError(
                "this bundle holds no weights (recorded with pre_step_weights='off', or "
                "'on_suspect' for an update-phase incident)"
            )
        variables = model.trainable_weights
        for variable, value in match_arrays(self.weights, [v.path for v in variables], variables):
            variable.assign(value)


def match_arrays(
    recorded: dict[str, np.ndarray], paths: list[str], variables: list
) -> list[tuple[Any, np.ndarray]]:
    """Pairs each recorded array with its variable among ``variables``.

    ``paths`` names ``variables`` as the recording model named them (the same
    order). By path when every recorded path is there; else by position when
    the recorded arrays are as many as the variables and their shapes agree
    in order: a model rebuilt in another process (or a clone) names its
    variables differently (``dense/kernel`` for ``sequential/dense_1/kernel``).
    A ValueError says what did not fit.
    """
    index = {path: i for i, path in enumerate(paths)}
    if len(paths) == len(variables) and all(p in index for p in recorded):
        pairs = [(variables[index[p]], value) for p, value in recorded.items()]
    elif len(recorded) == len(variables):
        pairs = list(zip(variables, recorded.values(), strict=True))
    else:
        missing = [p for p in recorded if p not in index][:3]
        raise ValueError(
            f"model has no variables named {missing} and {len(variables)} variables "
            f"for the {len(recorded)} recorded"
        )
    for variable, value in pairs:
        if tuple(variable.shape) != tuple(np.shape(value)):
            raise ValueError(
                f"the model's variable {variable.path} has shape {tuple(variable.shape)}, "
                f"the recorded one {tuple(np.shape(value))}"
            )
    return pairs


def load_bundle(path: str) -> ReproBundle:
    """Loads the (first) bundle of a run dir, or the bundle dir itself.

    Its files are read only inside the run dir and within the limits of
    :mod:`tb_nanwatch.evidence.limits` (see :mod:`~tb_nanwatch.record.after_incident.bundle_files`);
    a problem is one line: a ValueError or FileNotFoundError.
    """
    directory = bundle_files.find_bundle_dir(path)
    meta = bundle_files.read_meta(directory)
    names = meta.get("optimizer_variables") or []
    arrays = bundle_files.read_arrays(
        directory,
        [f"weights/{name}" for name in meta.get("weights") or []]
        + [f"optimizer/{name}" for name in names],
        [f"batch/{i}" for i in range(meta["batch_size"])],
    )
    batch = [arrays.get(f"batch/{i}") for i in range(meta["batch_size"])]
    weights = {name: arrays[f"weights/{name}"] for name in meta.get("weights") or []}
    optimizer = {name: arrays[f"optimizer/{name}"] for name in names}
    structure = meta.pop("batch_structure")
    return ReproBundle(
        step=int(meta["step"]),
        batch=rebuild_batch(structure, batch),
        weights=weights,
        info=meta,
        directory=directory,
        optimizer=optimizer,
    )


def _update_meta(directory: str, changes: dict, name: str = "bundle.json") -> None:
    meta = bundle_files.read_json(directory, name) if name == "bundle.json" else {}
    text = json.dumps({**meta, **changes}, indent=1, allow_nan=True)
    bundle_files.write_member(directory, name, text.encode("utf-8"))


def save_model(
    directory: str, model, loss_fn=None, optimizer=None, meta_file: str = "bundle.json"
) -> bool:
    """Saves ``model`` (and a custom loop's ``loss_fn``) beside a bundle, or
    beside a rewind point (``meta_file=MODEL_META``: an explosion has no bundle).

    Writes ``<directory>/model.keras``; ``bundle.json`` gets ``"model"`` (the
    file name, or None and ``"model_not_saved"``: why) and, for ``loss_fn``,
    ``"replay_loss"`` (its Keras serialization, or None and
    ``"replay_loss_not_saved"``). It also gets what a replay elsewhere needs:
    ``"optimizer_config"`` (``optimizer``'s, else the model's, Keras
    serialization: the remedy trials build a fresh one from it),
    ``"custom_objects"`` (the classes and functions from outside Keras the
    model and the loss use: ``{"name", "registered_name", "module"}``, so a
    replay can say which module to import) and ``"run_facts"`` (``jit_compile``,
    ``dtype_policy``). Returns whether the model was saved; never raises for a
    model that cannot be serialized.
    """
    import keras

    changes: dict[str, Any] = {"model": MODEL_FILE}
    try:
        model.save(posixpath.join(directory, MODEL_FILE))
    except Exception as error:  # noqa: BLE001 - a model that cannot be serialized
        changes = {"model": None, "model_not_saved": f"{type(error).__name__}: {error}"}
    if loss_fn is not None:
        try:
            serialized = keras.saving.serialize_keras_object(loss_fn)
            changes["replay_loss"] = json.loads(json.dumps(serialized))
        except Exception as error:  # noqa: BLE001
            changes["replay_loss"] = None
            changes["replay_loss_not_saved"] = f"{type(error).__name__}: {error}"
    changes.update(_replay_facts(model, loss_fn, optimizer))
    _update_meta(directory, changes, meta_file)
    return changes["model"] is not None


def _replay_facts(model, loss_fn, optimizer) -> dict:
    """``optimizer_config``, ``custom_objects`` and ``run_facts`` (see save_model);
    a fact that cannot be read is left out."""
    import keras

    facts: dict[str, Any] = {}
    optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
    try:
        if optimizer is not None:
            config = keras.optimizers.serialize(optimizer)
            facts["optimizer_config"] = json.loads(json.dumps(config))
    except Exception:  # noqa: BLE001 - the trials then say the optimizer is not known
        pass
    try:
        facts["custom_objects"] = custom_objects(model, loss_fn)
        facts["run_facts"] = {
            "jit_compile": bool(getattr(model, "jit_compile", False)),
            "dtype_policy": getattr(getattr(model, "dtype_policy", None), "name", None),
        }
    except Exception:  # noqa: BLE001
        pass
    return facts


_LIBRARIES = ("keras", "tf_keras", "tensorflow", "tb_nanwatch", "builtins")


def custom_objects(model, loss_fn=None) -> list[dict]:
    """The classes (and ``loss_fn``) outside Keras and TensorFlow that
    ``model`` is made of: ``{"name", "registered_name", "module"}`` each, once."""
    import keras

    found: dict[str, dict] = {}
    things = [type(layer) for layer in model._flatten_layers(include_self=True, recursive=True)]
    if loss_fn is not None:
        # A function or class names itself; a loss object, its class.
        things.append(loss_fn if hasattr(loss_fn, "__name__") else type(loss_fn))
    for thing in things:
        module = getattr(thing, "__module__", None) or ""
        if module.split(".")[0] in _LIBRARIES:
            continue
        name = getattr(thing, "__name__", type(thing).__name__)
        found.setdefault(
            f"{module}.{name}",
            {
                "name": name,
                "registered_name": keras.saving.get_registered_name(thing),
                "module": module,
            },
        )
    return list(found.values())


def load_model_beside_rewind_point(
    run_dir: str, unsafe: bool = False, custom_objects: dict | None = None
) -> tuple[Any, Any, dict]:
    """The model saved beside ``run_dir``'s rewind point (a run without a
    bundle: an explosion), its replay loss and what ``model.json`` says of it;
    FileNotFoundError when there is none (see :func:`load_model`)."""
    directory = posixpath.join(run_dir, REWIND_DIR)
    try:
        info = bundle_files.read_json(directory, MODEL_META)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no reproduction bundle or rewind point under {run_dir!r}"
        ) from None
    holder = ReproBundle(step=-1, batch=None, weights={}, info=info, directory=directory)
    model, loss = load_model(holder, unsafe, custom_objects)
    return model, loss, info


def load_model(
    bundle: ReproBundle, unsafe: bool = False, custom_objects: dict | None = None
) -> tuple[Any, Any]:
    """The model saved beside ``bundle`` and its replay loss (or None).

    Raises FileNotFoundError when no model was saved (saying why), and
    ValueError when the model holds Python code (a ``Lambda``) and ``unsafe``
    is False: loading it runs that code, so only do it for a trusted run dir.
    ``custom_objects``: classes and functions by name, for those not
    registered with Keras.
    """
    import keras

    # The schedules a rewind sets on the optimizer, registered before a model names them.
    from tb_nanwatch.record.after_incident import schedules  # noqa: F401

    if not bundle.info.get("model"):
        reason = bundle.info.get("model_not_saved", "it was recorded without one")
        raise FileNotFoundError(f"no model saved beside the bundle in {bundle.directory}: {reason}")
    data = bundle_files.read_member(
        bundle.directory, bundle.info["model"], limits.max_bundle_bytes(), "the bundle's model"
    )
    run_dir = bundle_files.bundle_box(bundle.directory)[0]
    # A private copy: Keras opens it by name, and the run dir may change under it.
    with tempfile.TemporaryDirectory(prefix="nanwatch-model-") as private:
        path = os.path.join(private, MODEL_FILE)
        with open(path, "xb") as copy:
            copy.write(data)
        del data
        with imports_outside(run_dir):
            model = keras.saving.load_model(
                path, custom_objects=custom_objects, safe_mode=not unsafe
            )
            loss = bundle.info.get("replay_loss")
            if loss is None:
                return model, None
            return model, keras.saving.deserialize_keras_object(
                loss, custom_objects=custom_objects, safe_mode=not unsafe
            )


@contextlib.contextmanager
def imports_outside(run_dir: str) -> Iterator[None]:
    """While the block runs, ``sys.path`` holds no entry inside ``run_dir``
    (the current directory included, when it is inside): no import, Keras'
    lookup of a class's module included, can load code the run dir carries."""
    saved = list(sys.path)
    if not run_dir_box.is_remote(run_dir):
        sys.path[:] = [p for p in saved if not run_dir_box.within(run_dir, p or os.curdir)]
    try:
        yield
    finally:
        sys.path[:] = saved
