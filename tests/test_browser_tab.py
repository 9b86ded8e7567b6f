"""The NaN Watch tab as a TensorBoard user expects it (issue 15), in a real
TensorBoard driven by headless Chromium: dark mode, a 1024 px window, live
reload, readable axes, the run filter, downloads, the origin row.

Screenshots go to test-artifacts/ (1024 and 1600 px, light and dark).
"""

from __future__ import annotations

import csv
import io
import json
import math
import time
from pathlib import Path

import nanwatch_testlib as lib
import pytest
from nanwatch_testlib import CHROMIUM, base_vector
from test_browser import ARTIFACTS, TIMEOUT_MS, Watched, browser, tensorboard  # noqa: F401
from test_browser_readability import LOW_CONTRAST_TEXT

from tb_nanwatch.board.plugin import MAX_MAX_POINTS

pytest.importorskip("playwright.sync_api")

pytestmark = [
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"no Chromium at {CHROMIUM}"),
    pytest.mark.timeout(300),
]

INCIDENT_STEP = 250
INCIDENT_LAYER = 3


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> tuple[Path, dict]:
    """broken (forward NaN at step 250), healthy, and a 4-step healthy run."""
    from tb_nanwatch.record.writing.synthetic import write_synthetic_run

    logdir = tmp_path_factory.mktemp("nanwatch_tab")
    broken = write_synthetic_run(
        str(logdir / "broken"),
        steps=400,
        num_layers=10,
        incident_step=INCIDENT_STEP,
        incident_layer=INCIDENT_LAYER,
        seed=1,
        snapshot_every=100,
    )
    write_synthetic_run(str(logdir / "healthy"), steps=400, num_layers=10, seed=2)
    lib.write_vector_run(str(logdir / "tiny"), 4)
    return logdir, broken["first_nonfinite"]


@pytest.fixture(scope="module")
def server(logs, tmp_path_factory):
    logdir, _ = logs
    with tensorboard(logdir, tmp_path_factory.mktemp("tb"), want_runs=3) as base:
        yield base


def _open(browser, base: str, width: int = 1600, height: int = 1100):  # noqa: F811
    watched = Watched(browser, width=width, height=height)
    frame = watched.open_tab(base)
    frame.locator("#timeline[data-state=ready]").wait_for(timeout=TIMEOUT_MS)
    frame.locator("#incident-card[data-state=nonfinite]").wait_for(timeout=TIMEOUT_MS)
    frame.locator("#heatmap[data-state=ready]").wait_for(timeout=TIMEOUT_MS)
    return watched, frame


def _box(frame, selector: str) -> dict:
    box = frame.locator(selector).first.bounding_box()
    assert box, selector
    return box


def _iframe_box(watched) -> dict:
    return watched.page.locator('iframe[src*="plugin_entry.html?name=nanwatch"]').bounding_box()


def _set_tensorboard_theme(page, label: str) -> None:
    """Uses TensorBoard's own header menu: 'Light', 'Dark' or 'Browser default'."""
    page.locator('button[aria-label="Menu for changing light or dark theme"]').click()
    page.locator("[mat-menu-item]", has_text=label).first.click()


def _luminance(css_colour: str) -> float:
    parts = css_colour[css_colour.index("(") + 1 : css_colour.index(")")].split(",")
    r, g, b = (float(p) / 255 for p in parts[:3])
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def _background(frame) -> float:
    return _luminance(frame.locator("body").evaluate("b => getComputedStyle(b).backgroundColor"))


