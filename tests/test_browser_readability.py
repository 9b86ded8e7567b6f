"""The tab reads right the first time, light and dark, at 1024 and 1600 px:
the card shows only what was recorded, the heatmap outlines the origin's own
NaN cell and explains its marks, the explosion names a learning-rate jump and
one growth ratio, a 1-step run shows its point, marker labels never overlap,
axes are titled, the series stay distinct for colour-blind readers, every
text has a contrast of 4.5:1 at least, the run filter hides the panels of the
runs it hides, and a long run list scrolls by itself, never the page.

The page is the built bundle served with fixture answers; the heatmap is the
one ``views.heatmap`` builds for a backward NaN (the seed-003 case). One page
load per width and theme. Screenshots: test-artifacts/readability-*.png.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
from nanwatch_testlib import CHROMIUM, base_vector, fixture_tab, fixture_timeline
from test_browser import ARTIFACTS, TIMEOUT_MS, browser  # noqa: F401

from tb_nanwatch.board import views
from tb_nanwatch.evidence import diagnosis
from tb_nanwatch.evidence.recorded import Flight
from tb_nanwatch.evidence.vocabulary import vocabulary
from tb_nanwatch.record.writing.synthetic import build_schema

pytest.importorskip("playwright.sync_api")

pytestmark = [
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"no Chromium at {CHROMIUM}"),
    pytest.mark.timeout(300),
]

VOCABULARY = vocabulary()
WORDS = VOCABULARY["non_finite"]
VIRIDIS_LOW = "#440154"  # the darkest cell colour
NAN_CELL = (255, 0, 255)
MANY_HEALTHY = 40
LR_JUMP = {"step": 61, "from": 0.01, "to": 0.2}


def _wire(value):
    """NaN/Inf as the routes write them (TensorBoard's Respond)."""
    if isinstance(value, float) and not math.isfinite(value):
        return WORDS["nan"] if math.isnan(value) else WORDS["posinf" if value > 0 else "neginf"]
    if isinstance(value, dict):
        return {k: _wire(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_wire(v) for v in value]
    return value


def _backward_heatmap(bad: int) -> tuple[dict, dict]:
    """(heatmap body, incident) of a NaN born in the middle layer's backward
    pass: its gradient w.r.t. its input, which is also the gradient w.r.t.
    the first layer's output."""
    schema = build_schema(3)
    layers = [e.layer for e in schema.find(kind="activation")]
    matrix = np.stack([base_vector(schema, step) for step in range(bad + 1)])
    for kind, layer in (("grad_in", layers[1]), ("grad_out", layers[0]), ("grad_var", layers[0])):
        entry = next(e for e in schema.find(kind=kind) if e.layer == layer)
        matrix[bad, entry.index("nan")] = 6
        matrix[bad, entry.index("norm")] = math.nan
    origin = diagnosis.find_origin(schema, matrix[bad])
    incident = {
        "step": bad,
        **origin,
        "epoch": 1,
        "batch": 3,
        "iterations": bad,
        "loss": 12.06,
        # What the replay writes when it could not reproduce the step.
        "op": {"type": "", "name": "", "source": None, "reproduced": False},
    }
    return views.heatmap(Flight(0, matrix, schema), incident), incident


def _timeline(run: str, steps: int, incident=None, explosion=None, lr_jump=None) -> dict:
    loss = [1.0 / (1 + s) for s in range(steps)]
    lr = [0.01 if lr_jump is None or s < lr_jump["step"] else lr_jump["to"] for s in range(steps)]
    if incident is not None:
        loss[-1] = math.nan
    nonfinite = [0] * (steps - 1) + [int(incident is not None)]
    return fixture_timeline(run, steps, incident, explosion, loss=loss, lr=lr, nonfinite=nonfinite)


def _fixture_runs() -> dict[str, dict]:
    heatmap, backward = _backward_heatmap(13)
    explosion = {
        "step": 68,
        "signal": "loss",
        "factor": 1.046e17,
        "value": 9.742e15,
        "reference": 0.09312,
        "lr_change": LR_JUMP,
    }
    cause = {
        "id": "explosion",
        "summary": "The loss exploded from step 68 on (1.05e+17x its reference level).",
        "evidence": {"onset_step": 68, "growth_factor": 1.046e17},
        "remedies": ["Lower the learning rate"],
    }
    overflow = {**backward, "step": 37, "phase": "forward", "tensor": "output", "kind": "inf"}
    overflow["op"] = {"type": "MatMul", "name": "dense/MatMul", "source": None, "reproduced": True}
    specs = {  # run: (incident, explosion, cause, heatmap, steps)
        "a_backward": (backward, None, None, heatmap, 14),
        "b_explodes": (None, explosion, cause, None, 86),
        "c_overflow": (overflow, {"step": 36, "signal": "loss", "factor": 2e4}, None, None, 38),
        "d_one_step": (None, None, None, None, 1),
    }
    specs.update({f"healthy_{i:02d}": (None, None, None, None, 5) for i in range(MANY_HEALTHY)})
    runs = {}
    for run, (incident, exp, cause, heat, steps) in specs.items():
        runs[run] = {
            "entry": {
                "run": run,
                "steps": steps,
                "status": "stopped" if incident else "finished",
                "first_nonfinite": incident,
                "explosion": exp,
                "skipped_count": 0,
                "cause": {"id": cause["id"], "summary": cause["summary"]} if cause else None,
            },
            "incident": {
                "run": run,
                "incident": incident,
                "explosion": exp,
                "cause": cause,
                "bundle": None,
                "heatmap": heat,
                "hints": [],
            },
            "timeline": _timeline(run, steps, incident, exp, LR_JUMP if exp is explosion else None),
        }
    return _wire(runs)


RUNS = _fixture_runs()
BACKWARD = RUNS["a_backward"]["incident"]


@pytest.fixture(scope="module")
def server():
    with fixture_tab(RUNS, VOCABULARY) as url:
        yield url


# -- colour ----------------------------------------------------------------------------

# Machado, Oliveira & Fernandes (2009), severity 1, on linear RGB.
CVD = {
    "normal": np.eye(3),
    "protanopia": np.array(
        [
            [0.152286, 1.052583, -0.204868],
            [0.114503, 0.786281, 0.099216],
            [-0.003882, -0.048116, 1.051998],
        ]
    ),
    "deuteranopia": np.array(
        [
            [0.367322, 0.860646, -0.227968],
            [0.280085, 0.672501, 0.047413],
            [-0.011820, 0.042940, 0.968881],
        ]
    ),
    "tritanopia": np.array(
        [
            [1.255528, -0.076749, -0.178779],
            [-0.078411, 0.930809, 0.147602],
            [0.004733, 0.691367, 0.303900],
        ]
    ),
}


def _rgb(css: str) -> tuple[float, ...]:
    if css.startswith("#"):
        return tuple(int(css[i : i + 2], 16) for i in (1, 3, 5))
    parts = css[css.index("(") + 1 : css.index(")")].replace("/", " ").replace(",", " ").split()
    return tuple(float(p) for p in parts[:3])


def _linear(rgb) -> np.ndarray:
    c = np.asarray(rgb, float) / 255
    return np.where(c <= 0.04045, c / 12.92, ((c + 0.055) / 1.055) ** 2.4)


def _contrast(a, b) -> float:
    weights = np.array([0.2126, 0.7152, 0.0722])
    la, lb = (float(_linear(_rgb(c)) @ weights) for c in (a, b))
    return (max(la, lb) + 0.05) / (min(la, lb) + 0.05)


def _lab(linear: np.ndarray) -> np.ndarray:
    xyz = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]])
    x, y, z = (xyz @ np.clip(linear, 0, 1)) / np.array([0.95047, 1.0, 1.08883])
    f = [t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116 for t in (x, y, z)]
    return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


