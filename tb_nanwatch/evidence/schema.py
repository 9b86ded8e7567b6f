"""Layout of the per-step statistics vector.

The compiled train step packs every statistic of one step into a single
float32 vector (one device-to-host transfer). A :class:`Schema` names each
slot: it is a list of :class:`Entry` objects in *diagnosis order*
(input -> forward in execution order -> loss -> backward in reverse execution
order -> update), each owning a few consecutive fields. The schema is stored
as JSON in the run summary, so readers never need TensorFlow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np

PHASES = ("input", "forward", "loss", "backward", "update")

# Fields of each entry kind, in vector order. Every kind but "header" has the
# element counts ``nan`` and ``inf``, which alone decide whether the entry is
# non-finite (the rule is ``diagnosis.is_nonfinite``; a non-finite ``norm`` or
# ``value`` over finite elements is an overflow of the statistic, not a NaN/Inf
# of the tensor). Read a field through its name (``Entry.index``,
# ``Schema.header_index``, ``Schema.indices``), never by a numeric offset:
# adding a field then breaks nothing.
FIELDS = {
    "header": ("loss", "grad_norm", "lr", "loss_scale", "skipped", "iterations"),
    "input": ("nan", "inf", "min", "max"),
    "activation": ("nan", "inf", "min", "max"),
    "logits": ("nan", "inf", "min", "max"),
    "loss": ("nan", "inf", "value"),
    "grad_out": ("nan", "inf", "norm"),
    "grad_in": ("nan", "inf", "norm"),
    "grad_var": ("nan", "inf", "norm"),
    "weights": ("nan", "inf"),
}


# Ends the text of an entry that reads the logits of a sigmoid or softmax
# output instead of its probabilities (see Entry.before_final_activation).
BEFORE_FINAL_ACTIVATION = "(before the final activation)"


@dataclasses.dataclass(frozen=True)
class Entry:
    """One watched tensor: where it lives in the vector and what it is."""

    phase: str  # one of PHASES, or "header" (not diagnosed)
    kind: str  # a key of FIELDS
    layer: str | None  # layer path, input name, or None
    tensor: str  # human description, e.g. "output of backbone/conv1"
    offset: int
    # Which micro-batch of a step with gradient accumulation (None: the step
    # has one forward/backward pass).
    micro_batch: int | None = None

    @property
    def fields(self) -> tuple[str, ...]:
        return FIELDS[self.kind]

    @property
    def before_final_activation(self) -> bool:
        """Whether this entry reads the logits of a sigmoid or softmax output."""
        return self.tensor.endswith(BEFORE_FINAL_ACTIVATION)

    @property
    def size(self) -> int:
        return len(self.fields)

    def index(self, field: str) -> int:
        """The vector position of ``field`` of this entry."""
        try:
            return self.offset + FIELDS[self.kind].index(field)
        except ValueError:
            raise KeyError(f"a {self.kind!r} entry has no field {field!r}") from None

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        if data["micro_batch"] is None:
            del data["micro_batch"]  # the layout of a step without accumulation is unchanged
        return data


@dataclasses.dataclass(frozen=True)
class DiagnosedIndex:
    """The diagnosed entries of a schema, in order, and the vector positions
    of their ``nan`` and ``inf`` counts (see :meth:`Schema.diagnosed_index`)."""

    entries: list[Entry]
    nan: np.ndarray
    inf: np.ndarray


class Schema:
    """An ordered list of entries laid out in one vector."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self.size = 0
        # (layout it was built for, diagnosed_index()): see diagnosed_index.
        self._diagnosed_index: tuple[tuple[int, int], DiagnosedIndex] | None = None

    def add(
        self, phase: str, kind: str, layer: str | None, tensor: str, micro_batch: int | None = None
    ) -> Entry:
        entry = Entry(phase, kind, layer, tensor, self.size, micro_batch)
        self.entries.append(entry)
        self.size += entry.size
        return entry

    def header(self) -> Entry:
        return self.entries[0]

    def header_index(self, field: str) -> int:
        """The vector position of a header field (``"loss"``, ``"skipped"``, ...)."""
        return self.header().index(field)

    def indices(self, entries: Iterable[Entry], field: str) -> list[int]:
        """The vector positions of ``field`` in each of ``entries``."""
        return [entry.index(field) for entry in entries]

    def diagnosed(self) -> list[Entry]:
        """The entries the diagnosis looks at (all but the header), in order."""
        return [e for e in self.entries if e.phase in PHASES]

    def diagnosed_index(self) -> DiagnosedIndex:
        """:meth:`diagnosed` and the vector positions of each entry's nan and
        inf counts (the diagnosis reads them every step): built once, and
        again only if the schema grew."""
        layout = (len(self.entries), self.size)
        if self._diagnosed_index is None or self._diagnosed_index[0] != layout:
            entries = self.diagnosed()
            nan = np.array(self.indices(entries, "nan"), np.intp)
            inf = np.array(self.indices(entries, "inf"), np.intp)
            self._diagnosed_index = (layout, DiagnosedIndex(entries, nan, inf))
        return self._diagnosed_index[1]

    def find(self, phase: str | None = None, kind: str | None = None) -> list[Entry]:
        return [
            e
            for e in self.entries
            if (phase is None or e.phase == phase) and (kind is None or e.kind == kind)
        ]

    def to_json(self) -> dict:
        return {"size": self.size, "entries": [e.to_json() for e in self.entries]}

    @classmethod
    def from_json(cls, data: dict) -> Schema:
        schema = cls()
        for raw in data["entries"]:
            entry = Entry(
                phase=str(raw["phase"]),
                kind=str(raw["kind"]),
                layer=raw.get("layer"),
                tensor=str(raw["tensor"]),
                offset=int(raw["offset"]),
                micro_batch=None if raw.get("micro_batch") is None else int(raw["micro_batch"]),
            )
            if entry.kind not in FIELDS or entry.offset != schema.size:
                raise ValueError(f"malformed schema entry {raw!r}")
            schema.entries.append(entry)
            schema.size += entry.size
        if schema.size != int(data["size"]):
            raise ValueError("schema size does not match its entries")
        return schema

    def values(self, vector: Iterable[float], entry: Entry) -> dict[str, float]:
        """The named fields of ``entry`` read from ``vector``."""
        vector = list(vector) if not hasattr(vector, "__getitem__") else vector
        return {name: float(vector[entry.index(name)]) for name in entry.fields}
