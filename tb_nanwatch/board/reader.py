"""Reads NaN Watch runs through a TensorBoard ``DataProvider``.

Works the same on the Python loader (``MultiplexerDataProvider``) and on the
Rust data server (``GrpcDataProvider``), and imports no TensorFlow. Every
NaN Watch tag is read by its *latest* value only (the one value TensorBoard's
ingestion sampling always keeps), see :mod:`tb_nanwatch.evidence.metadata`.

Unreadable runs (bad plugin content, a newer format version, malformed JSON or
arrays) are skipped with one ``logging.warning`` line per run and reason; the
functions here return ``None`` or leave the run out, and never raise for bad
data. What a run declares is checked against :mod:`tb_nanwatch.evidence.limits`
before it is read: a tensor declaring more than ``MAX_TENSOR_BYTES`` is never
expanded, JSON deeper than ``MAX_JSON_DEPTH`` never parsed, and a bundle path
that leaves the run dir never used (:mod:`tb_nanwatch.evidence.run_dir_box`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
from collections.abc import Mapping

import numpy as np
from tensorboard import errors
from tensorboard.data import provider

from tb_nanwatch.board import tensor_limits
from tb_nanwatch.evidence import limits, metadata, recoveries, run_dir_box, trials
from tb_nanwatch.evidence.recorded import Flight, Record, Series
from tb_nanwatch.evidence.schema import Schema

logger = logging.getLogger(__name__)

# Large enough to return every stored value of a tag: TensorBoard keeps at most
# a few hundred values per tag unless told otherwise, and we want them all.
DOWNSAMPLE = 1_000_000

_EXPECTED_KIND = {
    metadata.TAG_RUN: metadata.KIND_RUN,
    metadata.TAG_INCIDENT: metadata.KIND_INCIDENT,
    metadata.TAG_FLIGHT: metadata.KIND_FLIGHT,
}


class UnreadableError(ValueError):
    """Raised internally for data that cannot be decoded."""


class OncePerRunAndReason(logging.Filter):
    """Lets each "skipping run" warning through once per (run, reason): an
    unreadable run is skipped on every request and says so once. The filter
    is the logger's, so the memory of what was said lives with the logger."""

    LIMIT = 10_000  # then it forgets all and may say each once more

    def __init__(self) -> None:
        super().__init__()
        self._said: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        key = getattr(record, "nanwatch_skip", None)
        if key is None:
            return True
        with self._lock:
            if key in self._said:
                return False
            if len(self._said) >= self.LIMIT:
                self._said.clear()
            self._said.add(key)
        return True

    def forget(self) -> None:
        """Says each warning once more (for tests, and a reloaded log dir)."""
        with self._lock:
            self._said.clear()


skip_warnings = OncePerRunAndReason()
logger.addFilter(skip_warnings)


def _warn_once(run: str, reason: str, skipping: bool = True) -> None:
    logger.warning(
        "nanwatch: skipping run %r: %s" if skipping else "nanwatch: run %r: %s",
        run,
        " ".join(reason.split("\n")),
        extra={"nanwatch_skip": (run, reason)},
    )


def _tag_kind(tag: str) -> str | None:
    """The kind a NaN Watch tag must have, or None for a tag we do not know."""
    if tag in _EXPECTED_KIND:
        return _EXPECTED_KIND[tag]
    if tag.startswith(metadata.TAG_SERIES_PREFIX):
        return metadata.KIND_SERIES
    if tag.startswith(metadata.TAG_LAYERS_PREFIX):
        return metadata.KIND_LAYERS
    return None


@dataclasses.dataclass(frozen=True)
class RunListing:
    """The NaN Watch tags of one run, with their ``TensorTimeSeries``."""

    run: str
    tags: Mapping[str, provider.TensorTimeSeries]

    def series_tags(self) -> list[str]:
        return sorted(t for t in self.tags if t.startswith(metadata.TAG_SERIES_PREFIX))

    def snapshot_steps(self) -> list[int]:
        """Steps that have a per-layer snapshot tag."""
        steps = []
        for tag in self.tags:
            if tag.startswith(metadata.TAG_LAYERS_PREFIX):
                suffix = tag[len(metadata.TAG_LAYERS_PREFIX) :]
                if suffix.isdigit():
                    steps.append(int(suffix))
        return sorted(steps)

    def fingerprint(self, tags: list[str]) -> tuple:
        """Changes whenever one of ``tags`` gets a new value."""
        return tuple((t, self.tags[t].max_step, self.tags[t].max_wall_time) for t in tags)


