"""A real ``tensorboard`` process finds the plugin through its entry point and
serves the routes, with the Python loader and with the Rust data server."""

from __future__ import annotations

import json

import nanwatch_testlib as lib
import pytest
from nanwatch_testlib import BIG_INCIDENT, XSS_RUN

from tb_nanwatch.board.plugin import MAX_MAX_POINTS

STARTUP_TIMEOUT = 120.0


@pytest.fixture(scope="module")
def logdir(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("tb_process_logs"))
    lib.write_standard_runs(root)
    return root


def _nanwatch_enabled(base: str) -> bool:
    status, _, body = lib.http_get(f"{base}/data/plugins_listing")
    return status == 200 and json.loads(body)["nanwatch"]["enabled"]


def tensorboard(logdir: str, load_fast: bool, log_path):
    return lib.tensorboard_process(
        logdir,
        log_path,
        _nanwatch_enabled,
        extra_args=(f"--load_fast={'true' if load_fast else 'false'}", "--reload_interval=1"),
        timeout=STARTUP_TIMEOUT,
    )


def _check_routes(base: str) -> None:
    plugin = f"{base}/data/plugin/nanwatch"
    status, headers, body = lib.http_get(f"{plugin}/runs")
    assert status == 200
    runs = lib.strict_json(body.decode())["runs"]
    assert [r["run"] for r in runs] == sorted(["big", "healthy", XSS_RUN])

    status, _, body = lib.http_get(f"{plugin}/timeline?run=big&max_points={MAX_MAX_POINTS}")
    timeline = lib.strict_json(body.decode())
    assert status == 200 and timeline["steps"] == list(range(BIG_INCIDENT + 1))
    assert timeline["columns"]["loss"][BIG_INCIDENT] == "NaN"

    status, _, body = lib.http_get(f"{plugin}/incident?run=big")
    assert status == 200
    assert lib.strict_json(body.decode())["incident"]["step"] == BIG_INCIDENT

    status, _, body = lib.http_get(f"{plugin}/step?run=big&step={BIG_INCIDENT}")
    assert status == 200 and lib.strict_json(body.decode())["source"] == "flight"
    assert lib.http_get(f"{plugin}/step?run=big&step=x")[0] == 400
    assert lib.http_get(f"{plugin}/step?run=nope&step=1")[0] == 404

    status, headers, _ = lib.http_get(f"{plugin}/index.js")
    assert status in (200, 404)
    if status == 200:
        assert headers["Content-Type"].startswith("text/javascript")
    status, _, body = lib.http_get(f"{plugin}/%2e%2e/plugin.py")
    assert 400 <= status < 500 and b"NanWatchPlugin" not in body

    status, _, body = lib.http_get(f"{base}/data/plugin_entry.html?name=nanwatch")
    assert status == 200 and b'import("./index.js")' in body


def test_python_loader(logdir, tmp_path):
    with tensorboard(logdir, False, tmp_path / "tensorboard.log") as base:
        _check_routes(base)


def test_rust_data_server(logdir, tmp_path):
    if lib.data_server_binary() is None:
        pytest.skip("tensorboard_data_server binary not installed")
    with tensorboard(logdir, True, tmp_path / "tensorboard.log") as base:
        _check_routes(base)
