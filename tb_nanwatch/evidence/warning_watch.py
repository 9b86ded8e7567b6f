"""The early warnings of one run, from the per-step record as it is written.

:class:`EarlyWarnings` reads each step's statistics vector on the host (the
journal's worker thread): the first step's checks once, then the forecasts,
arithmetic on a small ring of recent values. It raises at most one warning a
kind a run, never raises itself (its own failure is one logged warning) and
marks, when the run ends, the warnings the run outlived.
"""

from __future__ import annotations

import collections
import logging
import math

import numpy as np

from tb_nanwatch.evidence import early_warnings as rules
from tb_nanwatch.evidence.causes.case import is_target
from tb_nanwatch.evidence.options import WatchOptions
from tb_nanwatch.evidence.schema import Schema

logger = logging.getLogger("tb_nanwatch")


def _max_abs(vector: np.ndarray, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    return np.maximum(np.abs(vector[low]), np.abs(vector[high]))


class _Signals:
    """Where each forecast signal lives in the vector, and its limit."""

    def __init__(self, schema: Schema, policy: str | None, loss_name: str | None) -> None:
        dtype_max = rules.dtype_limit(policy)
        names, limits = ["loss", "global gradient norm"], [rules.FLOAT32_MAX] * 2
        self.header = np.array([schema.header_index("loss"), schema.header_index("grad_norm")])
        watched = schema.find("forward", "activation") + schema.find("forward", "logits")
        self.low = np.array(schema.indices(watched, "min"), np.intp)
        self.high = np.array(schema.indices(watched, "max"), np.intp)
        for entry in watched:
            if entry.kind == "logits" and rules.exp_limited(
                loss_name, entry.before_final_activation
            ):
                names.append(f"the largest |logit| of {entry.layer}")
                limits.append(math.log(dtype_max))  # exp of a logit overflows past it
            elif entry.kind == "logits":
                names.append(f"the largest |output| of {entry.layer}")
                limits.append(dtype_max)
            else:
                names.append(f"the max |activation| of {entry.layer}")
                limits.append(dtype_max)
        self.names = names
        self.limits = np.array(limits, np.float64)

    def values(self, vector: np.ndarray) -> np.ndarray:
        head = np.abs(vector[self.header].astype(np.float64))
        return np.concatenate([head, _max_abs(vector, self.low, self.high).astype(np.float64)])


class EarlyWarnings:
    """The warnings of one run: ``warnings`` (in the order raised) and the
    ones not yet announced on the console (:meth:`take_fresh`)."""

    def __init__(self, schema: Schema, run_info: dict, options: WatchOptions | None = None) -> None:
        self.schema = schema
        self.info = run_info
        self.options = options or WatchOptions()
        self.warnings: list[dict] = [w for w in run_info.get("warnings") or [] if _is_warning(w)]
        self._fresh = collections.deque(self.warnings)  # read by the training thread
        self._kinds = {w["kind"] for w in self.warnings}
        self._failed = False
        self._first_done = False
        self._seen = 0
        self._scale: float | None = None  # the last step's loss scale
        self._scale_settled = False  # a step kept its scale since the run began
        self._halvings = 0  # the halvings in a row that count
        self._nan_gradients = False  # the last step's gradients held NaN
        try:
            self._start(schema, run_info)
        except Exception as error:  # noqa: BLE001 - the watcher's own failure is a warning
            self._fail(error)

    def _start(self, schema: Schema, run_info: dict) -> None:
        self._signals = _Signals(schema, run_info.get("dtype_policy"), run_info.get("loss_name"))
        self._logs = np.full((rules.WINDOW, len(self._signals.names)), np.nan)
        self._scale_index = schema.header_index("loss_scale")
        backward = schema.find(phase="backward")
        self._gradient_nan = np.array(schema.indices(backward, "nan"), np.intp)

    def _fail(self, error: Exception) -> None:
        self._failed = True
        logger.warning("NanWatch stopped its early warnings: %r", error)

    def observe(self, step: int, vector: np.ndarray) -> bool:
        """Reads one recorded step; True when it raised a new warning. Never raises."""
        if self._failed:
            return False
        count = len(self.warnings)
        try:
            if not self._first_done:
                self._first_done = True
                self._first_step(step, vector)
            self._forecast(step, vector)
            self._loss_scale(step, vector)
        except Exception as error:  # noqa: BLE001 - the watcher's own failure is a warning
            self._fail(error)
        return len(self.warnings) > count

    def _add(self, found: dict | None) -> None:
        if found is not None and found["kind"] not in self._kinds:
            self._kinds.add(found["kind"])
            self.warnings.append(found)
            self._fresh.append(found)

    def take_fresh(self) -> list[dict]:
        """The warnings raised since the last call (each announced once)."""
        fresh = []
        while self._fresh:
            fresh.append(self._fresh.popleft())
        return fresh

    def _first_step(self, step: int, vector: np.ndarray) -> None:
        info = self.info
        loss = info.get("loss_name")
        self._add(
            rules.probabilities_expected(
                self._outputs(vector), loss, info.get("loss_from_logits"), step
            )
        )
        self._add(rules.data_scale(self._inputs(vector), loss, info.get("first_layer_class"), step))

    def _outputs(self, vector: np.ndarray) -> list[dict]:
        entries = self.schema.find("forward", "logits")
        activations = list(self.info.get("output_activations") or [])
        units = list(self.info.get("output_units") or [])
        found = []
        for i, entry in enumerate(entries):
            activation = activations[i] if i < len(activations) else None
            if entry.before_final_activation and activation is None:
                activation = "softmax"  # read before a softmax or sigmoid: not its output
            found.append(
                {
                    "name": entry.layer,
                    "min": float(vector[entry.index("min")]),
                    "max": float(vector[entry.index("max")]),
                    "units": units[i] if i < len(units) else None,
                    "activation": activation,
                }
            )
        return found

    def _inputs(self, vector: np.ndarray) -> list[dict]:
        dtypes = self.info.get("input_dtypes") or {}
        return [
            {
                "name": entry.layer,
                "min": float(vector[entry.index("min")]),
                "max": float(vector[entry.index("max")]),
                "dtype": dtypes.get(entry.layer) if isinstance(dtypes, dict) else None,
                "target": is_target(entry),
            }
            for entry in self.schema.find("input", "input")
            if entry.micro_batch in (None, 0)
        ]

    def _forecast(self, step: int, vector: np.ndarray) -> None:
        if "overflow_forecast" in self._kinds:
            return
        values = self._signals.values(vector)
        self._logs = np.roll(self._logs, -1, axis=0)
        self._logs[-1] = np.log(np.where(values > 0, values, np.nan))  # NaN: no log, no warning
        self._seen += 1
        if self._seen < rules.WINDOW:
            return
        ahead = rules.overflow_steps(self._logs, self._signals.limits)
        which = int(np.argmin(ahead))
        if not math.isfinite(ahead[which]):
            return
        slope = rules.growth_fit(np.nan_to_num(self._logs[:, [which]]))[0][0]
        self._add(
            rules.overflow_forecast(
                step,
                self._signals.names[which],
                float(values[which]),
                float(self._signals.limits[which]),
                float(ahead[which]),
                float(slope),
            )
        )

    def _loss_scale(self, step: int, vector: np.ndarray) -> None:
        if "loss_scale_collapse" in self._kinds:
            return
        scale = float(vector[self._scale_index])
        before, nan_before = self._scale, self._nan_gradients
        self._nan_gradients = bool(np.any(vector[self._gradient_nan] > 0))
        if not (math.isfinite(scale) and scale > 0):
            self._scale, self._halvings = None, 0
            return
        self._scale = scale
        if before is None:
            return
        halved = rules.halving_streak([before, scale]) == 1
        self._scale_settled = self._scale_settled or not halved
        counts = halved and (self._scale_settled or nan_before)
        self._halvings = self._halvings + 1 if counts else 0
        options = self.options
        self._add(
            rules.loss_scale_collapse(
                step, self._halvings, scale, options.min_loss_scale, options.max_consecutive_skips
            )
        )

    def rewound(self) -> None:
        """The run went back to a rewind point: the forecasts start over."""
        self._logs[:] = np.nan
        self._seen = 0
        self._scale, self._halvings = None, 0

    def finished(self, summary: dict) -> list[dict]:
        """The warnings, each marked ``outlived`` when the run went past it
        (its predicted step, or the end of a finished run) with no NaN/Inf
        and no explosion. Never raises."""
        try:
            troubled = bool(summary.get("first_nonfinite") or summary.get("explosion"))
            steps = int(summary.get("steps") or 0)
            finished = summary.get("status") == "finished"
            marked = []
            for found in self.warnings:
                predicted = found.get("predicted_step")
                past = finished if predicted is None else steps > predicted
                marked.append({**found, "outlived": bool(past and not troubled)})
        except Exception as error:  # noqa: BLE001 - the watcher's own failure is a warning
            self._fail(error)
            return self.warnings
        self.warnings = marked
        return marked


def _is_warning(value: object) -> bool:
    return isinstance(value, dict) and value.get("kind") in rules.KINDS and "step" in value
