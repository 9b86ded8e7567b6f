"""The plugin's HTTP routes, through TensorBoard's own WSGI app, on both the
Python loader and the Rust data server, with TensorBoard's default sampling."""

from __future__ import annotations

import logging
import os
import time
import urllib.parse

import nanwatch_testlib as lib
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nanwatch_testlib import BIG_INCIDENT, PLUGIN, XSS_RUN, get_json

from tb_nanwatch.board import plugin, reader
from tb_nanwatch.board.plugin import MAX_MAX_POINTS
from tb_nanwatch.evidence import metadata
from tb_nanwatch.record.writing.synthetic import write_synthetic_run

FUTURE_RUN = "future"
PROVIDERS = ["multiplexer", "data_server"]


def _write_future_run(path: str) -> None:
    """A run written by a newer format version: must be skipped, not guessed."""
    saved = metadata.FORMAT_VERSION
    metadata.FORMAT_VERSION = saved + 1
    try:
        write_synthetic_run(path, 20, num_layers=2)
    finally:
        metadata.FORMAT_VERSION = saved


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("plugin_logs"))
    lib.write_standard_runs(root)
    _write_future_run(os.path.join(root, FUTURE_RUN))
    return root


@pytest.fixture(scope="module", params=PROVIDERS)
def client(request, logdir):
    if request.param == "multiplexer":
        yield lib.route_client(logdir)
        return
    if lib.data_server_binary() is None:
        pytest.skip("tensorboard_data_server binary not installed")
    with lib.data_server_provider(logdir, expect_runs=4) as provider:
        yield lib.make_client(provider, logdir)


@pytest.fixture(scope="module")
def py_client(logdir):
    return lib.route_client(logdir)


def _q(**params) -> str:
    return urllib.parse.urlencode(params)


# -- listing and runs --------------------------------------------------------


def test_plugins_listing_enables_the_tab(client):
    listing = get_json(client, "/data/plugins_listing")
    assert listing["nanwatch"]["enabled"] is True
    assert listing["nanwatch"]["tab_name"] == "NaN Watch"
    assert listing["nanwatch"]["loading_mechanism"] == {
        "type": "IFRAME",
        "module_path": "/data/plugin/nanwatch/index.js",
    }


def test_runs_sorted_with_incident_and_nan_as_string(client):
    body = get_json(client, f"{PLUGIN}/runs")
    names = [r["run"] for r in body["runs"]]
    assert names == sorted(["big", "healthy", XSS_RUN])  # FUTURE_RUN skipped
    big = body["runs"][names.index("big")]
    assert big["steps"] == BIG_INCIDENT + 1
    assert big["status"] == "stopped"
    assert big["skipped_count"] == 0
    incident = big["first_nonfinite"]
    assert (incident["step"], incident["phase"], incident["kind"]) == (
        BIG_INCIDENT,
        "forward",
        "nan",
    )
    assert incident["layer"] == "model/block0/layer3"
    assert incident["loss"] == "NaN"
    healthy = body["runs"][names.index("healthy")]
    assert healthy["first_nonfinite"] is None
    assert healthy["explosion"] is None
    assert healthy["status"] == "finished"
    assert healthy["cause"] is None
    assert set(big["cause"]) == {"id", "summary"} and big["cause"]["id"] == "forward_math"


def test_hostile_run_name_comes_back_as_plain_json_string(client):
    body = get_json(client, f"{PLUGIN}/runs")
    assert XSS_RUN in [r["run"] for r in body["runs"]]
    response = client.get(f"{PLUGIN}/timeline?" + _q(run=XSS_RUN))
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("application/json")
    assert lib.strict_json(response.get_data(as_text=True))["run"] == XSS_RUN


def test_newer_format_run_is_skipped_with_one_warning(py_client, caplog):
    reader.skip_warnings.forget()
    with caplog.at_level(logging.WARNING, logger="tb_nanwatch.board.reader"):
        for _ in range(3):
            body = get_json(py_client, f"{PLUGIN}/runs")
            assert FUTURE_RUN not in [r["run"] for r in body["runs"]]
        get_json(py_client, f"{PLUGIN}/timeline?run={FUTURE_RUN}", status=404)
    warnings = [r for r in caplog.records if FUTURE_RUN in r.getMessage()]
    assert len(warnings) == 1
    assert "version" in warnings[0].getMessage()


# -- timeline ---------------------------------------------------------------


def test_every_step_and_the_exact_first_nonfinite_survive_default_sampling(client):
    body = get_json(client, f"{PLUGIN}/timeline?run=big&max_points={MAX_MAX_POINTS}")
    assert body["bucket"] == 1
    assert body["steps"] == list(range(BIG_INCIDENT + 1))
    nonfinite = body["columns"]["nonfinite"]
    assert nonfinite.index(1.0) == BIG_INCIDENT
    assert body["columns"]["loss"][BIG_INCIDENT] == "NaN"
    assert all(v != "NaN" for v in body["columns"]["loss"][:BIG_INCIDENT])
    assert body["first_nonfinite"]["step"] == BIG_INCIDENT
    assert body["total_steps"] == BIG_INCIDENT + 1