# -- decoding ---------------------------------------------------------------


def _latest(data: list[provider.TensorDatum]) -> provider.TensorDatum | None:
    """The last datum: both providers always keep and return the latest last."""
    return data[-1] if data else None


def decode_json(value: np.ndarray | bytes | str) -> object:
    """Decodes a string tensor (numpy bytes/object array) holding JSON."""
    if isinstance(value, np.ndarray):
        if value.size != 1:
            raise UnreadableError(f"expected a scalar string tensor, got shape {value.shape}")
        value = value.reshape(()).item()
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as error:
            raise UnreadableError(f"string tensor is not UTF-8: {error}") from None
    if not isinstance(value, str):
        raise UnreadableError(f"expected a string tensor, got {type(value).__name__}")
    try:
        return limits.loads_bounded(value, "the JSON")  # accepts NaN / Infinity tokens
    except ValueError as error:
        raise UnreadableError(str(error)) from None


def decode_array(value: np.ndarray, ndim: int, width: int | None = None) -> np.ndarray:
    """A float32 array of the given rank (and last dimension), or raises."""
    if not isinstance(value, np.ndarray) or value.dtype.kind not in "fiu":
        raise UnreadableError("expected a numeric tensor")
    if value.ndim != ndim:
        raise UnreadableError(f"expected rank {ndim}, got shape {value.shape}")
    if width is not None and value.shape[-1] != width:
        raise UnreadableError(f"expected last dimension {width}, got shape {value.shape}")
    return value.astype(np.float32, copy=False)


def parse_summary(raw: object) -> tuple[dict, Schema]:
    """Validates a decoded run summary; returns it with its schema."""
    if not isinstance(raw, dict):
        raise UnreadableError("run summary is not a JSON object")
    version = raw.get("format_version", metadata.FORMAT_VERSION)
    if not isinstance(version, int) or version > metadata.FORMAT_VERSION:
        raise UnreadableError(f"unsupported format version {version!r}")
    try:
        schema = Schema.from_json(raw["schema"])
    except (KeyError, TypeError, ValueError) as error:
        raise UnreadableError(f"malformed schema: {error!r}") from None
    columns = raw.get("series_columns")
    if not isinstance(columns, list) or not all(isinstance(c, str) for c in columns):
        raise UnreadableError("series_columns missing or malformed")
    steps = raw.get("steps")
    if not _is_step(steps):
        raise UnreadableError("steps missing or not a non-negative integer")
    for key in ("first_nonfinite", "explosion"):
        if not isinstance(raw.get(key), (dict, type(None))):
            raise UnreadableError(f"{key} is neither an object nor null")
    _check_event(raw.get("first_nonfinite"), "first_nonfinite", {"phase": str}, (str, type(None)))
    _check_event(raw.get("explosion"), "explosion", {"signal": str}, None)
    ranges = raw.get("skipped_ranges", [])
    if not isinstance(ranges, list) or not all(
        isinstance(r, list)
        and len(r) == 2
        and all(_is_step(x) for x in r)
        and 0 <= r[0] <= r[1] < max(steps, 1)
        for r in ranges
    ):
        raise UnreadableError("skipped_ranges malformed")
    skipped = sum(last - first + 1 for first, last in ranges)
    if skipped > steps:
        raise UnreadableError("skipped_ranges hold more steps than the run")
    if skipped > limits.MAX_SKIPPED_STEPS:
        raise UnreadableError(
            f"skipped_ranges list {skipped} steps, more than the limit of {limits.MAX_SKIPPED_STEPS}"
        )
    return raw, schema


