"""End-to-end: the NaN Watch tab in a real TensorBoard, driven by headless Chromium.

A real ``tensorboard`` subprocess serves logs written by
:func:`tb_nanwatch.record.writing.synthetic.write_synthetic_run`; Playwright opens the tab and
checks what a user sees. Set ``NANWATCH_TEST_LOGDIR`` to point the main test
at other logs (the demo logs); ``NANWATCH_TEST_EXPECT`` (JSON
``{"broken": run, "step": int, "layer": str, "healthy": run}``, optionally
``"stops_at_incident": true``) then names the
expected incident, else it is read from the runs' own summaries.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import nanwatch_testlib as lib
import pytest
from nanwatch_testlib import CHROMIUM, CHROMIUM_ARGS, XSS_RUN, canvas_ink

playwright_sync = pytest.importorskip("playwright.sync_api")

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
IFRAME = 'iframe[src*="plugin_entry.html?name=nanwatch"]'
TIMEOUT_MS = 30_000

pytestmark = [
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"no Chromium at {CHROMIUM}"),
    pytest.mark.timeout(300),
]


# -- logs ------------------------------------------------------------------


def _write_logs(logdir: Path) -> dict:
    """Writes the test runs; returns what the UI must show.

    This is the one place that creates logs for the main browser test.
    """
    from tb_nanwatch.record.writing.synthetic import write_synthetic_run

    broken = write_synthetic_run(
        str(logdir / "broken"),
        steps=400,
        num_layers=10,
        incident_step=250,
        incident_layer=3,
        seed=1,
        snapshot_every=100,
    )
    write_synthetic_run(
        str(logdir / "healthy"), steps=400, num_layers=10, seed=2, snapshot_every=100
    )
    incident = broken["first_nonfinite"]
    assert incident is not None and incident["step"] == 250
    return {
        "broken": "broken",
        "healthy": "healthy",
        "step": incident["step"],
        "layer": incident["layer"],
        "stops_at_incident": True,
    }


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> tuple[Path, dict]:
    """(logdir, expected): synthetic runs, or NANWATCH_TEST_LOGDIR with NANWATCH_TEST_EXPECT."""
    override = os.environ.get("NANWATCH_TEST_LOGDIR")
    if override:
        expect = json.loads(os.environ.get("NANWATCH_TEST_EXPECT", "null") or "null")
        return Path(override), expect
    logdir = tmp_path_factory.mktemp("nanwatch_logs")
    return logdir, _write_logs(logdir)


# -- TensorBoard -----------------------------------------------------------


def _get_json(url: str):
    status, _, body = lib.http_get(url)
    if status != 200:
        raise ValueError(f"{url} answered {status}")
    return json.loads(body)


def tensorboard(logdir: Path, tmp: Path, path_prefix: str = "", want_runs: int = 1, extra_args=()):
    """Runs TensorBoard until the nanwatch `runs` route lists `want_runs` runs; yields its base URL."""

    def ready(base: str) -> bool:
        return len(_get_json(f"{base}/data/plugin/nanwatch/runs")["runs"]) >= want_runs

    return lib.tensorboard_process(
        logdir,
        tmp / "tensorboard.log",
        ready,
        extra_args=("--load_fast=false", *extra_args),
        path_prefix=path_prefix,
        timeout=90,
    )


# -- browser ---------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    with playwright_sync.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


class Watched:
    """A page with its console errors, page errors and dialogs recorded."""

    def __init__(self, browser, width: int = 1600, height: int = 1300):
        self.page = browser.new_page(
            viewport={"width": width, "height": height}, accept_downloads=True
        )
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        self.page.on("console", self._on_console)
        self.page.on("pageerror", lambda exc: self.errors.append(f"pageerror: {exc}"))
        self.page.on("dialog", self._on_dialog)

    def _on_console(self, msg):
        url = msg.location.get("url", "")
        # TensorBoard's own page requests its fonts by absolute URL, which 404s
        # under --path_prefix (upstream; not this plugin's requests).
        if msg.type == "error" and "/font-roboto/" in url and "plugin" not in url:
            return
        if msg.type == "error":
            self.errors.append(f"console.error: {msg.text} @ {msg.location.get('url', '')}")

    def _on_dialog(self, dialog):
        self.dialogs.append(dialog.message)
        dialog.dismiss()

    def open_tab(self, base: str):
        """Opens TensorBoard on the NaN Watch tab; returns the plugin iframe's FrameLocator."""
        self.page.goto(f"{base}/#nanwatch")
        frame = self.page.frame_locator(IFRAME)
        frame.locator("#nanwatch[data-state=ready]").wait_for(timeout=TIMEOUT_MS)
        return frame

    def close(self):
        self.page.close()


