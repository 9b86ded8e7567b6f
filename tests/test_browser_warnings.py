"""The early warnings in the tab (issue 58): a marker on the timeline at each
warning's step and a warnings block on the card, in headless Chromium.

The page is the built bundle served with fixture answers written to the
routes' contract (docs/reference/routes.md): a run that exploded after two
warnings (one hostile message), and a healthy run with none. A screenshot of
the warned run goes to test-artifacts/warnings-1600.png.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from nanwatch_testlib import CHROMIUM, fixture_tab, fixture_timeline
from test_browser import ARTIFACTS, TIMEOUT_MS, browser  # noqa: F401

from tb_nanwatch.evidence.early_warnings import warning
from tb_nanwatch.evidence.vocabulary import vocabulary

pytest.importorskip("playwright.sync_api")

pytestmark = [
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"no Chromium at {CHROMIUM}"),
    pytest.mark.timeout(300),
]

HOSTILE = "<img src=x onerror=alert(1)> grows"
WARNINGS = [
    {**warning(0, "schedule_jump", 61, "the schedule jumps at step 61", {}), "outlived": False},
    {**warning(30, "overflow_forecast", 48, HOSTILE, {"value": "Infinity"}), "outlived": None},
]
EXPLOSION = {"step": 62, "signal": "loss", "factor": 1e6, "value": 1e6, "reference": 1.0}


def _run(name: str, warnings: list[dict], explosion: dict | None) -> dict:
    steps = 80
    timeline = fixture_timeline(name, steps, None, explosion)
    timeline.update({"recoveries": [], "warnings": warnings})
    entry = {
        "run": name,
        "steps": steps,
        "status": "finished",
        "first_nonfinite": None,
        "explosion": explosion,
        "skipped_count": 0,
        "cause": None,
        "warning_count": len(warnings),
    }
    incident = {
        "run": name,
        "incident": None,
        "explosion": explosion,
        "cause": None,
        "bundle": None,
        "heatmap": None,
        "hints": [],
        "warnings": warnings,
    }
    return {"entry": entry, "incident": incident, "timeline": timeline}


RUNS = {"warned": _run("warned", WARNINGS, EXPLOSION), "healthy": _run("healthy", [], None)}


@pytest.fixture(scope="module")
def page(browser):  # noqa: F811
    with fixture_tab(RUNS, vocabulary()) as url:
        context = browser.new_context(viewport={"width": 1600, "height": 1100})
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.on("dialog", lambda d: (errors.append(d.message), d.dismiss()))
        page.goto(url)
        page.locator("#nanwatch[data-state=ready]").wait_for(timeout=TIMEOUT_MS)
        yield page, errors
        context.close()


def _panel(page, run: str):
    panel = page.locator(f'.run-panel[data-run="{run}"]')
    if not panel.count():
        page.locator(f'#run-selector .run-item[data-run="{run}"] input').check()
    panel.locator(".incident-card:not([data-state=loading])").wait_for(timeout=TIMEOUT_MS)
    return panel


def test_the_card_lists_each_warning_with_its_lead(page):
    page, errors = page
    panel = _panel(page, "warned")
    block = panel.locator("[data-field=warnings]")
    block.wait_for(timeout=TIMEOUT_MS)
    items = block.locator(".card-warning")
    assert items.count() == 2
    first, second = (items.nth(i).inner_text() for i in range(2))
    assert "schedule_jump" in first and "predicted step 61 (61 steps ahead)" in first
    assert HOSTILE in second  # text, never HTML
    assert not errors
    ARTIFACTS.mkdir(exist_ok=True)
    panel.screenshot(path=str(ARTIFACTS / "warnings-1600.png"))


def test_the_timeline_marks_each_warning_at_its_step(page):
    page, _ = page
    panel = _panel(page, "warned")
    marks = panel.locator(".mark-label[data-mark=warning]")
    marks.first.wait_for(timeout=TIMEOUT_MS)
    steps = sorted(int(m.get_attribute("data-step")) for m in marks.all())
    assert steps == [0, 30]


def test_a_run_without_warnings_shows_none(page):
    page, _ = page
    panel = _panel(page, "healthy")
    assert panel.locator("[data-field=warnings]").count() == 0
    assert panel.locator(".mark-label[data-mark=warning]").count() == 0