def bundle_problem(summary: dict) -> str | None:
    """Why the summary's ``repro_bundle`` cannot be used (it must be a path
    relative to the run dir, inside it), or None when it can or is absent."""
    bundle = summary.get("repro_bundle")
    if bundle is None:
        return None
    try:
        run_dir_box.relative_path(bundle, "repro_bundle")
    except run_dir_box.RunDirError as error:
        return f"{error}; the bundle is not used"
    return None


def local_bundle_file(logdir: str, run: str, summary: dict, name: str) -> str:
    """The real path of the file ``name`` of a run's bundle under the local
    ``logdir``; a ``RunDirError`` unless it resolves inside the run dir."""
    run_dir = os.path.join(logdir, run)
    if not run_dir_box.within(logdir, run_dir):
        raise run_dir_box.RunDirError(f"run dir {run!r} is not inside the log dir")
    bundle = run_dir_box.relative_path(summary.get("repro_bundle"), "repro_bundle")
    return run_dir_box.inside(run_dir, f"{bundle}/{name}", "repro_bundle")


def _is_step(value: object) -> bool:
    return limits.count(value, metadata.MAX_STEP) is not None


def _check_event(event: dict | None, key: str, fields: dict, layer_types) -> None:
    """An incident / explosion object: an integer step and text fields."""
    if event is None:
        return
    if not _is_step(event.get("step")):
        raise UnreadableError(f"{key} has no valid step")
    for name, kind in fields.items():
        if not isinstance(event.get(name), kind):
            raise UnreadableError(f"{key}.{name} is not a {kind.__name__}")
    if layer_types is not None and not isinstance(event.get("layer"), layer_types):
        raise UnreadableError(f"{key}.layer is neither text nor null")


@dataclasses.dataclass(frozen=True)
class Run:
    """A readable NaN Watch run: its tags, latest summary and schema."""

    listing: RunListing
    summary: dict
    schema: Schema

    @property
    def name(self) -> str:
        return self.listing.run

    def skipped_steps(self) -> list[int]:
        """Skipped steps: the loss scaler's (the summary's ``skipped_ranges``)
        and the non-finite steps a recovering watcher did not apply
        (``on_nonfinite="skip"``/``"rewind"``'s fallback), in step order."""
        steps = set(recoveries.skipped_nonfinite_steps(self.summary))
        for first, last in self.summary.get("skipped_ranges", []):
            steps.update(range(first, last + 1))
        return sorted(steps)

    def skipped_count(self) -> int:
        return len(self.skipped_steps())

    def skipped_ranges(self) -> list[list[int]]:
        """:meth:`skipped_steps` as ``[first, last]`` runs of consecutive steps."""
        ranges: list[list[int]] = []
        for step in self.skipped_steps():
            if ranges and ranges[-1][1] == step - 1:
                ranges[-1][1] = step
            else:
                ranges.append([step, step])
        return ranges


# -- provider access --------------------------------------------------------


def _read(
    data_provider: provider.DataProvider,
    ctx,
    experiment_id: str,
    runs: list[str],
    tags: list[str],
) -> dict[str, dict[str, list[provider.TensorDatum]]]:
    """The tensors of ``runs`` x ``tags``, leaving out (one warning line)
    every tag that declares more than ``limits.MAX_TENSOR_BYTES``: such a
    tensor is never expanded (TensorBoard's ``make_ndarray`` would fill the
    declared shape from one stored value)."""
    if type(data_provider).__name__ == "GrpcDataProvider":
        return tensor_limits.read_grpc(
            data_provider, experiment_id, runs, tags, DOWNSAMPLE, _refuse_tag
        )
    refused = tensor_limits.refused_tags(data_provider, runs, tags)
    for (run, tag), size in refused.items():
        _refuse_tag(run, tag, size)
    if not refused:
        return _read_all(data_provider, ctx, experiment_id, runs, tags)
    result = {}
    for run in runs:
        allowed = [tag for tag in tags if (run, tag) not in refused]
        if allowed:
            result.update(_read_all(data_provider, ctx, experiment_id, [run], allowed))
    return result