def _screenshot(watched, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    watched.page.screenshot(path=str(ARTIFACTS / f"{name}.png"))


def _show_origin_layers(frame, step: int) -> None:
    frame.locator(f'#incident-card [data-action=show-step][data-step="{step}"]').click()
    frame.locator(f'#step-table[data-state=ready][data-step="{step}"]').wait_for(timeout=TIMEOUT_MS)


# -- dark mode ---------------------------------------------------------------------


def test_tab_follows_tensorboards_dark_mode(browser, server, logs):  # noqa: F811
    _, incident = logs
    for width in (1600, 1024):
        watched, frame = _open(browser, server, width=width)
        try:
            _set_tensorboard_theme(watched.page, "Light")
            html = frame.locator("html")
            assert html.get_attribute("data-theme") == "light"
            assert _background(frame) > 0.8
            _screenshot(watched, f"tab-{width}-light-top")
            _show_origin_layers(frame, incident["step"])
            _screenshot(watched, f"tab-{width}-light-table")
            # Every text, the step table's origin row included, reads at 4.5:1 at least.
            assert frame.locator("html").evaluate(LOW_CONTRAST_TEXT) == []

            _set_tensorboard_theme(watched.page, "Dark")
            frame.locator("html[data-theme=dark]").wait_for(timeout=TIMEOUT_MS)
            assert watched.page.locator("body.dark-mode").count() == 1
            assert _background(frame) < 0.3
            # Text and the step table follow: light text on the dark page.
            assert (
                _luminance(
                    frame.locator(".run-title").first.evaluate("e => getComputedStyle(e).color")
                )
                > 0.7
            )
            th = frame.locator("#step-table th").first
            assert _luminance(th.evaluate("e => getComputedStyle(e).backgroundColor")) < 0.4
            # The timeline canvas was redrawn: its axis text is light now.
            watched.page.wait_for_timeout(300)
            assert frame.locator("html").evaluate(LOW_CONTRAST_TEXT) == []
            _screenshot(watched, f"tab-{width}-dark-table")
            frame.locator("#incident-card").scroll_into_view_if_needed()
            _screenshot(watched, f"tab-{width}-dark-top")

            _set_tensorboard_theme(watched.page, "Light")
            frame.locator("html[data-theme=light]").wait_for(timeout=TIMEOUT_MS)
            assert watched.errors == [], watched.errors
        finally:
            watched.close()


# -- layout ------------------------------------------------------------------------


def test_1024_px_window_clips_nothing(browser, server, logs):  # noqa: F811
    _, incident = logs
    watched, frame = _open(browser, server, width=1024)
    try:
        frame_box = _iframe_box(watched)
        card = _box(frame, "#incident-card")
        assert card["x"] >= frame_box["x"] - 1
        assert card["x"] + card["width"] <= frame_box["x"] + frame_box["width"] + 1, (
            card,
            frame_box,
        )
        assert frame.locator("#incident-card").evaluate("e => e.scrollWidth <= e.clientWidth")
        # No horizontal scrolling of the whole page.
        assert frame.locator("html").evaluate("e => e.scrollWidth <= e.clientWidth + 1")
        # Every part of the panel fits in the iframe's width.
        for part in ("#timeline", "#heatmap", "#step-table"):
            box = _box(frame, part)
            assert box["x"] + box["width"] <= frame_box["x"] + frame_box["width"] + 1, part
        _show_origin_layers(frame, incident["step"])
        assert watched.errors == [], watched.errors
    finally:
        watched.close()


def test_step_table_columns_fit_at_1600_px(browser, server, logs):  # noqa: F811
    _, incident = logs
    watched, frame = _open(browser, server, width=1600)
    try:
        _show_origin_layers(frame, incident["step"])
        scroller = _box(frame, "#step-table .table-scroll")
        headers = frame.locator("#step-table th")
        names = [h.strip() for h in headers.all_inner_texts()]
        assert {"max abs", "norm", "value"} <= set(names), names
        for i in range(headers.count()):
            box = headers.nth(i).bounding_box()
            assert box["x"] + box["width"] <= scroller["x"] + scroller["width"] + 1, names[i]
        assert frame.locator("#step-table .table-scroll").evaluate(
            "e => e.scrollWidth <= e.clientWidth"
        )
    finally:
        watched.close()


def test_heatmap_column_labels_do_not_overlap(browser, server):  # noqa: F811
    watched, frame = _open(browser, server, width=1024)
    try:
        labels = frame.locator("#heatmap .heatmap-col-label")
        boxes = sorted(
            (labels.nth(i).bounding_box() for i in range(labels.count())), key=lambda b: b["x"]
        )
        assert len(boxes) >= 2
        for a, b in zip(boxes, boxes[1:], strict=False):
            assert a["x"] + a["width"] <= b["x"], (a, b)
        assert frame.locator("#heatmap .heatmap-col-label.origin").count() == 1
    finally:
        watched.close()


# -- timeline ----------------------------------------------------------------------


def test_four_step_run_has_integer_step_ticks_and_labelled_axes(browser, server):  # noqa: F811
    watched, frame = _open(browser, server)
    try:
        frame.locator('#run-selector .run-item[data-run="tiny"] input').check()
        timeline = frame.locator('.run-panel[data-run="tiny"] .timeline')
        timeline.locator("xpath=self::*[@data-state='ready']").wait_for(timeout=TIMEOUT_MS)
        ticks_x = timeline.get_attribute("data-ticks-x").split()
        assert ticks_x, "no step ticks"
        assert all(t.lstrip("-").isdigit() for t in ticks_x), ticks_x
        assert set(ticks_x) <= {"0", "1", "2", "3"}, ticks_x
        assert timeline.get_attribute("data-ticks-left").split()
        assert len(timeline.get_attribute("data-ticks-right").split()) >= 2
        legend = timeline.locator(".u-legend").inner_text()
        for name in ("loss (left)", "grad norm (left)", "logit max (right)", "logit min (right)"):
            assert name in legend, legend
    finally:
        watched.close()


def test_nan_marks_are_inside_the_plot_and_hover_does_not_shift_the_page(browser, server):  # noqa: F811
    watched, frame = _open(browser, server)
    try:
        timeline = frame.locator("#timeline")
        # The run stopped at its NaN: the last step's marks are drawn inside the plot.
        assert int(timeline.get_attribute("data-marks-inside")) >= 1
        # Left-axis ticks are short labels (1e3, never 1000000000).
        assert all(len(t) <= 6 for t in timeline.get_attribute("data-ticks-left").split())

        page_height = frame.locator("html").evaluate("e => e.scrollHeight")
        timeline_box = _box(frame, "#timeline")
        legend_box = _box(frame, "#timeline .u-legend")
        over = _box(frame, "#timeline .u-over")
        for fraction in (0.05, 0.3, 0.6, 0.97):
            watched.page.mouse.move(over["x"] + over["width"] * fraction, over["y"] + 20)
            watched.page.wait_for_timeout(50)
            assert _box(frame, "#timeline") == timeline_box
            assert _box(frame, "#timeline .u-legend")["height"] == legend_box["height"]
        assert frame.locator("html").evaluate("e => e.scrollHeight") == page_height
    finally:
        watched.close()


def test_zoomed_timeline_jumps_back_to_the_incident(browser, server, logs):  # noqa: F811
    _, incident = logs
    watched, frame = _open(browser, server)
    try:
        timeline = frame.locator("#timeline")
        over = _box(frame, "#timeline .u-over")
        y = over["y"] + over["height"] / 2
        watched.page.mouse.move(over["x"] + over["width"] * 0.05, y)
        watched.page.mouse.down()
        watched.page.mouse.move(over["x"] + over["width"] * 0.2, y, steps=5)
        watched.page.mouse.up()
        frame.locator("#timeline[data-state=ready][data-bucket='1']").wait_for(timeout=TIMEOUT_MS)
        assert int(timeline.get_attribute("data-view-end")) < incident["step"]
        frame.locator("#timeline [data-action=goto-incident]").click()
        watched.page.wait_for_function(
            """([step]) => {
              const f = document.querySelector('iframe[src*="plugin_entry.html?name=nanwatch"]');
              const t = f.contentDocument.querySelector('#timeline');
              return +t.dataset.viewStart <= step && step < +t.dataset.viewEnd;
            }""",
            arg=[incident["step"]],
            timeout=TIMEOUT_MS,
        )
    finally:
        watched.close()


# -- run filter ----------------------------------------------------------------------


def test_run_filter_narrows_the_run_list(browser, server):  # noqa: F811
    watched, frame = _open(browser, server)
    try:
        box = frame.locator("#run-selector [data-field=run-filter]")
        items = frame.locator("#run-selector .run-item")

        def shown():
            return sorted(items.evaluate_all("els => els.map(e => e.dataset.run)"))

        assert shown() == ["broken", "healthy", "tiny"]
        box.fill("HEAL")
        assert shown() == ["healthy"]
        box.fill("^(broken|tiny)$")
        assert shown() == ["broken", "tiny"]
        assert "2 of 3" in frame.locator("#run-selector [data-field=run-count]").inner_text()
        # The panel of a selected run the filter hides is hidden too.
        assert frame.locator('.run-panel[data-run="broken"]').is_visible()
        assert not frame.locator('.run-panel[data-run="healthy"]').is_visible()
        box.fill("b(")  # not a regular expression: matched as text, and marked
        assert shown() == []
        assert "invalid" in box.get_attribute("class")
        box.fill("")
        assert shown() == ["broken", "healthy", "tiny"]
        # The panels of the selected runs stay as they were, shown again.
        assert frame.locator(".run-panel").count() == 2
        assert frame.locator('.run-panel[data-run="healthy"]').is_visible()
    finally:
        watched.close()


# -- downloads -----------------------------------------------------------------------


def _route_timeline(base: str, run: str) -> dict:
    status, _, body = lib.http_get(
        f"{base}/data/plugin/nanwatch/timeline?run={run}&max_points={MAX_MAX_POINTS}"
    )
    assert status == 200
    return json.loads(body)


def _download(watched, frame, action: str) -> str:
    with watched.page.expect_download(timeout=TIMEOUT_MS) as info:
        frame.locator(f"#timeline [data-action={action}]").click()
    download = info.value
    path = download.path()
    assert download.suggested_filename.startswith("broken-timeline.")
    return Path(path).read_text()


def test_csv_and_json_downloads_hold_every_step_with_its_nan(browser, server):  # noqa: F811
    route = _route_timeline(server, "broken")
    assert route["bucket"] == 1
    watched, frame = _open(browser, server)
    try:
        rows = list(csv.DictReader(io.StringIO(_download(watched, frame, "download-csv"))))
        assert len(rows) == route["total_steps"] == len(route["steps"])
        columns = list(route["columns"])
        assert list(rows[0]) == ["step", *columns]
        non_finite = 0
        for i, row in enumerate(rows):
            assert int(row["step"]) == route["steps"][i]
            for name in columns:
                want = route["columns"][name][i]
                if isinstance(want, str):  # "NaN" / "Infinity" / "-Infinity"
                    assert row[name] == want, (i, name)
                    non_finite += 1
                elif want is None:
                    assert row[name] == ""
                else:
                    assert math.isclose(float(row[name]), want, rel_tol=1e-12), (i, name)
        assert non_finite >= 1, "the incident's NaN must be in the CSV"

        saved = json.loads(_download(watched, frame, "download-json"))
        assert saved["steps"] == route["steps"]
        assert saved["columns"] == route["columns"]  # "NaN" stays "NaN"
        assert saved["first_nonfinite"] == route["first_nonfinite"]
        assert watched.errors == [], watched.errors
    finally:
        watched.close()


# -- step table, links -----------------------------------------------------------------


def test_show_layers_scrolls_to_the_table_and_singles_out_the_origin_row(
    browser,  # noqa: F811
    server,
    logs,
):
    _, incident = logs
    watched, frame = _open(browser, server, height=800)
    try:
        assert frame.locator("#heatmap").get_attribute("data-metric") == "forward_max_abs"
        _show_origin_layers(frame, incident["step"])
        table = frame.locator("#step-table")
        origin = table.locator("tr[data-origin=true]")
        assert origin.count() == 1
        assert origin.get_attribute("data-layer") == incident["layer"]
        assert origin.get_attribute("data-phase") == incident["phase"]
        assert "origin" in origin.get_attribute("class")
        # Other rows with NaN are not marked the same way.
        assert table.locator("tr.origin").count() == 1
        # The page scrolled to the table, and the table to the origin row.
        frame_box = _iframe_box(watched)
        row = origin.bounding_box()
        scroller = _box(frame, "#step-table .table-scroll")
        assert (
            scroller["y"] <= row["y"]
            and row["y"] + row["height"] <= scroller["y"] + scroller["height"]
        )
        assert frame_box["y"] <= row["y"] <= frame_box["y"] + frame_box["height"] - row["height"]
        # Loss rows show their value.
        loss_values = table.locator('tr[data-phase="loss"] td[data-col="value"]').all_inner_texts()
        assert loss_values and all(v.strip() not in ("", "–") for v in loss_values), loss_values
    finally:
        watched.close()


# -- live reload -------------------------------------------------------------------------


def test_tab_updates_on_tensorboards_reload_while_a_run_is_written(browser, tmp_path):  # noqa: F811
    from tb_nanwatch.evidence.options import WatchOptions
    from tb_nanwatch.record.writing.journal import RunJournal
    from tb_nanwatch.record.writing.synthetic import build_schema

    logdir = tmp_path / "logs"
    schema = build_schema(3)
    journal = RunJournal(
        str(logdir / "live"), schema, {"model": "live"}, WatchOptions(flush_secs=1e9)
    )

    def record(first: int, last: int) -> None:
        for step in range(first, last):
            journal.record(step, 0, step, base_vector(schema, step))
        journal.flush()

    record(0, 20)
    try:
        with tensorboard(logdir, tmp_path, extra_args=("--reload_interval=1",)) as base:
            watched = Watched(browser)
            try:
                frame = watched.open_tab(base)
                frame.locator("#timeline[data-state=ready][data-total-steps='20']").wait_for(
                    timeout=TIMEOUT_MS
                )
                record(20, 50)
                deadline = time.monotonic() + 60
                while _route_timeline(base, "live")["total_steps"] != 50:
                    assert time.monotonic() < deadline, "TensorBoard did not read the new steps"
                    time.sleep(0.5)
                # TensorBoard's own reload button, not the tab's.
                watched.page.locator("app-header-reload button").click()
                frame.locator("#timeline[data-state=ready][data-total-steps='50']").wait_for(
                    timeout=TIMEOUT_MS
                )
                status = frame.locator('#run-selector .run-item[data-run="live"]').inner_text()
                assert "50 steps" in status, status
                assert watched.errors == [], watched.errors
            finally:
                watched.close()
    finally:
        journal.close()
