"""What the run summary says about the model when training begins.

The cause verdict (:mod:`tb_nanwatch.causes`) reads these run-summary keys:

* ``"weights_at_start": {"checked": int, "nonfinite": [variable path, ...]}``:
  every floating-point weight checked once, eagerly, before the first step
  (so a NaN in a pretrained table or a checkpoint is told apart from one the
  training made);
* ``"dtype_policy"``: the model's Keras dtype policy name (``"mixed_float16"``);
* ``"loss_from_logits"``: whether the loss reads logits (None: not known).
"""

from __future__ import annotations

import warnings

import keras
import tensorflow as tf


def weights_at_start(model: keras.Model) -> dict | None:
    """``{"checked", "nonfinite"}`` from one pass over the weights (one
    device-to-host read of a flag per weight), or None after a warning."""
    try:
        unique = {id(v): v for v in model.weights}.values()
        floats = [v for v in unique if keras.backend.is_float_dtype(v.dtype)]
        if not floats:
            return {"checked": 0, "nonfinite": []}
        flags = tf.stack(
            [tf.reduce_all(tf.math.is_finite(tf.convert_to_tensor(v))) for v in floats]
        ).numpy()
    except Exception as error:  # noqa: BLE001 - never break the user's training
        warnings.warn(
            f"NanWatch could not check the weights at the start: {error!r}",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return {
        "checked": len(floats),
        "nonfinite": [v.path for v, finite in zip(floats, flags, strict=True) if not finite],
    }


def dtype_policy(model: keras.Model) -> str:
    """The model's dtype policy name (the global policy for a model without one)."""
    policy = getattr(model, "dtype_policy", None) or keras.config.dtype_policy()
    return str(getattr(policy, "name", policy))


def loss_from_logits(loss) -> bool | None:
    """Whether ``loss`` (a compiled loss or a custom loop's ``loss_fn``)
    reads logits: a loss object's ``from_logits``; a crossentropy named by a
    string reads probabilities; None when not known (several differing losses,
    a plain function)."""
    if isinstance(loss, (list, tuple, dict)):
        values = {loss_from_logits(item) for item in tf.nest.flatten(loss)}
        return values.pop() if len(values) == 1 else None
    if isinstance(loss, str):
        return False if "crossentropy" in loss else None
    from_logits = getattr(loss, "from_logits", None)
    if from_logits is None:
        from_logits = getattr(loss, "_fn_kwargs", {}).get("from_logits")
    return from_logits if isinstance(from_logits, bool) else None


def run_info(model: keras.Model, loss) -> dict:
    """The three run-summary keys (``weights_at_start`` only when checked)."""
    info = {"dtype_policy": dtype_policy(model), "loss_from_logits": loss_from_logits(loss)}
    checked = weights_at_start(model)
    if checked is not None:
        info["weights_at_start"] = checked
    return info