def _refuse_tag(run: str, tag: str, size: int) -> None:
    _warn_once(
        run,
        f"tag {tag!r} declares {size / limits.MB:.0f} MB of values, more than the "
        f"{limits.MAX_TENSOR_BYTES / limits.MB:g} MB limit; not read",
        skipping=tag == metadata.TAG_RUN,
    )


def _read_all(data_provider, ctx, experiment_id: str, runs: list[str], tags: list[str]) -> dict:
    return data_provider.read_tensors(
        ctx,
        experiment_id=experiment_id,
        plugin_name=metadata.PLUGIN_NAME,
        downsample=DOWNSAMPLE,
        run_tag_filter=provider.RunTagFilter(runs=runs, tags=tags),
    )


def _list_tensors_run_by_run(data_provider, ctx, experiment_id, runs) -> dict:
    """``list_tensors`` one run at a time, leaving out (with a warning) the
    runs the provider fails on; e.g. TensorBoard's Python loader raises
    ``KeyError`` for a summary that has metadata but no tensor."""
    if runs is None:
        runs = [r.run_name for r in data_provider.list_runs(ctx, experiment_id=experiment_id)]
    mapping = {}
    for run in runs:
        try:
            mapping.update(
                data_provider.list_tensors(
                    ctx,
                    experiment_id=experiment_id,
                    plugin_name=metadata.PLUGIN_NAME,
                    run_tag_filter=provider.RunTagFilter(runs=[run]),
                )
            )
        except Exception as error:  # noqa: BLE001
            _warn_once(run, f"its data cannot be listed: {type(error).__name__}: {error}")
    return mapping


def list_runs(
    data_provider: provider.DataProvider,
    ctx,
    experiment_id: str,
    runs: list[str] | None = None,
) -> dict[str, RunListing]:
    """Readable NaN Watch runs (those with a run summary tag), by run name."""
    try:
        mapping = data_provider.list_tensors(
            ctx,
            experiment_id=experiment_id,
            plugin_name=metadata.PLUGIN_NAME,
            run_tag_filter=provider.RunTagFilter(runs=runs) if runs is not None else None,
        )
    except errors.PublicError:
        raise
    except Exception:  # noqa: BLE001 - one broken run must not hide the others
        mapping = _list_tensors_run_by_run(data_provider, ctx, experiment_id, runs)
    result = {}
    for run, tag_map in mapping.items():
        tags = {}
        problem = None
        for tag, series in tag_map.items():
            expected = _tag_kind(tag)
            if expected is None:
                continue  # a tag from a later version we can ignore
            try:
                parsed = metadata.parse_plugin_content(series.plugin_content or b"")
            except ValueError as error:
                problem = f"tag {tag!r}: {error}"
                break
            if parsed["kind"] != expected:
                problem = f"tag {tag!r} has kind {parsed['kind']!r}, expected {expected!r}"
                break
            tags[tag] = series
        if problem is not None:
            _warn_once(run, problem)
            continue
        if metadata.TAG_RUN in tags:
            result[run] = RunListing(run, tags)
    return result


def load_runs(
    data_provider: provider.DataProvider,
    ctx,
    experiment_id: str,
    runs: list[str] | None = None,
) -> dict[str, Run]:
    """Readable NaN Watch runs with their latest summary, sorted by name."""
    listings = list_runs(data_provider, ctx, experiment_id, runs=runs)
    if not listings:
        return {}
    data = _read(data_provider, ctx, experiment_id, sorted(listings), [metadata.TAG_RUN])
    result = {}
    for name in sorted(listings):
        datum = _latest(data.get(name, {}).get(metadata.TAG_RUN, []))
        if datum is None:
            continue
        try:
            summary, schema = parse_summary(decode_json(datum.numpy))
        except UnreadableError as error:
            _warn_once(name, f"run summary: {error}")
            continue
        problem = bundle_problem(summary)
        if problem is not None:
            _warn_once(name, problem, skipping=False)  # shown; its bundle never opened
            summary = {**summary, "repro_bundle": None, "repro_bundle_exact": None}
        result[name] = Run(listings[name], summary, schema)
    return result


