"""What was recorded for one run, as the rules read it.

:class:`Series` (one row a step), :class:`Flight` (the full statistics vectors
of the last steps) and :class:`Record` (all of a run's evidence) are built by
the journal while it writes and by the board's reader from the event files
(and the run dir's remedy trials);
the rules in :mod:`tb_nanwatch.evidence.causes` read nothing else.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tb_nanwatch.evidence.schema import Schema
from tb_nanwatch.evidence.trials import Trial


@dataclasses.dataclass(frozen=True)
class Series:
    """The compact per-step series of a run: one row per recorded step."""

    steps: np.ndarray  # int64 [n], strictly increasing
    columns: dict[str, np.ndarray]  # float32 [n] each

    def __len__(self) -> int:
        return int(self.steps.shape[0])

    def index_of(self, step: int) -> int | None:
        i = int(np.searchsorted(self.steps, step))
        if i < len(self) and int(self.steps[i]) == step:
            return i
        return None

    def value(self, column: str, step: int) -> float | None:
        i = self.index_of(step)
        if i is None or column not in self.columns:
            return None
        return float(self.columns[column][i])


@dataclasses.dataclass(frozen=True)
class Flight:
    """The flight-recorder window: full stats vectors of consecutive steps."""

    first_step: int
    matrix: np.ndarray  # float32 [W, schema.size]
    schema: Schema

    @property
    def steps(self) -> list[int]:
        return list(range(self.first_step, self.first_step + self.matrix.shape[0]))

    def vector(self, step: int) -> np.ndarray | None:
        i = step - self.first_step
        if 0 <= i < self.matrix.shape[0]:
            return self.matrix[i]
        return None


@dataclasses.dataclass(frozen=True)
class Record:
    """Everything a hint rule may look at."""

    schema: Schema
    incident: dict | None
    explosion: dict | None = None
    series: Series | None = None
    flight: Flight | None = None
    summary: dict = dataclasses.field(default_factory=dict)
    # The remedy trials run after training stopped (``repro/trials.json``);
    # () when none were run or read (the journal judges before any trial).
    trials: tuple[Trial, ...] = ()

    @property
    def step(self) -> int | None:
        if not self.incident or not isinstance(self.incident.get("step"), int):
            return None
        return self.incident["step"]

    @property
    def phase(self) -> str | None:
        return (self.incident or {}).get("phase")

    def vector(self, step: int) -> np.ndarray | None:
        return self.flight.vector(step) if self.flight is not None else None
