"""The file system a run dir lives on, local or remote (``gs://``, ``ram://``).

``gfile()`` is ``tf.io.gfile`` reached through TensorBoard's lazy loader
(``tensorboard.compat.tf``): TensorFlow is imported only when a path first
needs it, so the modules that write the record import without TensorFlow.
"""

from __future__ import annotations

from types import ModuleType


def gfile() -> ModuleType:
    """``tf.io.gfile`` (TensorBoard's stand-in where TensorFlow is not installed)."""
    from tensorboard.compat import tf

    return tf.io.gfile