def load_run(data_provider: provider.DataProvider, ctx, experiment_id: str, run: str) -> Run | None:
    """One readable run with its latest summary, or None."""
    return load_runs(data_provider, ctx, experiment_id, runs=[run]).get(run)


def _assemble_series(chunks: list[tuple[int, np.ndarray]], columns: list[str]) -> Series:
    """Concatenates (first step, rows) chunks; later chunks win on overlap."""
    if not chunks:
        empty = np.zeros(0, np.float32)
        return Series(np.zeros(0, np.int64), {c: empty for c in columns})
    chunks.sort(key=lambda c: c[0])
    steps = np.concatenate(
        [start + np.arange(rows.shape[0], dtype=np.int64) for start, rows in chunks]
    )
    table = np.concatenate([rows for _, rows in chunks])
    if len(steps) > 1 and not np.all(np.diff(steps) > 0):
        # Overlapping chunks: keep the last occurrence of every step.
        rev_unique, rev_index = np.unique(steps[::-1], return_index=True)
        keep = len(steps) - 1 - rev_index
        steps, table = rev_unique, table[keep]
    return Series(steps, {name: table[:, i] for i, name in enumerate(columns)})


class SeriesCache:
    """Parsed series per (experiment, run), valid while the tags are unchanged."""

    def __init__(self, max_runs: int = 16) -> None:
        self._max_runs = max_runs
        self._entries: collections.OrderedDict[tuple, tuple[tuple, Series]] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()

    def get(self, key: tuple, fingerprint: tuple) -> Series | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry[0] != fingerprint:
                return None
            self._entries.move_to_end(key)
            return entry[1]

    def put(self, key: tuple, fingerprint: tuple, series: Series) -> None:
        with self._lock:
            self._entries[key] = (fingerprint, series)
            self._entries.move_to_end(key)
            while len(self._entries) > self._max_runs:
                self._entries.popitem(last=False)


def load_series(
    data_provider: provider.DataProvider,
    ctx,
    experiment_id: str,
    run_data: Run,
    cache: SeriesCache | None = None,
) -> Series | None:
    """All series chunks of a run, concatenated into per-step columns.

    Each chunk tag's latest value holds consecutive steps from its step.
    """
    run = run_data.name
    columns = run_data.summary["series_columns"]
    tags = run_data.listing.series_tags()
    fingerprint = (tuple(columns), run_data.listing.fingerprint(tags))
    key = (experiment_id, run)
    if cache is not None:
        cached = cache.get(key, fingerprint)
        if cached is not None:
            return cached
    data = _read(data_provider, ctx, experiment_id, [run], tags) if tags else {}
    chunks = []
    try:
        for tag in tags:
            datum = _latest(data.get(run, {}).get(tag, []))
            if datum is None:
                continue
            chunks.append((int(datum.step), decode_array(datum.numpy, 2, len(columns))))
    except UnreadableError as error:
        _warn_once(run, f"series: {error}")
        return None
    series = _assemble_series(chunks, columns)
    if cache is not None:
        cache.put(key, fingerprint, series)
    return series


def _load_latest(
    data_provider: provider.DataProvider,
    ctx,
    experiment_id: str,
    listing: RunListing,
    tag: str,
) -> provider.TensorDatum | None:
    if tag not in listing.tags:
        return None
    data = _read(data_provider, ctx, experiment_id, [listing.run], [tag])
    return _latest(data.get(listing.run, {}).get(tag, []))


def load_incident(
    data_provider: provider.DataProvider, ctx, experiment_id: str, run_data: Run
) -> dict | None:
    """The incident written when the first non-finite step was detected."""
    listing = run_data.listing
    datum = _load_latest(data_provider, ctx, experiment_id, listing, metadata.TAG_INCIDENT)
    if datum is None:
        return None
    try:
        incident = decode_json(datum.numpy)
    except UnreadableError as error:
        _warn_once(listing.run, f"incident: {error}")
        return None
    if not isinstance(incident, dict):
        _warn_once(listing.run, "incident is not a JSON object")
        return None
    return incident


