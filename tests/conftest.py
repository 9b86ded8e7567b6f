"""Fixtures shared by the test modules.

Helpers that are plain functions (writing runs, starting TensorBoard, reading
routes) live in ``nanwatch_testlib``; the Keras scenarios in ``scenarios``.
"""

import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


@pytest.fixture
def mixed_precision():
    """Keras' global dtype policy is ``mixed_float16`` for the test, then float32 again."""
    import keras

    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


@pytest.fixture
def seeded():
    """Keras, NumPy and Python's random generators seeded with 0 (as ``set_random_seed`` does)."""
    import keras

    keras.utils.set_random_seed(0)
