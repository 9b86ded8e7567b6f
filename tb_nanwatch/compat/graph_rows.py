"""The host side of a TF1 graph's record: what the train op hands over.

The train op :mod:`~tb_nanwatch.compat.graph_step` builds ends with a
``tf.numpy_function`` that gives the step's statistics vector to
:meth:`GraphRows.receive_row`, inside the user's own ``sess.run`` (the one
device-to-host read of the step; no second run). On a step that may be
non-finite, before the update, a second one hands over the fed batch and the
weights as they were before the step (:meth:`GraphRows.receive_capture`):
the reproduction bundle.

:class:`GraphRows` is the device record a
:class:`~tb_nanwatch.record.session.WatchSession` reads (``fetch_rows``).
"""

from __future__ import annotations

import collections
import threading

import numpy as np

# The per-replica view is not computed for a graph (one replica).
_ONE_REPLICA = np.array([-1.0], np.float32)
# Captures kept at most (a run going on after an incident captures every step).
MAX_CAPTURES = 4


class GraphRows:
    """Rows and pre-step captures handed over by the train op, in order."""

    def __init__(self, variable_names: list[str], input_names: list[str]) -> None:
        self.variable_names = list(variable_names)
        self.input_names = list(input_names)
        self._lock = threading.Lock()
        self._rows: list[np.ndarray] = []
        self.received = 0  # rows received so far (the step a capture belongs to)
        # step -> (weights, batch), oldest first.
        self._captures: collections.OrderedDict = collections.OrderedDict()

    # -- called by the train op (in the thread running sess.run) ------------------

    def receive_row(self, vector: np.ndarray) -> np.bool_:
        with self._lock:
            self._rows.append(np.array(vector, np.float32, copy=True))
            self.received += 1
        return np.bool_(True)

    def receive_capture(self, *arrays: np.ndarray) -> np.bool_:
        n_batch = len(self.input_names)
        batch = [np.array(a, copy=True) for a in arrays[:n_batch]]
        weights = [np.array(a, copy=True) for a in arrays[n_batch:]]
        with self._lock:
            self._captures[self.received] = (weights, batch)
            while len(self._captures) > MAX_CAPTURES:
                self._captures.popitem(last=False)
        return np.bool_(True)

    # -- read by the session ---------------------------------------------------------

    def fetch_rows(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """The rows received since the last call, oldest first."""
        with self._lock:
            rows, self._rows = self._rows, []
        return [(row, _ONE_REPLICA) for row in rows]

    def capture_of(self, step: int) -> tuple[list[np.ndarray], list[np.ndarray]] | None:
        """(weights before ``step``, the batch fed to it), or None if not captured."""
        with self._lock:
            return self._captures.get(step)
