"""``tb-nanwatch export``: one HTML file, opened from file:// with no network.

Headless Chromium opens the exported file with every non-file request
aborted (and counted): the incident card names the right step and layer, the
timeline and heatmap are drawn, the step tables load, hostile run names stay
text, and the console stays clean.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
from nanwatch_testlib import CHROMIUM, CHROMIUM_ARGS, XSS_RUN, canvas_ink

from tb_nanwatch import cli
from tb_nanwatch.board import export
from tb_nanwatch.record.writing.synthetic import write_synthetic_run

TIMEOUT_MS = 30_000
STEPS, INCIDENT, LAYER = 3000, 2500, 3
LAYER_NAME = f"model/block0/layer{LAYER}"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    logdir = root / "logs"
    write_synthetic_run(str(logdir / "broken"), STEPS, incident_step=INCIDENT, incident_layer=LAYER)
    write_synthetic_run(str(logdir / "healthy"), 200)
    write_synthetic_run(str(logdir / XSS_RUN), 40, num_layers=3)  # shown as the healthy one
    output = root / "share" / "incident.html"
    output.parent.mkdir()
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(["export", str(logdir), "-o", str(output)], out=out, err=err)
    assert code == 0, err.getvalue()
    assert "wrote" in out.getvalue()
    return output


def embedded_data(page: str) -> dict:
    match = re.search(r"window\.__NANWATCH_DATA__ = (\{.*?\});</script>", page, re.S)
    return json.loads(match.group(1))


def test_file_is_self_contained(exported):
    page = exported.read_text(encoding="utf-8")
    # No external URL anywhere: only data: URLs, and no relative file either.
    assert not re.search(r"""(src|href)\s*=\s*["'](?!data:)""", page)
    assert "http://" not in page and "https://" not in page
    data = embedded_data(page)
    routes = {(r["route"], r["params"].get("run")) for r in data["routes"]}
    assert ("vocabulary", None) in routes  # the page's labels and non-finite words
    for run in ("broken", "healthy", XSS_RUN):
        assert ("timeline", run) in routes and ("incident", run) in routes
    steps = [r["params"]["step"] for r in data["routes"] if r["route"] == "step"]
    assert INCIDENT in steps
    # Hostile names cannot close the data script: '<' is escaped in the JSON.
    head = page.split("<script>window.__NANWATCH_DATA__", 1)[1].split("</script>", 1)[0]
    assert "<" not in head and XSS_RUN not in head


def test_export_of_missing_logdir_or_run_fails_cleanly(tmp_path, exported):
    err = io.StringIO()
    code = cli.main(["export", str(tmp_path / "nope"), "-o", str(tmp_path / "x.html")], err=err)
    assert code == 2 and "does not exist" in err.getvalue()
    logdir = str(exported.parent.parent / "logs")
    err = io.StringIO()
    code = cli.main(["export", logdir, "-o", str(tmp_path / "x.html"), "--run", "zzz"], err=err)
    assert code == 2 and "zzz" in err.getvalue()


def test_pick_steps_prefers_the_incident():
    assert export._pick_steps([1, 2, 3], 2, 10) == [1, 2, 3]
    assert export._pick_steps(list(range(0, 1000, 10)), 500, 3) == [490, 500, 510]


playwright_sync = pytest.importorskip("playwright.sync_api")


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"no Chromium at {CHROMIUM}")
@pytest.mark.timeout(300)
def test_exported_file_opens_offline_in_chromium(exported):
    blocked: list[str] = []
    errors: list[str] = []
    dialogs: list[str] = []

    def route(r):
        if r.request.url.startswith(("file://", "data:")):
            r.continue_()
        else:
            blocked.append(r.request.url)
            r.abort()

    with playwright_sync.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1300})
            page.route("**/*", route)
            page.on("console", lambda m: m.type == "error" and errors.append(m.text))
            page.on("pageerror", lambda exc: errors.append(f"pageerror: {exc}"))
            page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
            page.goto(exported.as_uri())
            page.locator("#nanwatch[data-state=ready]").wait_for(timeout=TIMEOUT_MS)

            panel = page.locator('.run-panel[data-run="broken"]')
            panel.wait_for(timeout=TIMEOUT_MS)
            card = panel.locator(".incident-card")
            card.locator("[data-field=step]").wait_for(timeout=TIMEOUT_MS)
            assert card.get_attribute("data-state") == "nonfinite"
            assert card.locator("[data-field=step]").inner_text().strip() == str(INCIDENT)
            assert card.locator("[data-field=layer]").inner_text().strip() == LAYER_NAME
            # The card's hierarchy, as in the tab: headline, the remedy it leads
            # with (forward_math has one), then the evidence and the details.
            blocks = card.locator(":scope > *").evaluate_all("es => es.map((e) => e.dataset.field)")
            assert blocks == ["headline", "lead-remedy", "details"], blocks
            title = card.locator("[data-field=headline] .card-title").inner_text()
            assert (
                title
                == f"First NaN at step {INCIDENT}, born in the forward phase at layer {LAYER_NAME}"
            )

            page.locator("#timeline[data-state=ready]").wait_for(timeout=TIMEOUT_MS)
            assert int(page.locator("#timeline").get_attribute("data-series-drawn") or 0) >= 2
            assert canvas_ink(page, "#timeline canvas") > 1000
            page.locator("#heatmap[data-state=ready]").wait_for(timeout=TIMEOUT_MS)
            assert page.locator("#heatmap").get_attribute("data-origin-step") == str(INCIDENT)
            assert canvas_ink(page, "#heatmap canvas") > 100

            # The incident step's per-layer table is in the file.
            origin = page.locator("#heatmap .heatmap-origin[data-origin=true]").bounding_box()
            heat = page.locator("#heatmap canvas").bounding_box()
            page.mouse.click(origin["x"] + origin["width"] / 2, heat["y"] + 3)
            table = page.locator(f'#step-table[data-state=ready][data-step="{INCIDENT}"]')
            table.wait_for(timeout=TIMEOUT_MS)
            assert table.locator("td.nonfinite").count() > 0

            # Zooming the timeline answers from the embedded series.
            over = page.locator("#timeline .u-over").bounding_box()
            y = over["y"] + over["height"] / 2
            page.mouse.move(over["x"] + over["width"] * 0.2, y)
            page.mouse.down()
            page.mouse.move(over["x"] + over["width"] * 0.6, y, steps=5)
            page.mouse.up()
            page.wait_for_timeout(600)
            assert page.locator("#timeline").get_attribute("data-state") == "ready"

            # The hostile run name is text in the selector and its panel, never markup.
            selector = page.locator("#run-selector")
            assert XSS_RUN in selector.inner_text()
            hostile = page.locator(f'.run-panel[data-run="{XSS_RUN}"] .incident-card')
            hostile.locator(".card-title").wait_for(timeout=TIMEOUT_MS)
            assert hostile.get_attribute("data-state") == "healthy"
            assert page.locator("img[src=x]").count() == 0
        finally:
            browser.close()
    assert not blocked, blocked
    assert not errors, errors
    assert not dialogs, dialogs