def test_timeline_default_reduction_keeps_the_nan(client):
    body = get_json(client, f"{PLUGIN}/timeline?run=big")
    assert body["bucket"] == 2  # ceil(4322 / 4000)
    assert len(body["steps"]) == 2161
    assert set(body["columns"]) >= {"loss", "grad_norm", "logit_min", "logit_max"}
    last = body["steps"].index(BIG_INCIDENT - 1)
    assert body["columns"]["loss"][last] == "NaN"
    assert body["columns"]["nonfinite"][last] == 1.0
    assert sum(body["columns"]["nonfinite"]) == 1.0
    coarse = get_json(client, f"{PLUGIN}/timeline?run=big&max_points=3")
    assert coarse["bucket"] == 1441
    assert coarse["steps"] == [0, 1441, 2882]
    assert coarse["columns"]["loss"][-1] == "NaN"
    assert coarse["columns"]["loss"][0] != "NaN"


def test_timeline_window_and_recorded_steps(client):
    body = get_json(client, f"{PLUGIN}/timeline?run=big&start=4300&end=4400")
    assert (body["start"], body["end"], body["bucket"]) == (4300, 4400, 1)
    assert body["steps"] == list(range(4300, BIG_INCIDENT + 1))
    assert body["columns"]["loss"][-1] == "NaN"
    window = list(range(BIG_INCIDENT - 31, BIG_INCIDENT + 1))
    assert body["recorded_steps"] == [0, 1000, 2000, 3000, 4000] + window
    assert body["skipped_ranges"] == []


# -- incident and step ------------------------------------------------------


def test_incident_heatmap_points_at_the_origin(client):
    body = get_json(client, f"{PLUGIN}/incident?run=big")
    assert body["incident"]["step"] == BIG_INCIDENT
    heatmap = body["heatmap"]
    assert heatmap["steps"] == list(range(BIG_INCIDENT - 31, BIG_INCIDENT + 1))
    assert heatmap["layers"][: heatmap["input_rows"]] == ["input_0"]
    assert len(heatmap["layers"]) == heatmap["input_rows"] + 10
    row = heatmap["layers"].index("model/block0/layer3")
    assert heatmap["nonfinite"][row] == [0] * 31 + [1]
    assert heatmap["forward_max_abs"][row][-1] == "NaN"
    assert all(isinstance(v, float) for v in heatmap["forward_max_abs"][row][:-1])
    assert heatmap["nonfinite"][0] == [0] * 32
    assert heatmap["origin"] == {
        "layer": "model/block0/layer3",
        "step": BIG_INCIDENT,
        "phase": "forward",
    }
    assert isinstance(body["hints"], list)
    cause = body["cause"]
    assert cause["id"] == "forward_math" and cause["evidence"]["layer"] == "model/block0/layer3"
    assert cause["remedies"] and cause["summary"].startswith("model/block0/layer3 turned")
    assert body["bundle"] is None  # a synthetic run has no reproduction bundle


def test_healthy_incident_is_null(client):
    body = get_json(client, f"{PLUGIN}/incident?run=healthy")
    assert body == {
        "run": "healthy",
        "incident": None,
        "cause": None,
        "bundle": None,
        "explosion": None,
        "heatmap": None,
        "hints": [],
        "warnings": [],
    }


def test_step_table_from_flight_window_and_snapshot(client):
    body = get_json(client, f"{PLUGIN}/step?run=big&step={BIG_INCIDENT}")
    assert body["source"] == "flight"
    rows = body["rows"]
    assert [r["phase"] for r in rows][:2] == ["input", "forward"]
    origin = next(
        r for r in rows if r["kind"] == "activation" and r["layer"] == "model/block0/layer3"
    )
    assert origin["nan"] == 3
    assert origin["min"] == "NaN" and origin["max_abs"] == "NaN"
    assert origin["norm"] is None and origin["value"] is None
    snapshot = get_json(client, f"{PLUGIN}/step?run=big&step=2000")
    assert snapshot["source"] == "snapshot"
    assert len(snapshot["rows"]) == len(rows)
    get_json(client, f"{PLUGIN}/step?run=big&step=1500", status=404)
    get_json(client, f"{PLUGIN}/step?run=big&step=999999", status=404)


# -- errors -----------------------------------------------------------------

BAD_REQUESTS = [
    "/timeline",
    "/incident",
    "/step?run=big",
    "/step",
    "/step?run=big&step=abc",
    "/step?run=big&step=-1",
    "/step?run=big&step=1.5",
    "/step?run=big&step=%201",
    "/step?run=big&step=1e3",
    "/step?run=big&step=" + "9" * 30,
    "/step?run=big&step=9007199254740992",
    "/step?run=big&step=%EF%BC%91",  # fullwidth digit one
    "/timeline?run=big&max_points=0",
    f"/timeline?run=big&max_points={MAX_MAX_POINTS + 1}",
    "/timeline?run=big&max_points=200000",
    "/timeline?run=big&max_points=many",
    "/timeline?run=big&start=-5",
    "/timeline?run=big&start=10&end=10",
    "/timeline?run=big&start=10&end=3",
]


