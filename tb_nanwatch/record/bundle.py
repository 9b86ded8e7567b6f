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
answer is written beside it as ``replay.json`` (``tb_nanwatch.record.replay``).
"""

from __future__ import annotations

import dataclasses
import io
import json
import posixpath
from typing import Any

import numpy as np

BUNDLE_DIR = "repro"
MODEL_FILE = "model.keras"
REPLAY_FILE = "replay.json"


def _gfile():
    import tensorflow as tf

    return tf.io.gfile


def _rebuild(structure: Any, flat: list[np.ndarray]) -> Any:
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


def _jsonable_structure(structure: Any) -> Any:
    if isinstance(structure, dict):
        return {str(k): _jsonable_structure(v) for k, v in structure.items()}
    if isinstance(structure, (list, tuple)):
        return [_jsonable_structure(v) for v in structure]
    return None if structure is None else 0


def save_bundle(
    run_dir: str,
    step: int,
    weights: dict[str, np.ndarray],
    batch: list[np.ndarray],
    batch_structure: Any,
    info: dict,
) -> str:
    """Writes a bundle; returns its path relative to ``run_dir``."""
    gfile = _gfile()
    relative = posixpath.join(BUNDLE_DIR, f"step_{step:09d}")
    directory = posixpath.join(run_dir, relative)
    gfile.makedirs(directory)
    arrays: dict[str, np.ndarray] = {f"batch/{i}": a for i, a in enumerate(batch) if a is not None}
    arrays.update({f"weights/{name}": a for name, a in weights.items()})
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    with gfile.GFile(posixpath.join(directory, "bundle.npz"), "wb") as f:
        f.write(buffer.getvalue())
    meta = {
        "step": step,
        "batch_structure": _jsonable_structure(batch_structure),
        "batch_size": len(batch),
        "batch_not_kept": [i for i, a in enumerate(batch) if a is None],
        "weights": list(weights),
        **info,
    }
    with gfile.GFile(posixpath.join(directory, "bundle.json"), "w") as f:
        f.write(json.dumps(meta, indent=1, allow_nan=True))
    return relative


@dataclasses.dataclass
class ReproBundle:
    """The offending batch and the weights before the offending step."""

    step: int
    batch: Any  # the step's data as the train step got it: (x, y) or (x, y, sample_weight)
    weights: dict[str, np.ndarray]  # by Keras variable path
    info: dict
    directory: str = ""  # where it was loaded from

    @property
    def x(self) -> Any:
        return self.batch[0] if isinstance(self.batch, list) else self.batch

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
        by_path = {v.path: v for v in model.trainable_weights}
        missing = [p for p in self.weights if p not in by_path]
        if missing:
            raise ValueError(f"model has no variables named {missing[:3]}")
        for path, value in self.weights.items():
            by_path[path].assign(value)


def _find_bundle_dir(path: str) -> str:
    gfile = _gfile()
    if gfile.exists(posixpath.join(path, "bundle.json")):
        return path
    candidates = sorted(gfile.glob(posixpath.join(path, BUNDLE_DIR, "step_*")))
    if not candidates:
        raise FileNotFoundError(f"no reproduction bundle under {path!r}")
    return candidates[0]


def load_bundle(path: str) -> ReproBundle:
    """Loads the (first) bundle of a run dir, or the bundle dir itself."""
    gfile = _gfile()
    directory = _find_bundle_dir(path)
    with gfile.GFile(posixpath.join(directory, "bundle.json"), "r") as f:
        meta = json.loads(f.read())
    with gfile.GFile(posixpath.join(directory, "bundle.npz"), "rb") as f:
        arrays = np.load(io.BytesIO(f.read()))
        batch = [arrays.get(f"batch/{i}") for i in range(meta["batch_size"])]
        weights = {name: arrays[f"weights/{name}"] for name in meta["weights"]}
    structure = meta.pop("batch_structure")
    return ReproBundle(
        step=int(meta["step"]),
        batch=_rebuild(structure, batch),
        weights=weights,
        info=meta,
        directory=directory,
    )


def _update_meta(directory: str, changes: dict) -> None:
    gfile = _gfile()
    path = posixpath.join(directory, "bundle.json")
    with gfile.GFile(path, "r") as f:
        meta = json.loads(f.read())
    # Removed first: some file systems (ram://) do not truncate a file opened
    # for writing, and a shorter body would leave the old tail behind.
    gfile.remove(path)
    with gfile.GFile(path, "w") as f:
        f.write(json.dumps({**meta, **changes}, indent=1, allow_nan=True))


def save_model(directory: str, model, loss_fn=None) -> bool:
    """Saves ``model`` (and a custom loop's ``loss_fn``) beside a bundle.

    Writes ``<directory>/model.keras``; ``bundle.json`` gets ``"model"`` (the
    file name, or None and ``"model_not_saved"``: why) and, for ``loss_fn``,
    ``"replay_loss"`` (its Keras serialization, or None and
    ``"replay_loss_not_saved"``). Returns whether the model was saved; never
    raises for a model that cannot be serialized.
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
    _update_meta(directory, changes)
    return changes["model"] is not None


def load_model(bundle: ReproBundle, unsafe: bool = False) -> tuple[Any, Any]:
    """The model saved beside ``bundle`` and its replay loss (or None).

    Raises FileNotFoundError when no model was saved (saying why), and
    ValueError when the model holds Python code (a ``Lambda``) and ``unsafe``
    is False: loading it runs that code, so only do it for a trusted run dir.
    """
    import keras

    if not bundle.info.get("model"):
        reason = bundle.info.get("model_not_saved", "it was recorded without one")
        raise FileNotFoundError(f"no model saved beside the bundle in {bundle.directory}: {reason}")
    path = posixpath.join(bundle.directory, bundle.info["model"])
    if not _gfile().exists(path):
        raise FileNotFoundError(f"the bundle's model file {path} is missing")
    model = keras.saving.load_model(path, safe_mode=not unsafe)
    loss = bundle.info.get("replay_loss")
    return model, None if loss is None else keras.saving.deserialize_keras_object(loss)
