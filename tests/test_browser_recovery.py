"""The tab shows a rewind (``on_nonfinite="rewind"``) on the timeline: a
line at the step with its label (where to, which remedy) and a key entry, in
a real TensorBoard driven by headless Chromium.

The screenshot goes to test-artifacts/recovery-timeline.png.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from nanwatch_testlib import CHROMIUM
from test_browser import ARTIFACTS, TIMEOUT_MS, Watched, browser, tensorboard  # noqa: F401

pytest.importorskip("playwright.sync_api")

pytestmark = [
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"no Chromium at {CHROMIUM}"),
    pytest.mark.timeout(300),
]


@pytest.fixture(scope="module")
def logdir(tmp_path_factory) -> Path:
    """One run that rewound at step 3 to the state before step 0 (clipnorm=1.0)."""
    from test_rewind_mode import _fit

    root = tmp_path_factory.mktemp("recovery_tab")
    _, watch, _ = _fit(root / "rewound", on_nonfinite="rewind")
    (recovery,) = watch.journal.summary()["recoveries"]
    assert (recovery["step"], recovery["rewound_to"]) == (3, 0)
    return root


def test_the_timeline_shows_the_rewind_marker_with_its_label(browser, logdir, tmp_path):  # noqa: F811
    with tensorboard(logdir, tmp_path, want_runs=1) as base:
        watched = Watched(browser, width=1600, height=1100)
        try:
            frame = watched.open_tab(base)
            frame.locator("#timeline[data-state=ready]").wait_for(timeout=TIMEOUT_MS)
            label = frame.locator('.mark-label[data-mark="rewind"]')
            label.wait_for(timeout=TIMEOUT_MS)
            assert label.inner_text().strip() == "rewind to 0: clipnorm=1.0"
            assert label.get_attribute("data-step") == "3"
            assert label.is_visible()
            # Drawn in the rewind's own colour, not the incident's.
            colours = label.evaluate(
                "(n) => [getComputedStyle(n).borderLeftColor,"
                " getComputedStyle(n.parentNode.querySelector('.mark-label-first')).borderLeftColor]"
            )
            assert colours[0] != colours[1]
            key = frame.locator(".timeline-key")
            assert "rewind" in key.inner_text()
            assert key.locator(".swatch-rewind-line").count() == 1
            ARTIFACTS.mkdir(exist_ok=True)
            watched.page.screenshot(path=str(ARTIFACTS / "recovery-timeline.png"))
            assert watched.errors == []
        finally:
            watched.close()
