"""Fuzzes the plugin's routes through TensorBoard's real WSGI app.

Random parameters, huge values, unicode, path tricks: every answer is 200, 400,
404 or 405 (never 500); only the package's static map is ever served as a
file; every other answer is JSON with ``nosniff``, so run, tag and layer names
(hostile ones included) only ever come back as JSON strings.
"""

from __future__ import annotations

import json
import os
from urllib.parse import quote, urlencode

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nanwatch_testlib import (
    PLUGIN,
    route_client,
    write_named_run,
)

from tb_nanwatch.board import plugin
from tb_nanwatch.record.writing.synthetic import write_synthetic_run

HOSTILE_RUN = "<script>alert('run')</script>"
HOSTILE_LAYER = "<img src=x onerror=alert('layer')>"
ROUTES = ["runs", "timeline", "incident", "step", "vocabulary", "index.js", "style.css"]
STATIC_BODIES = {
    route: open(os.path.join(plugin.STATIC_DIR, name), "rb").read()
    for route, (name, _) in plugin.STATIC_FILES.items()
    if os.path.exists(os.path.join(plugin.STATIC_DIR, name))
}
SETTINGS = settings(
    max_examples=int(os.environ.get("NANWATCH_FUZZ_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    logdir = str(tmp_path_factory.mktemp("fuzz") / "logs")
    write_synthetic_run(os.path.join(logdir, "plain"), 300, incident_step=250, snapshot_every=100)
    write_synthetic_run(os.path.join(logdir, "nested", "healthy \u00e9\u6f22"), 50, num_layers=2)
    write_named_run(
        os.path.join(logdir, HOSTILE_RUN),
        [HOSTILE_LAYER],
        bad_layer=0,
        bad_step=4,
        steps=6,
        model="<b>model</b>",
    )
    return route_client(logdir)


RUN_NAMES = ["plain", "nested/healthy \u00e9\u6f22", HOSTILE_RUN, "", ".", "..", "../plain"]
NUMBERS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.sampled_from(
        [
            "0",
            "1",
            "250",
            "9007199254740991",
            "9007199254740992",
            "1e309",
            "NaN",
            "-0",
            "0x10",
            " 5",
            "5 ",
            "\u0663",
            "\uff15",
            "\u00b2",
            "1_000",
            "+3",
        ]
    ),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
)
VALUES = st.one_of(
    NUMBERS,
    st.sampled_from(RUN_NAMES),
    st.text(max_size=40),
    st.text(alphabet=st.characters(codec="utf-8"), min_size=1000, max_size=5000),
)
PARAM_NAMES = st.one_of(
    st.sampled_from(["run", "step", "start", "end", "max_points", "experiment"]),
    st.text(max_size=8),
)
PATH_TRICKS = st.sampled_from(
    [
        "",
        "/",
        "/../plugin.py",
        "/..%2fplugin.py",
        "/%2e%2e/%2e%2e/etc/passwd",
        "/static/index.js",
        "/index.js/",
        "/index.js/../plugin.py",
        "/index.js%00.py",
        "//index.js",
        "/INDEX.JS",
        "/style.css;.py",
        "/plugin.py",
        "/__init__.py",
        "/static",
        "/runs/extra",
        "/\u2024\u2024/plugin.py",
    ]
)


def _query(params: list[tuple[str, str]]) -> str:
    try:
        return urlencode(params, doseq=True)
    except UnicodeEncodeError:
        return ""


def check_response(response, path: str, head: bool = False) -> None:
    status = response.status_code
    assert status in (200, 400, 404, 405), (path, status, response.data[:300])
    body = response.get_data()
    ctype = response.headers.get("Content-Type", "")
    if status == 200 and not ctype.startswith("application/json"):
        # A file: only ever one of the static map's, byte for byte.
        assert body in STATIC_BODIES.values() or (head and not body), (path, ctype)
        assert ctype.split(";")[0] in ("text/javascript", "text/css"), (path, ctype)
        return
    if not path.startswith(PLUGIN + "/"):
        return  # TensorBoard's own 404 page for paths outside the plugin
    if status == 404 and not ctype.startswith("application/json"):
        return  # TensorBoard's router: no such route (text, not HTML)
    assert ctype.startswith("application/json"), (path, status, ctype)
    assert response.headers.get("X-Content-Type-Options") == "nosniff"
    parsed = json.loads(body)  # valid JSON: names are inside JSON strings
    if status != 200:
        assert set(parsed) == {"error"} and isinstance(parsed["error"], str)


@SETTINGS
@given(
    route=st.sampled_from(ROUTES),
    params=st.lists(st.tuples(PARAM_NAMES, VALUES), max_size=5),
)
def test_routes_with_random_parameters(client, route, params):
    path = f"{PLUGIN}/{route}"
    query = _query(params)
    response = client.get(f"{path}?{query}" if query else path)
    check_response(response, path)
    if route in ("index.js", "style.css") and response.status_code == 200:
        assert response.get_data() == STATIC_BODIES[f"/{route}"]


@SETTINGS
@given(
    trick=PATH_TRICKS,
    suffix=st.text(max_size=30),
    method=st.sampled_from(["GET", "GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS"]),
)
def test_random_paths_and_methods(client, trick, suffix, method):
    path = PLUGIN + trick + quote(suffix, safe="/%.")
    response = client.open(path, method=method)
    check_response(response, path, head=method == "HEAD")


@SETTINGS
@given(
    run=st.sampled_from(RUN_NAMES),
    start=st.one_of(st.none(), st.integers(0, 2**60)),
    end=st.one_of(st.none(), st.integers(0, 2**60)),
    max_points=st.one_of(st.none(), st.integers(-5, 300_000)),
    step=st.one_of(st.none(), st.integers(-5, 2**62)),
)
def test_numeric_ranges_of_real_runs(client, run, start, end, max_points, step):
    for route, params in (
        ("timeline", {"run": run, "start": start, "end": end, "max_points": max_points}),
        ("step", {"run": run, "step": step}),
        ("incident", {"run": run}),
    ):
        query = urlencode({k: v for k, v in params.items() if v is not None})
        path = f"{PLUGIN}/{route}"
        response = client.get(f"{path}?{query}")
        check_response(response, path)


def test_hostile_names_come_back_as_json_strings_only(client):
    """The names travel as JSON string values, never as markup."""
    runs = json.loads(client.get(f"{PLUGIN}/runs").get_data())["runs"]
    assert HOSTILE_RUN in [r["run"] for r in runs]
    response = client.get(f"{PLUGIN}/incident?" + urlencode({"run": HOSTILE_RUN}))
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("application/json")
    assert response.headers["X-Content-Type-Options"] == "nosniff"
    body = json.loads(response.get_data())
    assert body["run"] == HOSTILE_RUN
    assert body["incident"]["layer"] == HOSTILE_LAYER
    assert HOSTILE_LAYER in body["heatmap"]["layers"]
    step = json.loads(
        client.get(f"{PLUGIN}/step?" + urlencode({"run": HOSTILE_RUN, "step": 4})).get_data()
    )
    assert HOSTILE_LAYER in [row["layer"] for row in step["rows"]]