def _closest_pair(colours: list[str]) -> dict[str, float]:
    """The smallest CIE76 distance between two of ``colours`` as each vision sees them."""
    return {
        vision: min(
            float(np.linalg.norm(_lab(m @ _linear(_rgb(a))) - _lab(m @ _linear(_rgb(b)))))
            for a, b in itertools.combinations(colours, 2)
        )
        for vision, m in CVD.items()
    }


LOW_CONTRAST_TEXT = """() => {
  const parse = (c) => {
    const m = /rgba?\\(([^)]+)\\)/.exec(c);
    if (!m) return null;
    const p = m[1].split(/[\\s,\\/]+/).filter(Boolean).map(Number);
    return [p[0], p[1], p[2], p.length > 3 ? p[3] : 1];
  };
  const over = (top, bottom) => [0, 1, 2].map((i) => top[i] * top[3] + bottom[i] * (1 - top[3])).concat(1);
  const ground = (node) => {
    const layers = [];
    for (let e = node; e; e = e.parentElement) {
      const c = parse(getComputedStyle(e).backgroundColor);
      if (c && c[3] > 0) { layers.push(c); if (c[3] >= 1) break; }
    }
    return layers.reduceRight((acc, layer) => over(layer, acc), [255, 255, 255, 1]);
  };
  const lum = (c) => {
    const ch = (v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; };
    return 0.2126 * ch(c[0]) + 0.7152 * ch(c[1]) + 0.0722 * ch(c[2]);
  };
  const seen = new Set();
  const low = [];
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    const e = n.parentElement;
    if (!n.textContent.trim() || seen.has(e)) continue;
    seen.add(e);
    const style = getComputedStyle(e);
    if (!e.getClientRects().length || style.visibility === "hidden") continue;
    const bg = ground(e);
    const fg = over(parse(style.color), bg);
    const [hi, lo] = [lum(fg), lum(bg)].sort((a, b) => b - a);
    const ratio = (hi + 0.05) / (lo + 0.05);
    if (ratio < 4.5) low.push(`${e.className || e.tagName}: ${n.textContent.trim().slice(0, 40)} (${ratio.toFixed(2)})`);
  }
  return low;
}"""