@pytest.mark.parametrize("path", BAD_REQUESTS)
def test_bad_parameters_answer_400_json(client, path):
    body = get_json(client, PLUGIN + path, status=400)
    assert isinstance(body["error"], str) and body["error"]


@pytest.mark.parametrize("route", ["timeline", "incident", "step"])
@pytest.mark.parametrize("run", ["nope", "../big", "%2e%2e/big", "big/..", ""])
def test_unknown_runs_answer_404_json(client, route, run):
    body = get_json(client, f"{PLUGIN}/{route}?" + _q(run=run, step=0), status=404)
    assert "error" in body


def test_post_is_refused(py_client):
    response = py_client.post(f"{PLUGIN}/runs")
    assert response.status_code == 405
    assert "error" in lib.strict_json(response.get_data(as_text=True))


def test_unexpected_failure_is_logged_and_answered_without_500(py_client, monkeypatch, caplog):
    def boom(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(reader, "load_series", boom)
    with caplog.at_level(logging.ERROR, logger="tb_nanwatch.board.plugin"):
        body = get_json(py_client, f"{PLUGIN}/timeline?run=big", status=400)
    assert "disk on fire" in body["error"]
    assert any("disk on fire" in r.getMessage() or r.exc_info for r in caplog.records)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    route=st.sampled_from(["runs", "timeline", "incident", "step", "index.js"]),
    params=st.dictionaries(
        st.sampled_from(["run", "step", "start", "end", "max_points"]),
        st.one_of(
            st.text(max_size=12),
            st.integers(-(2**70), 2**70).map(str),
            st.sampled_from(["big", "healthy", XSS_RUN, "4321", "0"]),
        ),
        max_size=5,
    ),
)
def test_no_query_string_causes_a_server_error(py_client, route, params):
    response = py_client.get(f"{PLUGIN}/{route}?" + _q(**params))
    assert response.status_code < 500
    if response.status_code >= 400:
        assert "error" in lib.strict_json(response.get_data(as_text=True))


# -- static files and path tricks ------------------------------------------


@pytest.mark.parametrize(
    ("route", "mime"), [("/index.js", "text/javascript"), ("/style.css", "text/css")]
)
def test_static_files_from_the_explicit_map(client, route, mime):
    response = client.get(PLUGIN + route)
    filename = plugin.STATIC_FILES[route][0]
    if not os.path.exists(os.path.join(plugin.STATIC_DIR, filename)):
        assert response.status_code == 404
        return
    assert response.status_code == 200
    assert response.headers["Content-Type"].split(";")[0] == mime
    assert response.headers["X-Content-Type-Options"] == "nosniff"


def test_static_file_missing_is_404_json(py_client, monkeypatch, tmp_path):
    monkeypatch.setattr(plugin, "STATIC_DIR", str(tmp_path))
    body = get_json(py_client, f"{PLUGIN}/index.js", status=404)
    assert "index.js" in body["error"]


PATH_TRICKS = [
    "/../plugin.py",
    "/%2e%2e/plugin.py",
    "/%2E%2E/%2E%2E/setup.py",
    "/static/../plugin.py",
    "/static/index.js",
    "/index.js/../plugin.py",
    "/..%2fplugin.py",
    "/%2e%2e%2f%2e%2e%2fsetup.py",
    "/....//plugin.py",
    "/index.js%00.py",
    "/plugin.py",
    "/static/%2e%2e/metadata.py",
]


@pytest.mark.parametrize("path", PATH_TRICKS)
def test_path_tricks_are_refused(client, path):
    response = client.get(PLUGIN + path)
    assert 400 <= response.status_code < 500
    data = response.get_data()
    assert b"NanWatchPlugin" not in data and b"import " not in data
    assert b"setup(" not in data


# -- speed ------------------------------------------------------------------


def _timeline_timings(client) -> list[float]:
    timings = []
    for _ in range(3):
        began = time.perf_counter()
        body = get_json(client, f"{PLUGIN}/timeline?run=long")
        timings.append(time.perf_counter() - began)
    assert body["total_steps"] == 100_000
    assert body["bucket"] == 25 and len(body["steps"]) == 4000
    return timings


def test_timeline_of_a_100k_step_run_answers_within_a_second(tmp_path):
    root = str(tmp_path)
    lib.write_fast_series_run(os.path.join(root, "long"), 100_000)
    timings = _timeline_timings(lib.route_client(root))
    assert max(timings) < 1.0, timings
    if lib.data_server_binary() is not None:
        with lib.data_server_provider(root, expect_runs=1) as grpc:
            timings = _timeline_timings(lib.make_client(grpc, root))
        assert max(timings) < 1.0, timings
