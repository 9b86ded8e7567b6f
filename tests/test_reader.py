"""reader.py: decoding, latest-value semantics, caching, skipping bad runs."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import nanwatch_testlib as lib
import numpy as np
import pytest
from nanwatch_testlib import CTX
from tensorboard.data import provider

from tb_nanwatch.board import reader
from tb_nanwatch.evidence import metadata
from tb_nanwatch.record.writing.synthetic import build_schema


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("reader_logs")
    # 2500 steps = 3 chunks; flushed every 50 steps, so each chunk tag is
    # rewritten ~20 times, more than the Python loader's 10 kept values.
    lib.write_vector_run(str(root / "flushed"), 2500, flush_every=50)
    return str(root)


@pytest.fixture(scope="module")
def mux(logdir):
    return lib.multiplexer_provider(logdir)


def test_series_is_the_latest_value_of_every_chunk(mux):
    run = reader.load_run(mux, CTX, "", "flushed")
    assert run is not None and run.summary["steps"] == 2500
    assert run.summary["status"] == "finished"
    assert run.listing.series_tags() == [metadata.series_tag(i) for i in range(3)]
    series = reader.load_series(mux, CTX, "", run)
    np.testing.assert_array_equal(series.steps, np.arange(2500))
    assert list(series.columns) == run.summary["series_columns"]
    np.testing.assert_allclose(series.columns["loss"], 1.0 + np.arange(2500) / 1000, rtol=1e-6)
    np.testing.assert_array_equal(series.columns["iterations"], np.arange(2500))
    assert series.value("lr", 1234) == pytest.approx(1e-3)
    assert series.index_of(2500) is None


def test_data_server_reads_the_same(logdir, mux):
    if lib.data_server_binary() is None:
        pytest.skip("tensorboard_data_server binary not installed")
    expected = reader.load_series(mux, CTX, "", reader.load_run(mux, CTX, "", "flushed"))
    with lib.data_server_provider(logdir, expect_runs=1) as grpc:
        run = reader.load_run(grpc, CTX, "", "flushed")
        series = reader.load_series(grpc, CTX, "", run)
    np.testing.assert_array_equal(series.steps, expected.steps)
    for name, values in expected.columns.items():
        np.testing.assert_array_equal(series.columns[name], values)


def test_snapshots_and_unrecorded_steps(mux):
    run = reader.load_run(mux, CTX, "", "flushed")
    assert run.listing.snapshot_steps() == [0, 1000, 2000]
    vector = reader.load_layers(mux, CTX, "", run, 1000)
    assert vector.shape == (run.schema.size,)
    assert vector[run.schema.header_index("iterations")] == 1000
    assert reader.load_layers(mux, CTX, "", run, 1001) is None
    assert reader.load_flight(mux, CTX, "", run) is None
    assert reader.load_incident(mux, CTX, "", run) is None
    assert reader.load_run(mux, CTX, "", "missing") is None


class CountingProvider:
    """Wraps a provider and counts read_tensors calls."""

    def __init__(self, inner):
        self.inner = inner
        self.reads = 0

    def list_tensors(self, *args, **kwargs):
        return self.inner.list_tensors(*args, **kwargs)

    def read_tensors(self, *args, **kwargs):
        self.reads += 1
        return self.inner.read_tensors(*args, **kwargs)


def test_series_cache_hits_until_the_data_changes(mux):
    counting = CountingProvider(mux)
    cache = reader.SeriesCache()
    run = reader.load_run(counting, CTX, "", "flushed")
    first = reader.load_series(counting, CTX, "", run, cache=cache)
    reads = counting.reads
    again = reader.load_series(counting, CTX, "", run, cache=cache)
    assert again is first and counting.reads == reads
    # A new value on one chunk tag (later wall time) invalidates the entry.
    tag = run.listing.series_tags()[-1]
    old = run.listing.tags[tag]
    changed = dict(run.listing.tags)
    changed[tag] = provider.TensorTimeSeries(
        max_step=old.max_step,
        max_wall_time=old.max_wall_time + 1,
        plugin_content=old.plugin_content,
        description="",
        display_name="",
    )
    newer = reader.Run(reader.RunListing("flushed", changed), run.summary, run.schema)
    reader.load_series(counting, CTX, "", newer, cache=cache)
    assert counting.reads == reads + 1


# -- a fake provider for malformed data ------------------------------------


class FakeProvider:
    """Serves ``{run: {tag: (plugin_content, [TensorDatum, ...])}}``."""

    def __init__(self, data):
        self.data = data

    def list_tensors(self, ctx=None, *, experiment_id, plugin_name, run_tag_filter=None):
        runs = run_tag_filter.runs if run_tag_filter else None
        return {
            run: {
                tag: provider.TensorTimeSeries(
                    max_step=max((d.step for d in data), default=0),
                    max_wall_time=max((d.wall_time for d in data), default=0.0),
                    plugin_content=content,
                    description="",
                    display_name="",
                )
                for tag, (content, data) in tags.items()
            }
            for run, tags in self.data.items()
            if runs is None or run in runs
        }

    def read_tensors(
        self,
        ctx=None,
        *,
        experiment_id,
        plugin_name,
        downsample=None,
        run_tag_filter=None,
    ):
        assert downsample and downsample >= 1000
        runs, tags = run_tag_filter.runs, run_tag_filter.tags
        return {
            run: {
                tag: list(data)
                for tag, (_, data) in run_tags.items()
                if tags is None or tag in tags
            }
            for run, run_tags in self.data.items()
            if runs is None or run in runs
        }


def _content(kind: str, version: int = metadata.FORMAT_VERSION) -> bytes:
    return json.dumps({"version": version, "kind": kind}).encode()


def _datum(step: int, value, wall_time: float = 1.0) -> provider.TensorDatum:
    return provider.TensorDatum(step=step, wall_time=wall_time, numpy=value)


def _summary(schema, steps: int = 4, **extra) -> dict:
    columns = ["loss", "nonfinite"]
    return {
        "format_version": 1,
        "steps": steps,
        "status": "finished",
        "first_nonfinite": None,
        "explosion": None,
        "skipped_ranges": [],
        "series_columns": columns,
        "schema": schema.to_json(),
        **extra,
    }


def _string(value: str, as_object: bool = True) -> np.ndarray:
    if as_object:
        return np.array(value.encode(), dtype=object)
    return np.array(value.encode())


def test_fake_runs_good_and_bad_are_sorted_out(caplog):
    schema = build_schema(2)
    good = json.dumps(_summary(schema))
    series = np.array([[1.0, 0], [np.nan, 1]], np.float32)
    fake = FakeProvider(
        {
            "ok": {
                metadata.TAG_RUN: (
                    _content("run"),
                    # an older summary first: the last one is the latest
                    [_datum(1, _string("{}")), _datum(2, _string(good, False), 2.0)],
                ),
                metadata.series_tag(1): (_content("series"), [_datum(6, series)]),
                metadata.series_tag(0): (_content("series"), [_datum(0, series)]),
                "nanwatch/some_future_tag": (_content("run"), []),
            },
            "newer": {metadata.TAG_RUN: (_content("run", 2), [_datum(1, _string(good))])},
            "garbled": {metadata.TAG_RUN: (b"\xff not json", [])},
            "wrong_kind": {metadata.TAG_RUN: (_content("series"), [])},
            "bad_json": {metadata.TAG_RUN: (_content("run"), [_datum(1, _string("{nope"))])},
            "newer_summary": {
                metadata.TAG_RUN: (
                    _content("run"),
                    [_datum(1, _string(json.dumps(_summary(schema, format_version=9))))],
                )
            },
            "no_summary": {metadata.series_tag(0): (_content("series"), [_datum(0, series)])},
        }
    )
    reader.skip_warnings.forget()
    with caplog.at_level(logging.WARNING, logger="tb_nanwatch.board.reader"):
        runs = reader.load_runs(fake, CTX, "")
        reader.load_runs(fake, CTX, "")  # warnings are not repeated
    assert list(runs) == ["ok"]
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 5, messages
    for run in ("newer", "garbled", "wrong_kind", "bad_json", "newer_summary"):
        assert sum(repr(run) in m for m in messages) == 1
    loaded = reader.load_series(fake, CTX, "", runs["ok"])
    np.testing.assert_array_equal(loaded.steps, [0, 1, 6, 7])
    assert np.isnan(loaded.columns["loss"][1]) and np.isnan(loaded.columns["loss"][3])


def test_malformed_arrays_give_none_not_errors():
    schema = build_schema(2)
    summary = json.dumps(_summary(schema))
    fake = FakeProvider(
        {
            "r": {
                metadata.TAG_RUN: (_content("run"), [_datum(1, _string(summary))]),
                metadata.TAG_FLIGHT: (
                    _content("flight"),
                    [_datum(0, np.zeros((3, schema.size + 1), np.float32))],
                ),
                metadata.TAG_INCIDENT: (
                    _content("incident"),
                    [_datum(0, _string("[1]"))],
                ),
                metadata.layers_tag(0): (_content("layers"), [_datum(0, _string("x"))]),
                metadata.series_tag(0): (
                    _content("series"),
                    [_datum(0, np.zeros((4, 3), np.float32))],
                ),
            }
        }
    )
    run = reader.load_run(fake, CTX, "", "r")
    assert run is not None
    assert reader.load_flight(fake, CTX, "", run) is None
    assert reader.load_incident(fake, CTX, "", run) is None
    assert reader.load_layers(fake, CTX, "", run, 0) is None
    assert reader.load_series(fake, CTX, "", run) is None


def test_overlapping_chunks_keep_the_later_rows():
    chunks = [
        (0, np.array([[0.0], [1.0], [2.0]], np.float32)),
        (2, np.array([[20.0], [30.0]], np.float32)),
    ]
    series = reader._assemble_series(chunks, ["loss"])
    np.testing.assert_array_equal(series.steps, [0, 1, 2, 3])
    np.testing.assert_array_equal(series.columns["loss"], [0, 1, 20, 30])


def test_decode_json_keeps_nan_and_infinity():
    decoded = reader.decode_json(_string('{"a": NaN, "b": Infinity, "c": -Infinity}'))
    assert np.isnan(decoded["a"]) and decoded["b"] == np.inf and decoded["c"] == -np.inf


def test_plugin_serves_its_routes_without_tensorflow():
    code = (
        "import sys\n"
        "import tb_nanwatch.board.plugin\n"
        "from tensorboard.plugins import base_plugin\n"
        "tb_nanwatch.board.plugin.NanWatchPlugin(base_plugin.TBContext()).get_plugin_apps()\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras')]\n"
        "assert not bad, bad[:5]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