PIXEL = """([c, x, y]) => {
  const r = window.devicePixelRatio || 1;
  return Array.from(c.getContext("2d").getImageData(Math.round(x * r), Math.round(y * r), 1, 1).data);
}"""

INK_OF = """([c, rgb]) => {
  const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
  let n = 0;
  for (let i = 0; i < d.length; i += 4) {
    if (d[i + 3] > 200 && Math.abs(d[i] - rgb[0]) + Math.abs(d[i + 1] - rgb[1]) + Math.abs(d[i + 2] - rgb[2]) < 30) n++;
  }
  return n;
}"""


# -- the page ----------------------------------------------------------------------------


def _panel(page, run: str):
    return page.locator(f'.run-panel[data-run="{run}"]')


def _open(browser, server, width: int, dark: bool):  # noqa: F811
    context = browser.new_context(
        viewport={"width": width, "height": 900}, color_scheme="dark" if dark else "light"
    )
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(f"pageerror: {exc}"))
    page.on("console", lambda m: m.type == "error" and errors.append(m.text))
    page.goto(server)
    page.locator("#nanwatch[data-state=ready]").wait_for(timeout=TIMEOUT_MS)
    for run in ("b_explodes", "c_overflow"):
        page.locator(f'#run-selector .run-item[data-run="{run}"] input').check()
    for run in ("a_backward", "b_explodes", "c_overflow", "d_one_step"):
        _panel(page, run).locator(".timeline[data-state=ready]").wait_for(timeout=TIMEOUT_MS)
        _panel(page, run).locator(".incident-card:not([data-state=loading])").wait_for(
            timeout=TIMEOUT_MS
        )
    return context, page, errors


def _boxes_overlap(a: dict, b: dict) -> bool:
    return (
        a["x"] < b["x"] + b["width"]
        and b["x"] < a["x"] + a["width"]
        and a["y"] < b["y"] + b["height"]
        and b["y"] < a["y"] + a["height"]
    )


def _check_layout(page) -> None:
    """Many runs: the list scrolls in its own area, the page never scrolls."""
    size = page.evaluate(
        "() => ({page: document.scrollingElement.scrollHeight, window: innerHeight,"
        " list: [document.querySelector('#run-selector').scrollHeight,"
        " document.querySelector('#run-selector').clientHeight]})"
    )
    assert size["page"] <= size["window"], size
    assert size["list"][0] > size["list"][1], size  # the run list has its own scroll
    assert page.locator(".run-panel").first.bounding_box()["y"] < size["window"] / 3


def _check_card(page) -> None:
    card = _panel(page, "a_backward").locator(".incident-card")
    values = [v.strip() for v in card.locator("dd").all_inner_texts()]
    assert values and all(v and v != "–" for v in values), values
    text = card.inner_text()
    assert "(name" not in text and "source line unknown" not in text and "()" not in text, text
    assert card.locator("[data-field=op-type], [data-field=op-name]").count() == 0
    assert "did not reproduce" in card.locator("[data-field=op]").inner_text()
    assert card.locator("[data-field=layer]").inner_text() == BACKWARD["incident"]["layer"]


def _check_heatmap(page) -> None:
    heatmap = _panel(page, "a_backward").locator(".heatmap")
    layer = BACKWARD["incident"]["layer"]
    assert heatmap.get_attribute("data-metric") == "grad_norm"  # a backward incident
    outline = heatmap.locator(".heatmap-origin[data-origin=true]")
    row = int(outline.get_attribute("data-row"))
    labels = heatmap.locator(".heatmap-row-label")
    assert labels.nth(row).get_attribute("title") == layer
    assert heatmap.locator(".heatmap-row-label.origin").get_attribute("title") == layer
    # The outlined cell is the NaN: its centre is the NaN colour.
    canvas = heatmap.locator("canvas")
    plot, cell = canvas.bounding_box(), outline.bounding_box()
    centre = [cell["x"] + cell["width"] / 2 - plot["x"], cell["y"] + cell["height"] / 2 - plot["y"]]
    pixel = page.evaluate(PIXEL, [canvas.element_handle(), *centre])
    assert tuple(pixel[:3]) == NAN_CELL, pixel
    keys = {
        k.get_attribute("data-key"): k.inner_text() for k in heatmap.locator(".legend-key").all()
    }
    assert {"nonfinite", "corner", "origin", "missing"} <= set(keys), keys
    assert "another tensor" in keys["corner"] and "origin" in keys["origin"]
    assert "backward" in heatmap.locator("[data-field=metric-definition]").inner_text()
    # Cells on a ground that sets apart the darkest of them, and the page.
    ground = canvas.evaluate("c => getComputedStyle(c).backgroundColor")
    page_bg = page.locator("body").evaluate("b => getComputedStyle(b).backgroundColor")
    assert _contrast(ground, VIRIDIS_LOW) >= 3, ground
    assert _contrast(ground, page_bg) >= 3, (ground, page_bg)