def load_flight(
    data_provider: provider.DataProvider,
    ctx,
    experiment_id: str,
    run_data: Run,
) -> Flight | None:
    """The flight-recorder window (consecutive steps from the datum's step)."""
    listing, schema = run_data.listing, run_data.schema
    datum = _load_latest(data_provider, ctx, experiment_id, listing, metadata.TAG_FLIGHT)
    if datum is None:
        return None
    try:
        matrix = decode_array(datum.numpy, 2, schema.size)
    except UnreadableError as error:
        _warn_once(listing.run, f"flight window: {error}")
        return None
    return Flight(int(datum.step), matrix, schema)


def load_layers(
    data_provider: provider.DataProvider,
    ctx,
    experiment_id: str,
    run_data: Run,
    step: int,
) -> np.ndarray | None:
    """The per-layer stats vector snapshot of ``step``, or None."""
    listing, schema = run_data.listing, run_data.schema
    tag = metadata.layers_tag(step)
    datum = _load_latest(data_provider, ctx, experiment_id, listing, tag)
    if datum is None:
        return None
    try:
        return decode_array(datum.numpy, 1, schema.size)
    except UnreadableError as error:
        _warn_once(listing.run, f"snapshot {step}: {error}")
        return None


@dataclasses.dataclass(frozen=True)
class Source:
    """Where runs are read from: a data provider, the request context and the
    experiment. Binds them once for the functions of this module."""

    data_provider: provider.DataProvider
    ctx: object
    experiment_id: str = ""

    def runs(self) -> dict[str, Run]:
        return load_runs(self.data_provider, self.ctx, self.experiment_id)

    def run(self, name: str) -> Run | None:
        return load_run(self.data_provider, self.ctx, self.experiment_id, name)

    def series(self, run: Run, cache: SeriesCache | None = None) -> Series | None:
        return load_series(self.data_provider, self.ctx, self.experiment_id, run, cache)

    def flight(self, run: Run) -> Flight | None:
        return load_flight(self.data_provider, self.ctx, self.experiment_id, run)

    def incident(self, run: Run) -> dict | None:
        """The run summary's first incident, else the incident tag's."""
        incident = run.summary.get("first_nonfinite")
        if incident is None:
            incident = load_incident(self.data_provider, self.ctx, self.experiment_id, run)
        return incident

    def layers(self, run: Run, step: int) -> np.ndarray | None:
        if step not in run.listing.snapshot_steps():
            return None
        return load_layers(self.data_provider, self.ctx, self.experiment_id, run, step)


def run_record(
    run: Run,
    incident: dict | None,
    series: Series | None,
    flight: Flight | None,
    logdir: str | None = None,
) -> Record:
    """The record of a run as read (the plugin's incident route and the report);
    with the local ``logdir``, the run dir's remedy trials too."""
    return Record(
        schema=run.schema,
        incident=incident,
        explosion=run.summary.get("explosion"),
        series=series,
        flight=flight,
        summary=run.summary,
        trials=read_trials(logdir, run),
    )


def read_trials(logdir: str | None, run: Run) -> tuple[trials.Trial, ...]:
    """The remedy trials in the run dir's ``repro/trials.json`` under the local
    ``logdir``: () when there is none, or it is over ``MAX_TRIALS_BYTES``, out
    of the run dir or not of the documented shape (one warning line)."""
    if not logdir or run_dir_box.is_remote(logdir):
        return ()
    run_dir = os.path.join(logdir, run.name)
    try:
        path = run_dir_box.inside(run_dir, trials.TRIALS_PATH, "the remedy trials file")
        if not os.path.isfile(path) or not run_dir_box.within(logdir, run_dir):
            return ()
        data = limits.read_json_bounded(
            path, "the remedy trials file", max_bytes=trials.MAX_TRIALS_BYTES
        )
    except (OSError, ValueError) as error:
        _warn_once(run.name, f"remedy trials not read: {error}", skipping=False)
        return ()
    return trials.parse_trials(data)
