"""The bench's floors measure what they say: ``floor_counts`` hands over, with
the floor's bare sums, the exact NaN/Inf count of every tensor it sums."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH)

from realistic_child import FloorRecorder  # noqa: E402


def _rows(x: np.ndarray, exact_counts: bool, jit_compile: bool) -> tuple[list, int, bool]:
    """The rows handed over by two steps of a linear two-layer model on ``x``
    (batch of 5), the number of tensors summed, and whether XLA compiled it."""
    import keras

    from tb_nanwatch.record.in_step import train_step

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])
    model.compile(keras.optimizers.SGD(0.01), "mse", jit_compile=jit_compile)
    floor = FloorRecorder(model, exact_counts=exact_counts)
    rows = []
    floor.hand_over = lambda row: rows.append(row.numpy())
    floor.taps.install()
    train_step.instrument(model, floor)
    model.fit(x, np.zeros((5, 2), "float32"), batch_size=5, epochs=2, verbose=0)
    return rows, floor.tensors_read, bool(model.jit_compile)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_floor_counts_hands_over_exact_counts_beside_the_sums(jit_compile):
    x = np.arange(20, dtype="float32").reshape(5, 4) / 20
    clean, n, in_xla = _rows(x, exact_counts=True, jit_compile=jit_compile)
    assert in_xla == jit_compile  # XLA stayed on where asked
    bare, n_bare, _ = _rows(x, exact_counts=False, jit_compile=jit_compile)
    assert n == n_bare and len(bare[0]) == n  # the same tensors summed
    assert [len(r) for r in clean] == [3 * n, 3 * n]  # sums, then [nan, inf] of each
    np.testing.assert_allclose(clean[0][:n], bare[0], rtol=1e-6)
    assert not clean[0][n:].any()

    x[0, 0] = np.nan  # row 0 of every activation goes NaN, then the loss and all after it
    rows, _, _ = _rows(x, exact_counts=True, jit_compile=jit_compile)
    sums, counts = rows[0][:n], rows[0][n:].reshape(n, 2)
    assert (np.isnan(sums) == (counts[:, 0] > 0)).all()
    assert not counts[:, 1].any()  # no Inf anywhere
    # The first layer's output (3 units) and the model's (2): one row NaN each.
    assert counts[0, 0] == 3 and counts[1, 0] == 2
    assert np.isnan(sums).sum() > 2  # gradients and weights went NaN too, and were counted
