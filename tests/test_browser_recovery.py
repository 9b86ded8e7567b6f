"""The tab shows a rewind (``on_nonfinite="rewind"``) on the timeline as a
band of its own over the steps it undid (from the step it went back to
through the step it rewound at), labelled in a lane of its own above the
marker labels (issue 56 item 6: not a small label stacked on the first
non-finite and explosion labels), with a key entry, in a real TensorBoard
driven by headless Chromium, light and dark.

Screenshots go to test-artifacts/recovery-timeline-{light,dark}.png.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from nanwatch_testlib import CHROMIUM, run_node_module
from test_browser import ARTIFACTS, TIMEOUT_MS, Watched, browser, tensorboard  # noqa: F401

pytest.importorskip("playwright.sync_api")

pytestmark = [
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"no Chromium at {CHROMIUM}"),
    pytest.mark.timeout(300),
]

LABEL = "↶ rewound at step 3 to before step 0 · clipnorm=1.0"

# The colour of a pixel of the timeline's canvas at CSS (x, y) from its top left.
PIXEL = """([c, x, y]) => {
  const r = window.devicePixelRatio || 1;
  return Array.from(c.getContext("2d").getImageData(Math.round(x * r), Math.round(y * r), 1, 1).data);
}"""


@pytest.fixture(scope="module")
def logdir(tmp_path_factory) -> Path:
    """One run that rewound at step 3 to the state before step 0 (clipnorm=1.0)."""
    from test_rewind_mode import _fit

    root = tmp_path_factory.mktemp("recovery_tab")
    _, watch, _ = _fit(root / "rewound", on_nonfinite="rewind")
    (recovery,) = watch.journal.summary()["recoveries"]
    assert (recovery["step"], recovery["rewound_to"]) == (3, 0)
    return root


def _overlap(a: dict, b: dict) -> bool:
    return (
        a["x"] < b["x"] + b["width"]
        and b["x"] < a["x"] + a["width"]
        and a["y"] < b["y"] + b["height"]
        and b["y"] < a["y"] + a["height"]
    )


def _check_rewind(frame, page) -> None:
    timeline = frame.locator("#timeline[data-state=ready]")
    label = timeline.locator('.timeline-rewinds .rewind-label[data-mark="rewind"]')
    label.wait_for(timeout=TIMEOUT_MS)
    assert label.inner_text().strip() == LABEL
    assert (label.get_attribute("data-step"), label.get_attribute("data-to")) == ("3", "0")
    assert "weights from before step 0" in label.get_attribute("title")
    assert label.is_visible()
    # Its own lane: no marker label holds the rewind, none overlaps it, all above the plot.
    assert timeline.locator('.timeline-marks [data-mark="rewind"]').count() == 0
    box = label.bounding_box()
    marks = timeline.locator(".timeline-marks .mark-label").all()
    assert {m.get_attribute("data-mark") for m in marks} == {"first", "explosion"}
    assert not any(_overlap(box, m.bounding_box()) for m in marks)
    over = timeline.locator(".u-over").bounding_box()
    assert box["y"] + box["height"] <= over["y"]
    # Readable: as large as the page's small text, not the marker labels' 11 px.
    assert label.evaluate("e => parseFloat(getComputedStyle(e).fontSize)") >= 12
    # It spans the band of the undone steps 0-3: from step 0's left half-step (the
    # plot's edge) to step 3's right one. The x axis: steps 0-19 and a little room.
    last = int(timeline.get_attribute("data-total-steps")) - 1
    span = last + max(0.5, last * 0.03)
    px = lambda step: over["width"] * step / span  # noqa: E731 - CSS px right of the plot's edge
    assert abs(box["x"] - over["x"]) <= 1, (box, over)
    assert box["width"] >= px(3.5) - 1, (box, px(3.5))
    # The band is drawn on the plot: the rewind's green tint at step 2, none at step 12.
    canvas = timeline.locator("canvas").first
    origin = canvas.bounding_box()
    left = over["x"] - origin["x"]
    tinted = 0
    for fraction in (0.25, 0.5, 0.75):
        y = over["y"] - origin["y"] + over["height"] * fraction
        inside = page.evaluate(PIXEL, [canvas.element_handle(), left + px(2.2), y])
        outside = page.evaluate(PIXEL, [canvas.element_handle(), left + px(12.2), y])
        green = inside[3] > 0 and inside[1] > inside[0] and inside[1] > inside[2]
        tinted += green and inside != outside
    assert tinted >= 2
    key = timeline.locator(".timeline-key")
    assert "rewind (the steps it undid)" in key.inner_text()
    assert key.locator(".swatch-rewind").count() == 1


@pytest.mark.parametrize("dark", [False, True], ids=["light", "dark"])
def test_the_rewind_is_a_band_with_a_label_of_its_own(browser, logdir, tmp_path, dark):  # noqa: F811
    with tensorboard(logdir, tmp_path, want_runs=1) as base:
        watched = Watched(browser, width=1024, height=1000)
        try:
            if dark:
                watched.page.emulate_media(color_scheme="dark")
            frame = watched.open_tab(base)
            _check_rewind(frame, watched.page)
            frame.locator("#timeline").scroll_into_view_if_needed()
            ARTIFACTS.mkdir(exist_ok=True)
            theme = "dark" if dark else "light"
            watched.page.screenshot(path=str(ARTIFACTS / f"recovery-timeline-{theme}.png"))
            assert watched.errors == []
        finally:
            watched.close()


def test_rewind_words_in_node():
    script = """
      import { rewindWords } from "./src/timeline.js";
      console.log(JSON.stringify([
        rewindWords({ step: 3, rewound_to: 0, remedy: { id: "clip_gradients", setting: "clipnorm=1.0" },
                      skipped_batches: 4 }),
        rewindWords({ step: 9, rewound_to: 7, remedy: { id: "lower_lr", setting: "" }, skipped_batches: 1 }),
      ]));
    """
    first, second = run_node_module(script)
    assert first["text"] == LABEL
    assert first["title"] == (
        "At step 3 the run went back to its weights from before step 0 and set clipnorm=1.0; "
        "4 batches not trained on again."
    )
    assert second["text"] == "↶ rewound at step 9 to before step 7 · lower_lr"
    assert second["title"].endswith("; 1 batch not trained on again.")