def _check_explosion(page) -> None:
    card = _panel(page, "b_explodes").locator(".incident-card")
    lr = card.locator("[data-field=lr-change]").inner_text()
    assert "from 0.01 to 0.2 at step 61" in lr and "7 steps before the onset" in lr, lr
    growth = card.locator("[data-field=growth]").inner_text()
    assert "×1.046e17" in growth and "÷ its reference level" in growth, growth
    assert "9.742e15" in growth and "0.09312" in growth, growth
    # On the timeline too, its label clear of the onset's.
    labels = _panel(page, "b_explodes").locator(".timeline .mark-label")
    marks = {label.get_attribute("data-mark"): label for label in labels.all()}
    assert set(marks) == {"explosion", "lr"}, marks
    assert marks["lr"].get_attribute("data-step") == "61"
    assert "0.01 → 0.2" in marks["lr"].inner_text()
    assert not _boxes_overlap(marks["lr"].bounding_box(), marks["explosion"].bounding_box())


def _check_timeline(page, page_bg: str) -> None:
    timeline = _panel(page, "c_overflow").locator(".timeline")
    labels = timeline.locator(".mark-label")
    assert labels.count() == 2  # first non-finite at 37, explosion onset at 36
    a, b = (labels.nth(i).bounding_box() for i in range(2))
    assert not _boxes_overlap(a, b), (a, b)
    plot_top = timeline.locator(".u-over").bounding_box()["y"]
    assert max(a["y"] + a["height"], b["y"] + b["height"]) <= plot_top + 1
    assert "loss" in timeline.get_attribute("data-axis-left")
    assert "grad norm" in timeline.get_attribute("data-axis-left")
    assert "logit" in timeline.get_attribute("data-axis-right")
    # The series as drawn (the legend's markers): distinct to every vision, visible on the page.
    colours = timeline.locator(".u-legend .u-series .u-marker").evaluate_all(
        "ms => ms.slice(1).map(m => getComputedStyle(m).borderTopColor)"
    )
    assert len(set(colours)) == 4, colours
    closest = _closest_pair(colours)
    assert min(closest.values()) >= 15, closest
    assert all(_contrast(c, page_bg) >= 3 for c in colours), colours
    # A run of one step shows its one point.
    single = _panel(page, "d_one_step").locator(".timeline")
    assert single.get_attribute("data-points") == "1"
    loss_colour = [round(v) for v in _rgb(colours[0])]
    canvas = single.locator("canvas").first
    assert page.evaluate(INK_OF, [canvas.element_handle(), loss_colour]) >= 10
    status = page.locator('.run-item[data-run="d_one_step"] [data-field=status]').inner_text()
    assert "1 step," in status, status
    assert "1 steps" not in page.locator("body").inner_text()


def _check_filter(page) -> None:
    box = page.locator("#run-selector [data-field=run-filter]")
    box.fill("^(a_|b_)")
    assert _panel(page, "a_backward").is_visible() and _panel(page, "b_explodes").is_visible()
    assert not _panel(page, "c_overflow").is_visible()
    assert not _panel(page, "d_one_step").is_visible()
    box.fill("nothing matches this")
    assert page.locator("[data-field=all-filtered]").is_visible()
    box.fill("")
    assert all(_panel(page, r).is_visible() for r in ("c_overflow", "d_one_step"))
    assert not page.locator("[data-field=all-filtered]").is_visible()


@pytest.mark.parametrize("dark", [False, True], ids=["light", "dark"])
@pytest.mark.parametrize("width", [1024, 1600])
def test_the_tab_reads_right_at_each_width_and_theme(browser, server, width, dark):  # noqa: F811
    context, page, errors = _open(browser, server, width, dark)
    try:
        theme = "dark" if dark else "light"
        assert page.locator("html").get_attribute("data-theme") == theme
        page_bg = page.locator("body").evaluate("b => getComputedStyle(b).backgroundColor")
        _check_layout(page)
        _check_card(page)
        _check_heatmap(page)
        _check_explosion(page)
        _check_timeline(page, page_bg)
        assert page.evaluate(LOW_CONTRAST_TEXT) == []
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / f"readability-{width}-{theme}.png"))
        _check_filter(page)
        assert errors == []
    finally:
        context.close()