@pytest.fixture()
def watched(browser):
    w = Watched(browser)
    yield w
    w.close()


# -- tests -----------------------------------------------------------------


def test_nanwatch_tab_shows_the_incident(browser, watched, logs, tmp_path):
    logdir, expect = logs
    if expect is None:
        pytest.skip("NANWATCH_TEST_LOGDIR set without NANWATCH_TEST_EXPECT")
    want = 2 if expect.get("healthy") else 1
    with tensorboard(logdir, tmp_path, want_runs=want) as base:
        frame = watched.open_tab(base)
        panel = frame.locator(f'.run-panel[data-run="{expect["broken"]}"]')
        panel.wait_for(timeout=TIMEOUT_MS)

        # Incident card: the right step and layer.
        card = frame.locator("#incident-card")
        card.locator("[data-field=step]").wait_for(timeout=TIMEOUT_MS)
        assert card.get_attribute("data-state") == "nonfinite"
        assert card.locator("[data-field=step]").inner_text().strip() == str(expect["step"])
        if expect["layer"]:
            assert card.locator("[data-field=layer]").inner_text().strip() == expect["layer"]
        else:  # an empty field is not shown
            assert card.locator("[data-field=layer]").count() == 0

        # Run selector: the broken run is flagged, the healthy one is healthy.
        sel = frame.locator("#run-selector")
        assert (
            sel.locator(f'.run-item[data-run="{expect["broken"]}"]').get_attribute("data-state")
            == "nonfinite"
        )
        if expect.get("healthy"):
            assert (
                sel.locator(f'.run-item[data-run="{expect["healthy"]}"]').get_attribute(
                    "data-state"
                )
                == "healthy"
            )
            healthy_card = frame.locator(
                f'.run-panel[data-run="{expect["healthy"]}"] .incident-card'
            )
            healthy_card.locator(".card-title").wait_for(timeout=TIMEOUT_MS)
            assert healthy_card.get_attribute("data-state") == "healthy"

        # Timeline: uPlot drew its canvas with series paths and the incident marker.
        timeline = frame.locator("#timeline")
        frame.locator("#timeline[data-state=ready]").wait_for(timeout=TIMEOUT_MS)
        canvas = frame.locator("#timeline canvas").first
        box = canvas.bounding_box()
        assert box and box["width"] > 100 and box["height"] > 100, box
        assert int(timeline.get_attribute("data-series-drawn") or 0) >= 2
        assert canvas_ink(frame, "#timeline canvas") > 1000

        # Heatmap: the origin is highlighted.
        heatmap = frame.locator("#heatmap")
        frame.locator("#heatmap[data-state=ready]").wait_for(timeout=TIMEOUT_MS)
        assert heatmap.get_attribute("data-origin-step") == str(expect["step"])
        if expect["layer"]:
            assert heatmap.get_attribute("data-origin-layer") == expect["layer"]
        origin = frame.locator("#heatmap .heatmap-origin[data-origin=true]")
        assert origin.is_visible()
        assert canvas_ink(frame, "#heatmap canvas") > 100

        # Clicking a heatmap column loads that step's per-layer table.
        table = frame.locator("#step-table")
        origin_box = origin.bounding_box()
        canvas_box = frame.locator("#heatmap canvas").bounding_box()
        watched.page.mouse.click(origin_box["x"] + origin_box["width"] / 2, canvas_box["y"] + 3)
        frame.locator(f'#step-table[data-state=ready][data-step="{expect["step"]}"]').wait_for(
            timeout=TIMEOUT_MS
        )
        assert table.locator("tbody tr").count() > 0
        assert table.locator("td.nonfinite").count() > 0

        # Clicking the timeline loads the clicked step (a table, or the nearest recorded steps).
        over = frame.locator("#timeline .u-over").bounding_box()
        watched.page.mouse.move(over["x"] + over["width"] * 0.3, over["y"] + over["height"] / 2)
        watched.page.mouse.click(over["x"] + over["width"] * 0.3, over["y"] + over["height"] / 2)
        frame.locator(f'#step-table:not([data-step="{expect["step"]}"])').wait_for(
            timeout=TIMEOUT_MS
        )
        frame.locator("#step-table[data-state=ready], #step-table[data-state=missing]").wait_for(
            timeout=TIMEOUT_MS
        )
        if table.get_attribute("data-state") == "missing":
            # Follow the first suggested recorded step.
            suggestion = table.locator("button[data-step]").first
            step = suggestion.get_attribute("data-step")
            suggestion.click()
            frame.locator(f'#step-table[data-state=ready][data-step="{step}"]').wait_for(
                timeout=TIMEOUT_MS
            )

        # Hover read-out of exact values (uPlot's live legend); the run stopped
        # at the incident, whose NaN loss is the last point.
        watched.page.mouse.move(over["x"] + over["width"] * 0.5, over["y"] + over["height"] / 2)
        assert "loss" in frame.locator("#timeline .u-legend").inner_text()
        if expect.get("stops_at_incident"):
            watched.page.mouse.move(over["x"] + over["width"] - 1, over["y"] + over["height"] / 2)
            legend = frame.locator("#timeline .u-legend").inner_text()
            assert str(expect["step"]) in legend and "NaN" in legend, legend

        # Zoom by dragging: the zoomed view is re-fetched exactly (bucket 1).
        y = over["y"] + over["height"] / 2
        watched.page.mouse.move(over["x"] + over["width"] * 0.4, y)
        watched.page.mouse.down()
        watched.page.mouse.move(over["x"] + over["width"] * 0.5, y, steps=5)
        watched.page.mouse.move(over["x"] + over["width"] * 0.6, y, steps=5)
        watched.page.mouse.up()
        frame.locator("#timeline[data-state=ready][data-bucket='1']").wait_for(timeout=TIMEOUT_MS)
        start, end = (
            int(timeline.get_attribute("data-start")),
            int(timeline.get_attribute("data-end")),
        )
        view = int(timeline.get_attribute("data-view-end")) - int(
            timeline.get_attribute("data-view-start")
        )
        frame.locator("#timeline [data-action=reset-zoom]").click()
        frame.locator("#timeline[data-view-start='0']").wait_for(timeout=TIMEOUT_MS)
        assert 0 < view < int(timeline.get_attribute("data-view-end"))

        ARTIFACTS.mkdir(exist_ok=True)
        watched.page.screenshot(path=str(ARTIFACTS / "nanwatch.png"), full_page=True)
        assert end > start
        assert watched.errors == [], watched.errors
        assert watched.dialogs == []


@pytest.fixture(scope="module")
def xss_logdir(tmp_path_factory) -> Path:
    from tb_nanwatch.record.writing.synthetic import write_synthetic_run

    logdir = tmp_path_factory.mktemp("nanwatch_xss")
    write_synthetic_run(
        str(logdir / XSS_RUN),
        steps=60,
        num_layers=3,
        incident_step=40,
        seed=3,
        snapshot_every=20,
    )
    return logdir


def test_run_names_render_as_text(browser, watched, xss_logdir, tmp_path):
    with tensorboard(xss_logdir, tmp_path) as base:
        frame = watched.open_tab(base)
        frame.locator("#incident-card[data-state=nonfinite]").wait_for(timeout=TIMEOUT_MS)
        frame.locator("#timeline[data-state=ready]").wait_for(timeout=TIMEOUT_MS)
        assert frame.locator(".run-name").first.inner_text() == XSS_RUN
        assert frame.locator(".run-title").first.inner_text() == XSS_RUN
        assert frame.locator('img[src="x"]').count() == 0
        assert watched.page.locator('img[src="x"]').count() == 0
        watched.page.wait_for_timeout(300)
        assert watched.dialogs == []
        assert watched.errors == [], watched.errors


def test_tab_loads_under_path_prefix(browser, watched, xss_logdir, tmp_path):
    with tensorboard(xss_logdir, tmp_path, path_prefix="/tb") as base:
        frame = watched.open_tab(base)
        frame.locator("#incident-card[data-state=nonfinite]").wait_for(timeout=TIMEOUT_MS)
        frame.locator("#timeline[data-state=ready]").wait_for(timeout=TIMEOUT_MS)
        frame.locator("#heatmap[data-state=ready]").wait_for(timeout=TIMEOUT_MS)
        assert frame.locator("#incident-card [data-field=step]").inner_text().strip() == "40"
        assert watched.errors == [], watched.errors
