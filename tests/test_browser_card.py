"""The incident card's cause verdict, op line and reproduction bundle, and the
run list's cause line (issues 14 and 15), in headless Chromium.

The page is the built bundle (tb_nanwatch/board/static/) served by a small HTTP
server that answers the plugin's routes with fixture JSON written here to the
contract of docs/reference/routes.md plus the `cause`, `bundle` and `op` keys: a growth
overflow with its bundle and op, an explosion without NaN, an unknown cause,
a cause only the served vocabulary knows, an older run without the new keys, a
healthy run, and hostile strings. The `vocabulary` route answers Python's
vocabulary plus that one cause: every label the tab shows is the one it was sent.

Screenshots go to test-artifacts/card-{1024,1600}-{light,dark}.png.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from nanwatch_testlib import CHROMIUM, XSS_RUN, fixture_tab, fixture_timeline, run_node_module
from test_browser import ARTIFACTS, TIMEOUT_MS, Watched, browser, tensorboard  # noqa: F401

from tb_nanwatch.evidence import diagnosis, trials
from tb_nanwatch.evidence.vocabulary import vocabulary

pytest.importorskip("playwright.sync_api")

pytestmark = [
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"no Chromium at {CHROMIUM}"),
    pytest.mark.timeout(300),
]


# As the bundle writes it: a first line wider than the card's code box at 1024 px.
SNIPPET = (
    "bundle = tb_nanwatch.load_bundle('adam_lr_5/repro/step_000000037')  # relative to the log dir\n"
    "bundle.restore(model); model.train_on_batch(*bundle.batch)"
)
OVERFLOW_CAUSE = {
    "id": "growth_overflow",
    "summary": "The loss grew by 1e26 over 4 steps before it overflowed to Inf: "
    "the learning rate is too high.",
    "evidence": {
        "onset_step": 33,
        "growth_factor": 1.0e26,
        "signal": "loss",
        "loss_by_step": [1400.0, 2.9e6, 1.4e29, "Infinity"],
    },
    "remedies": [
        "Lower the learning rate (try 10x smaller)",
        "Clip the gradients: optimizer clipnorm=1.0",
        "Warm the learning rate up over the first steps",
        "Use from_logits=True in the loss",
    ],
}
# The routes' remedies with their trials (a trial without Python's text: the
# vocabulary's word for its outcome), working first.
REMEDY_CODE = "keras.optimizers.Adam(..., clipnorm=1.0)"
EXPLOSION_CAUSE = {
    "id": "explosion",
    # As long as a real verdict decided by its trials.
    "summary": "The logits grew from 3 to 8e11 in 2 steps without a NaN yet; the learning rate "
    "jumped from 0.01 to 0.2 at step 0. Decided by the trials (explosion (no nan/inf yet)): "
    "clipnorm=1.0 kept the run finite; lr x0.1 did not; linear lr warm-up (36 steps) was not "
    "tried: no rewind point before the onset.",
    "evidence": {"onset_step": 1, "signal": "logits", "growth_factor": 2.7e11},
    "remedies": [
        {
            "id": "clip_gradients",
            "text": "Clip the gradients",
            "code": REMEDY_CODE,
            "trial": trials.trial_json(
                trials.Trial("clip_gradients", "fixed", 40, "clipnorm=1.0", "", 1e4, 7.7e3, True)
            ),
        },
        {
            "id": "lr_warmup",
            "text": "Warm up",
            "trial": {"outcome": "not_tried", "why": "no rewind"},
        },
        {
            "id": "lower_lr",
            "text": "Lower the learning rate",
            "trial": trials.trial_json(trials.Trial("lower_lr", "not_fixed", 4, "lr x0.1")),
        },
    ],
    "remedy_ids": ["clip_gradients", "lr_warmup", "lower_lr"],
}
UNKNOWN_CAUSE = {
    "id": "unknown",
    "summary": "A NaN or Inf appeared in the update; no recorded signal explains it.",
    "evidence": {"loss_before": 0.52, "grad_norm_before": 1.3, "loss_scale": 32768.0},
    "remedies": [],
}
NOVEL_LABEL = "A cause only the served vocabulary knows"
NOVEL_CAUSE = {
    "id": "novel_cause",
    "summary": "Something no release of the frontend has heard of.",
    "evidence": {"onset_step": 8},
    "remedies": ["Read the label"],
}
VOCABULARY = vocabulary()
VOCABULARY["causes"]["novel_cause"] = NOVEL_LABEL
LABELS = VOCABULARY["causes"]

# A run name wider than the run list at 1024 px, with words between separators.
LONG_RUN = "zz_resnet50_imagenet_mixed_precision/lr_0.5_warmup_2000-steps/run_2026_12_07"
HOSTILE_CAUSE = {
    "id": "forward_math",
    "summary": f"{XSS_RUN} made a NaN",
    "evidence": {XSS_RUN: XSS_RUN, "rows": [f"<b>{i}</b>" for i in range(3)]},
    "remedies": [f"<script>alert(1)</script>{XSS_RUN}", "second"],
}


def _incident(step: int, **extra) -> dict:
    base = {
        "step": step,
        "phase": "forward",
        "layer": "model/dense_3",
        "tensor": "output",
        "kind": "inf",
        "epoch": 0,
        "batch": step,
        "iterations": step,
        "loss": "Infinity",
    }
    return {**base, **extra}


def _timeline(run: str, steps: int, incident: dict | None, explosion: dict | None) -> dict:
    loss = [1.0 / (1 + s) if s < steps - 4 else 10.0 ** (3 * (s - steps + 5)) for s in range(steps)]
    column = [float(v) for v in loss]
    nonfinite = [0] * steps
    if incident is not None:
        column[-1] = "Infinity"
        nonfinite[-1] = 1
    grad_norm = [1.0 + s % 3 for s in range(steps)]
    return fixture_timeline(
        run, steps, incident, explosion, loss=column, grad_norm=grad_norm, nonfinite=nonfinite
    )


def _heatmap(step: int) -> dict:
    layers = ["model/dense_1", "model/dense_2", "model/dense_3"]
    steps = list(range(step - 7, step + 1))
    grow = [[10.0 ** (k + i) for i in range(len(steps))] for k in range(len(layers))]
    grow[2][-1] = "Infinity"
    return {
        "steps": steps,
        "layers": layers,
        "forward_max_abs": grow,
        "grad_norm": [[1.0] * len(steps) for _ in layers],
        "nonfinite": [[0] * (len(steps) - 1) + [int(k == 2)] for k in range(len(layers))],
        "origin": {"layer": "model/dense_3", "step": step, "phase": "forward"},
    }


def _fixture_runs() -> dict[str, dict]:
    """run name -> {"runs" entry, "incident" response, "timeline" response}."""
    overflow = _incident(
        37,
        op={
            "type": "MatMul",
            "name": "model/dense_3/MatMul",
            "source": "model.py:42",
            "reproduced": True,
        },
    )
    mystery = _incident(
        12,
        phase="update",
        layer=None,
        tensor="weights",
        kind="nonfinite",
        loss=0.52,
        op={
            "type": "AssignSubVariableOp",
            "name": "Adam/update_2",
            "source": None,
            "reproduced": False,
        },
    )
    hostile = _incident(
        20,
        layer=XSS_RUN,
        op={"type": XSS_RUN, "name": XSS_RUN, "source": f"{XSS_RUN}:1", "reproduced": True},
    )
    specs = {
        "adam_lr_5": (overflow, {"step": 33, "signal": "loss"}, OVERFLOW_CAUSE, 38),
        "custom_log": (hostile, None, HOSTILE_CAUSE, 21),
        "healthy": (None, None, None, 50),
        "legacy": (_incident(25, kind="nan", loss="NaN"), None, None, 26),
        "mixed_precision": (mystery, None, UNKNOWN_CAUSE, 13),
        "novel_cause": (_incident(9, kind="nan", loss="NaN"), None, NOVEL_CAUSE, 10),
        LONG_RUN: (None, None, None, 20),
        "resnet_explodes": (None, {"step": 1, "signal": "logits"}, EXPLOSION_CAUSE, 6),
    }
    bundles = {
        "adam_lr_5": {"path": "repro/step_000000037", "exact": True, "snippet": SNIPPET},
        "custom_log": {
            "path": f"repro/{XSS_RUN}",
            "exact": False,
            "snippet": f"# {XSS_RUN}\nx = 1",
        },
        "mixed_precision": {"path": "repro/step_000000012", "exact": None, "snippet": "a\nb"},
    }
    out = {}
    for run, (incident, explosion, cause, steps) in specs.items():
        entry = {
            "run": run,
            "steps": steps,
            "status": "stopped" if incident else "finished",
            "first_nonfinite": incident,
            "explosion": explosion,
            "skipped_count": 0,
        }
        response = {"run": run, "incident": incident, "explosion": explosion, "hints": []}
        response["heatmap"] = _heatmap(incident["step"]) if run == "adam_lr_5" else None
        if run != "legacy":  # an older run: none of the new keys at all
            entry["cause"] = {"id": cause["id"], "summary": cause["summary"]} if cause else None
            response["cause"] = cause
            response["bundle"] = bundles.get(run)
        out[run] = {
            "entry": entry,
            "incident": response,
            "timeline": _timeline(run, steps, incident, explosion),
        }
    return out


RUNS = _fixture_runs()
HEADLINE = "First Inf at step 37, born in the forward phase at layer model/dense_3"


@pytest.fixture(scope="module")
def server():
    with fixture_tab(RUNS, VOCABULARY) as url:
        yield url


class Tab:
    """The tab in its own browser context (colour scheme, clipboard permission)."""

    def __init__(self, browser, base: str, width=1600, height=1100, dark=False, clipboard=True):  # noqa: F811
        self.context = browser.new_context(
            viewport={"width": width, "height": height},
            color_scheme="dark" if dark else "light",
            permissions=["clipboard-read", "clipboard-write"] if clipboard else [],
        )
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        self.page.on("pageerror", lambda exc: self.errors.append(f"pageerror: {exc}"))
        self.page.on(
            "console",
            lambda m: (
                m.type == "error" and self.errors.append(f"{m.text} @ {m.location.get('url')}")
            ),
        )
        self.page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))
        self.base = base

    def open(self, run: str | None = None):
        self.page.goto(self.base)
        self.page.locator("#nanwatch[data-state=ready]").wait_for(timeout=TIMEOUT_MS)
        if run is not None:
            self.show_only(run)
        self.page.locator("#incident-card:not([data-state=loading])").wait_for(timeout=TIMEOUT_MS)
        return self.page.locator("#incident-card")

    def show_only(self, run: str) -> None:
        """Selects `run` alone, so its card is #incident-card."""
        for box in self.page.locator("#run-selector .run-item input").all():
            box.uncheck()
        self.page.locator(f'#run-selector .run-item[data-run="{run}"] input').check()
        self.page.locator(f'.run-panel[data-run="{run}"] #incident-card').wait_for(
            timeout=TIMEOUT_MS
        )

    def close(self) -> None:
        self.context.close()


@pytest.fixture()
def tab(browser, server):  # noqa: F811
    tabs: list[Tab] = []

    def make(**kwargs) -> Tab:
        tabs.append(Tab(browser, server, **kwargs))
        return tabs[-1]

    yield make
    for t in tabs:
        t.close()


def _keep(card, name: str) -> None:
    """Keeps a screenshot of the card alone in test-artifacts/."""
    ARTIFACTS.mkdir(exist_ok=True)
    card.screenshot(path=str(ARTIFACTS / f"card-{name}.png"))


def _texts(locator) -> list[str]:
    return [t.strip() for t in locator.all_inner_texts()]


def _all_texts(locator) -> list[str]:
    """The text of each element, shown or inside a collapsed <details>."""
    return locator.evaluate_all("es => es.map((e) => e.textContent.trim())")


# -- the cause leads the card ----------------------------------------------------------


def test_card_reads_headline_first_remedy_other_remedies_then_evidence_and_details(tab):
    t = tab()
    card = t.open()  # the default selection: the first broken run, adam_lr_5
    assert card.locator("xpath=..").get_attribute("data-run") == "adam_lr_5"
    assert card.get_attribute("data-state") == "nonfinite"
    # The hierarchy: headline, the remedy it leads with, the others (collapsed), then the rest.
    blocks = card.locator(":scope > *").evaluate_all(
        "es => es.map((e) => e.dataset.field || e.className)"
    )
    assert blocks == ["headline", "lead-remedy", "other-remedies", "details"]
    # The headline: what, step, phase, layer, then the cause in one sentence.
    headline = card.locator("[data-field=headline]")
    assert headline.locator(".card-title").inner_text() == HEADLINE
    cause = headline.locator(".cause")
    assert cause.get_attribute("data-cause") == "growth_overflow"
    label = LABELS["growth_overflow"]
    assert cause.locator("[data-field=cause-label]").inner_text() == f"Cause: {label}"
    assert cause.locator("[data-field=cause-summary]").inner_text() == OVERFLOW_CAUSE["summary"]
    # The first remedy alone, in view; no trial ran: the heading says what to try first.
    lead = card.locator(".lead-remedy")
    assert lead.locator("[data-field=lead-heading]").inner_text() == "What to try first"
    assert _texts(lead.locator("ol.remedies > li")) == OVERFLOW_CAUSE["remedies"][:1]
    # The others, collapsed, in their rank order.
    others = card.locator("details.other-remedies")
    assert others.get_attribute("open") is None
    assert others.locator("summary").inner_text() == "Other things to try (3)"
    assert not others.locator("ol.remedies > li").first.is_visible()
    assert _all_texts(card.locator("ol.remedies > li")) == OVERFLOW_CAUSE["remedies"]
    others.locator("summary").click()
    assert _texts(others.locator("ol.remedies > li")) == OVERFLOW_CAUSE["remedies"][1:]
    ranks = others.locator("ol.remedies > li").evaluate_all("ls => ls.map((l) => l.dataset.rank)")
    assert ranks == ["2", "3", "4"]
    # Evidence and details, lighter, after the remedies: readable values, lists joined.
    more = card.locator("[data-field=details]")
    evidence = more.locator(".cause-evidence")
    assert evidence.locator("[data-evidence=growth_factor]").inner_text() == "1.000e26"
    assert evidence.locator("[data-evidence=onset_step]").inner_text() == "33"
    assert (
        evidence.locator("[data-evidence=loss_by_step]").inner_text()
        == "1400, 2900000, 1.400e29, Inf"
    )
    assert "growth factor" in _texts(evidence.locator("dt"))
    weight = "e => parseFloat(getComputedStyle(e).fontSize)"
    assert more.evaluate(weight) < headline.locator(".card-title").evaluate(weight)
    text = card.inner_text()
    assert text.index(HEADLINE) < text.index("What to try first") < text.index("Evidence")
    # The op and its source line, before the recorded fields.
    op = card.locator("[data-field=op]")
    assert op.inner_text() == "op MatMul (name model/dense_3/MatMul) at model.py:42"
    assert text.index("Evidence") < text.index("op MatMul") < text.index("optimizer iterations")
    assert card.locator("[data-field=not-reproduced]").count() == 0
    assert card.locator("[data-field=step]").inner_text() == "37"
    assert t.errors == [] and t.dialogs == []


def test_the_bundle_shows_its_path_exactness_and_a_copyable_snippet(tab):
    t = tab()
    card = t.open()
    assert card.locator("[data-field=bundle-path]").inner_text() == "repro/step_000000037"
    assert card.locator("[data-field=bundle-exact]").inner_text().startswith("exact:")
    snippet = card.locator("pre [data-field=bundle-snippet]")
    assert snippet.inner_text() == SNIPPET
    # Copy: the clipboard API (permission granted in this context).
    card.locator("[data-action=copy-snippet]").click()
    card.locator("[data-field=copy-status]", has_text="Copied").wait_for(timeout=TIMEOUT_MS)
    assert t.page.evaluate("navigator.clipboard.readText()") == SNIPPET
    # The bundle comes after the details, the cause before everything.
    text = card.inner_text()
    assert text.index("optimizer iterations") < text.index("Reproduction bundle")
    assert t.errors == []


def test_copy_without_the_clipboard_api_selects_the_snippet(tab):
    t = tab(clipboard=False)
    t.page.add_init_script(
        "Object.defineProperty(Navigator.prototype, 'clipboard', {get: () => undefined})"
    )
    card = t.open()
    assert t.page.evaluate("navigator.clipboard") is None
    assert t.page.evaluate("window.getSelection().toString()") == ""
    button = card.locator("[data-action=copy-snippet]")
    button.click()
    card.locator("[data-field=copy-status]:not(:empty)").wait_for(timeout=TIMEOUT_MS)
    assert t.page.evaluate("window.getSelection().toString()") == SNIPPET
    assert button.get_attribute("data-outcome") in ("copied", "selected")
    assert t.errors == []


def test_explosion_only_run_shows_the_explosion_with_its_cause(tab):
    t = tab()
    card = t.open("resnet_explodes")
    assert card.get_attribute("data-state") == "explosion"
    text = card.inner_text()
    assert "Healthy" not in text
    assert card.locator("[data-cause=explosion]").count() == 1
    label = card.locator("[data-field=cause-label]").inner_text()
    assert label == f"Cause: {LABELS['explosion']}"
    title = "Explosion from step 1: the logits started to blow up, no NaN or Inf yet"
    assert card.locator(".card-title").inner_text() == title
    assert text.index(title) < text.index(EXPLOSION_CAUSE["summary"])
    # The fix that worked leads, with its trial; the others are collapsed.
    lead = card.locator(".lead-remedy")
    assert lead.get_attribute("data-outcome") == "fixed"
    heading = lead.locator("[data-field=lead-heading]").inner_text()
    assert heading == "Shown to work on a re-run of your steps"
    others = card.locator("details.other-remedies")
    assert others.locator("summary").inner_text() == "Other things we tried (2)"
    others.locator("summary").click()
    remedies = EXPLOSION_CAUSE["remedies"]
    assert _texts(card.locator("ol.remedies .remedy-text")) == [r["text"] for r in remedies]
    assert _texts(card.locator("ol.remedies .remedy-trial")) == [
        "Tried: clipnorm=1.0 kept 40 steps finite, loss 1.0e4 -> 7.7e3",
        "Not tried: no rewind",
        "Tried, did not help: lr x0.1 over 4 steps",
    ]
    items = card.locator("ol.remedies > li")
    outcomes = [items.nth(i).get_attribute("data-outcome") for i in range(items.count())]
    assert outcomes == ["fixed", "not_tried", "not_fixed"]
    color = "el => getComputedStyle(el).color"
    trial_lines = card.locator(".remedy-trial")
    assert trial_lines.nth(2).evaluate(color) != trial_lines.nth(0).evaluate(color)
    assert card.locator(".bundle").count() == 0  # null bundle: nothing shown
    _keep(card, "explosion")
    assert t.errors == []


def test_a_remedys_code_is_a_copyable_snippet_under_it(tab):
    t = tab()
    card = t.open("resnet_explodes")
    first = card.locator("ol.remedies > li").nth(0)
    assert first.locator("pre [data-field=remedy-code]").inner_text() == REMEDY_CODE
    # Only the remedies with code carry a snippet.
    assert card.locator("ol.remedies [data-field=remedy-code]").count() == 1
    first.locator("[data-action=copy-remedy-code]").click()
    first.locator("[data-field=copy-status]", has_text="Copied").wait_for(timeout=TIMEOUT_MS)
    assert t.page.evaluate("navigator.clipboard.readText()") == REMEDY_CODE
    assert t.errors == []


def test_unknown_cause_says_so_and_shows_what_was_seen(tab):
    t = tab()
    card = t.open("mixed_precision")
    assert card.get_attribute("data-state") == "nonfinite"
    label = card.locator("[data-field=cause-label]").inner_text()
    assert label == "Cause unknown: the evidence fits no known cause"
    assert "What was seen" in card.inner_text()
    assert card.locator("[data-evidence=loss_scale]").inner_text() == "32768"
    assert card.locator("ol.remedies").count() == 0  # no remedies: no empty list
    # A loss-scaler incident without a recorded origin.
    kind = diagnosis.KIND_TEXT[diagnosis.UNKNOWN_KIND]
    assert (
        card.locator(".card-title").inner_text()
        == f"First {kind} at step 12, born in the update phase"
    )
    assert card.locator("[data-field=kind]").inner_text() == kind
    op = card.locator("[data-field=op]").inner_text()
    # No source line recorded: none is shown (a card shows only what was recorded).
    assert op == "op AssignSubVariableOp (name Adam/update_2) · not reproduced by the replay"
    assert card.locator("[data-field=op-source]").count() == 0
    assert card.locator("[data-field=bundle-exact]").inner_text() == "exactness not recorded"
    _keep(card, "unknown")
    assert t.errors == []


def test_a_cause_only_the_vocabulary_knows_shows_the_label_it_was_sent(tab):
    t = tab()
    card = t.open("novel_cause")
    headline = card.locator(":scope > [data-field=headline]")
    assert headline.locator(".cause").get_attribute("data-cause") == "novel_cause"
    assert card.locator("[data-field=cause-label]").inner_text() == f"Cause: {NOVEL_LABEL}"
    nan = diagnosis.KIND_TEXT["nan"]
    assert card.locator(".card-title").inner_text() == (
        f"First {nan} at step 9, born in the forward phase at layer model/dense_3"
    )
    line = t.page.locator('#run-selector .run-item[data-run="novel_cause"] [data-field=cause]')
    assert line.get_attribute("title") == f"{NOVEL_LABEL}: {NOVEL_CAUSE['summary']}"
    # The loss "NaN" of the card's details came back as a number (a timeline mark too).
    assert card.locator("[data-field=loss]").inner_text() == "NaN"
    timeline = t.page.locator("#timeline[data-state=ready]")
    timeline.wait_for(timeout=TIMEOUT_MS)
    assert int(timeline.get_attribute("data-marks-inside")) >= 1
    assert t.errors == []


def test_older_run_without_the_new_keys_still_shows_its_card(tab):
    t = tab()
    card = t.open("legacy")
    assert card.get_attribute("data-state") == "nonfinite"
    assert card.locator(".card-title").inner_text() == (
        "First NaN at step 25, born in the forward phase at layer model/dense_3"
    )
    assert card.locator(".cause").count() == 0
    assert card.locator("[data-field=op]").count() == 0
    assert card.locator(".bundle").count() == 0
    assert card.locator("[data-field=loss]").inner_text() == "NaN"
    _keep(card, "legacy")
    healthy = t.open("healthy")
    assert healthy.get_attribute("data-state") == "healthy"
    assert healthy.locator(".cause").count() == 0
    assert t.errors == []


# -- the run list ------------------------------------------------------------------------


def test_run_list_shows_each_cause_on_one_ellipsized_line(tab):
    t = tab(width=1600)
    t.open()
    items = t.page.locator("#run-selector .run-item")
    with_cause = {
        "adam_lr_5": "growth_overflow",
        "custom_log": "forward_math",
        "mixed_precision": "unknown",
        "novel_cause": "novel_cause",
        "resnet_explodes": "explosion",
    }
    for run in RUNS:
        line = items.locator(f'xpath=self::*[@data-run="{run}"]').locator("[data-field=cause]")
        if run not in with_cause:
            assert line.count() == 0, run
            continue
        assert line.get_attribute("data-cause") == with_cause[run]
        cause = RUNS[run]["incident"]["cause"]
        assert line.get_attribute("title").endswith(cause["summary"])
        # One line: its height is one line of text; long text is cut, not wrapped.
        metrics = line.evaluate(
            "e => ({h: e.clientHeight, lh: parseFloat(getComputedStyle(e).lineHeight) || 16,"
            " over: e.scrollWidth > e.clientWidth, ellipsis: getComputedStyle(e).textOverflow})"
        )
        assert metrics["h"] <= metrics["lh"] * 1.5, (run, metrics)
        assert metrics["ellipsis"] == "ellipsis"
    overflow = items.locator('xpath=self::*[@data-run="adam_lr_5"]').locator("[data-field=cause]")
    assert overflow.inner_text().startswith(f"{LABELS['growth_overflow']}: The loss grew")
    assert overflow.evaluate("e => e.scrollWidth > e.clientWidth")  # long: it is cut
    assert t.errors == []


# -- hostile strings ---------------------------------------------------------------------


def test_hostile_cause_op_and_bundle_strings_render_as_text(tab):
    t = tab()
    card = t.open("custom_log")
    assert card.locator("[data-field=cause-summary]").inner_text() == f"{XSS_RUN} made a NaN"
    assert card.locator(f'[data-evidence="{XSS_RUN}"]').inner_text() == XSS_RUN
    assert card.locator("[data-evidence=rows]").inner_text() == "<b>0</b>, <b>1</b>, <b>2</b>"
    assert _all_texts(card.locator("ol.remedies > li")) == HOSTILE_CAUSE["remedies"]
    assert card.locator("[data-field=op-source]").inner_text() == f"{XSS_RUN}:1"
    assert card.locator("[data-field=bundle-path]").inner_text() == f"repro/{XSS_RUN}"
    assert card.locator("[data-field=bundle-snippet]").inner_text() == f"# {XSS_RUN}\nx = 1"
    run_line = t.page.locator('#run-selector .run-item[data-run="custom_log"] [data-field=cause]')
    assert XSS_RUN in run_line.inner_text()
    assert t.page.locator("img, script:not([type=module]), b").count() == 0
    _keep(card, "hostile")
    t.page.wait_for_timeout(300)
    assert t.dialogs == []
    assert t.errors == []


# -- layout, dark mode, screenshots --------------------------------------------------------


def _luminance(css: str) -> float:
    parts = css[css.index("(") + 1 : css.index(")")].split(",")

    def channel(c: float) -> float:
        c /= 255
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (channel(float(p)) for p in parts[:3])
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def _contrast(locator, background_of) -> float:
    fg = _luminance(locator.evaluate("e => getComputedStyle(e).color"))
    bg = _luminance(background_of.evaluate("e => getComputedStyle(e).backgroundColor"))
    hi, lo = max(fg, bg), min(fg, bg)
    return (hi + 0.05) / (lo + 0.05)


@pytest.mark.parametrize("dark", [False, True], ids=["light", "dark"])
@pytest.mark.parametrize("width", [1024, 1600])
def test_card_fits_and_reads_at_each_width_and_theme(tab, width, dark):
    t = tab(width=width, height=1000, dark=dark)
    card = t.open()
    html = t.page.locator("html")
    assert html.get_attribute("data-theme") == ("dark" if dark else "light")
    # No clipping: the card and each of its blocks lie inside the window, nothing overflows.
    box = card.bounding_box()
    assert box["x"] >= 0 and box["x"] + box["width"] <= width, box
    assert card.evaluate("e => e.scrollWidth <= e.clientWidth")
    assert html.evaluate("e => e.scrollWidth <= e.clientWidth + 1")
    for part in (".cause", ".cause-evidence", "ol.remedies", "[data-field=op]", ".bundle", "pre"):
        inner = card.locator(part).first.bounding_box()
        assert inner["x"] >= box["x"] and inner["x"] + inner["width"] <= box["x"] + box["width"] + 1
    copy = card.locator("[data-action=copy-snippet]").bounding_box()
    assert copy["x"] + copy["width"] <= box["x"] + box["width"]
    # Readable: every text of the new blocks has a contrast of 4.5:1 at least on the card.
    for part in (
        "[data-field=cause-summary]",
        "[data-field=cause-label]",
        ".cause-evidence dd",
        ".cause-evidence dt",
        "ol.remedies > li",
        "[data-field=op]",
        "[data-field=bundle-snippet]",
    ):
        ratio = _contrast(card.locator(part).first, card)
        assert ratio >= 4.5, (part, ratio)
    run_line = t.page.locator('#run-selector .run-item[data-run="adam_lr_5"] [data-field=cause]')
    assert _contrast(run_line, t.page.locator('.run-item[data-run="adam_lr_5"]')) >= 4.5
    # The bundle's code is not clipped: it wraps inside its box, every character shown.
    _not_clipped(card.locator("pre:has([data-field=bundle-snippet])"), box)
    assert card.locator("[data-field=bundle-snippet]").inner_text() == SNIPPET
    # Run names wrap between their words, in the list and as a panel's title.
    t.page.locator(f'#run-selector .run-item[data-run="{LONG_RUN}"] input').check()
    title = t.page.locator(f'.run-panel[data-run="{LONG_RUN}"] .run-title')
    title.wait_for(timeout=TIMEOUT_MS)
    names = t.page.locator("#run-selector .run-name")
    assert names.count() == len(RUNS)
    for name in [*names.all(), title]:
        breaks = name.evaluate(LINE_BREAKS)
        assert all(before in NAME_SEPARATORS for before, _ in breaks), (name.inner_text(), breaks)
    long_name = t.page.locator(f'.run-item[data-run="{LONG_RUN}"] .run-name')
    assert long_name.evaluate(LINE_BREAKS), "the long name wraps in the run list"
    assert long_name.inner_text() == LONG_RUN
    ARTIFACTS.mkdir(exist_ok=True)
    t.page.screenshot(path=str(ARTIFACTS / f"card-{width}-{'dark' if dark else 'light'}.png"))
    assert t.errors == []


# Where a line of a text breaks: [character before, character after] of each break.
LINE_BREAKS = """(e) => {
  const breaks = [];
  const walker = document.createTreeWalker(e, NodeFilter.SHOW_TEXT);
  let top = null, before = "";
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    for (let i = 0; i < n.data.length; i++) {
      const range = document.createRange();
      range.setStart(n, i);
      range.setEnd(n, i + 1);
      const rect = range.getClientRects()[0];
      if (!rect) continue;
      if (top !== null && rect.top > top + 2) breaks.push([before, n.data[i]]);
      top = rect.top;
      before = n.data[i];
    }
  }
  return breaks;
}"""
NAME_SEPARATORS = set("_/-.:=, ")


def _not_clipped(pre, card_box: dict) -> None:
    """A code box shows all of its text: nothing scrolled out of it, inside the card."""
    size = pre.evaluate(
        "e => ({sw: e.scrollWidth, cw: e.clientWidth, sh: e.scrollHeight, ch: e.clientHeight})"
    )
    assert size["sw"] <= size["cw"] and size["sh"] <= size["ch"], size
    outer, code = pre.bounding_box(), pre.locator("code").bounding_box()
    assert code["x"] + code["width"] <= outer["x"] + outer["width"] + 1, (code, outer)
    assert outer["x"] + outer["width"] <= card_box["x"] + card_box["width"] + 1


FIRST_SCREEN = {1024: 768, 1600: 900}  # the window's height at each width


def _on_first_screen(locator, width: int, height: int) -> None:
    """The element lies wholly inside the window, unscrolled."""
    box = locator.bounding_box()
    assert box is not None
    assert box["x"] >= 0 and box["x"] + box["width"] <= width + 1, box
    assert box["y"] >= 0 and box["y"] + box["height"] <= height, (box, height)


@pytest.mark.parametrize("dark", [False, True], ids=["light", "dark"])
@pytest.mark.parametrize("width", [1024, 1600])
def test_headline_and_first_remedy_are_on_the_first_screen(tab, width, dark):
    """Issue 56: what, where and the cause, and the one remedy to apply with
    its code and its trial, are read without scrolling."""
    height = FIRST_SCREEN[width]
    t = tab(width=width, height=height, dark=dark)
    for run in ("adam_lr_5", "resnet_explodes"):
        card = t.open(run)
        assert t.page.locator(".panels").evaluate("e => e.scrollTop") == 0
        headline = card.locator("[data-field=headline]")
        lead = card.locator(".lead-remedy")
        _on_first_screen(headline, width, height)
        _on_first_screen(lead, width, height)
        for part in (".card-title", "[data-field=cause-summary]", "[data-field=lead-heading]"):
            assert _contrast(card.locator(part), card) >= 4.5, part
        for part in (".remedy-text", ".remedy-trial", "[data-field=remedy-code]"):
            if lead.locator(part).count():
                assert _contrast(lead.locator(part), lead) >= 4.5, part
        size = "e => parseFloat(getComputedStyle(e).fontSize)"
        title_size = card.locator(".card-title").evaluate(size)
        texts = card.locator("p, li, dd, dt, code, summary, h4").evaluate_all(
            "es => es.map((e) => parseFloat(getComputedStyle(e).fontSize))"
        )
        assert title_size > max(texts), (title_size, max(texts))  # the headline leads
    code = card.locator("[data-field=remedy-code]")  # resnet_explodes: the fix that worked
    assert code.inner_text() == REMEDY_CODE
    _on_first_screen(code, width, height)
    theme = "dark" if dark else "light"
    ARTIFACTS.mkdir(exist_ok=True)
    t.page.screenshot(path=str(ARTIFACTS / f"card-first-screen-{width}-{theme}.png"))
    assert t.errors == []


def test_view_helpers_in_node():
    """cause.js and repro_bundle.js helpers, and revive() on the new keys."""
    script = f"""
      import {{ useVocabulary, kindLabel }} from "./src/vocabulary.js";
      useVocabulary({json.dumps(vocabulary())});
    """
    script += """
      import { causeLabel, causeLine, evidenceText, evidenceName } from "./src/cause.js";
      import { exactText } from "./src/repro_bundle.js";
      import { revive } from "./src/api.js";
      const r = revive({ cause: { id: "unknown", summary: "NaN", remedies: ["Infinity"],
                                   evidence: { x: "NaN", l: [1, "-Infinity"] } },
                         bundle: { path: "NaN", snippet: "Infinity" },
                         op: { type: "NaN", name: "Infinity", source: "NaN" } });
      console.log(JSON.stringify({
        labels: ["input_data", "fp16_overflow", "brand_new"].map(causeLabel),
        line: causeLine({ id: "loss_math", summary: "log(0)." }), none: causeLine(null),
        texts: [evidenceText(1e26), evidenceText([1, NaN, -Infinity]), evidenceText(true),
                evidenceText(Array.from({ length: 15 }, (_, i) => i)), evidenceText({ a: 2 })],
        name: evidenceName("onset_step"),
        exact: [true, false, null].map(exactText).map((s) => s.split(":")[0]),
        kind: kindLabel("nonfinite"),
        revived: [r.cause.summary, r.cause.remedies[0], String(r.cause.evidence.x),
                  String(r.cause.evidence.l[1]), r.bundle.path, r.bundle.snippet,
                  r.op.type, r.op.name, r.op.source],
      }));
    """
    out = run_node_module(script)
    labels = vocabulary()["causes"]
    assert out["labels"] == [labels["input_data"], labels["fp16_overflow"], "brand_new"]
    assert out["line"] == f"{labels['loss_math']}: log(0)." and out["none"] is None
    assert out["texts"] == [
        "1.000e26",
        "1, NaN, -Inf",
        "yes",
        "0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, … (3 more)",
        "a: 2",
    ]
    assert out["name"] == "onset step"
    assert out["exact"] == ["exact", "not exact", "exactness not recorded"]
    assert out["kind"] == diagnosis.KIND_TEXT["nonfinite"]
    # Text keys stay text; evidence values are numbers, NaN kept.
    assert out["revived"] == [
        "NaN",
        "Infinity",
        "NaN",
        "-Infinity",
        "NaN",
        "Infinity",
        "NaN",
        "Infinity",
        "NaN",
    ]


# -- inside a real TensorBoard ---------------------------------------------------------------


def test_card_in_tensorboards_iframe_with_intercepted_routes(browser, tmp_path):  # noqa: F811
    """The real plugin iframe (its <base>, its permissions policy), with
    the new keys added to TensorBoard's own `incident` and `runs` answers."""
    from tb_nanwatch.record.writing.synthetic import write_synthetic_run

    write_synthetic_run(str(tmp_path / "logs" / "broken"), steps=60, num_layers=3, incident_step=40)

    def add_keys(route):
        body = route.fetch().json()
        if "incident" in body:
            body.update(cause=OVERFLOW_CAUSE, bundle=RUNS["adam_lr_5"]["incident"]["bundle"])
        else:
            for entry in body["runs"]:
                entry["cause"] = {"id": "growth_overflow", "summary": OVERFLOW_CAUSE["summary"]}
        route.fulfill(json=body)

    with tensorboard(tmp_path / "logs", tmp_path) as base:
        watched = Watched(browser, width=1024, height=1000)
        try:
            watched.page.context.grant_permissions(["clipboard-read", "clipboard-write"])
            watched.page.route("**/data/plugin/nanwatch/incident?*", add_keys)
            watched.page.route("**/data/plugin/nanwatch/runs", add_keys)
            frame = watched.open_tab(base)
            card = frame.locator("#incident-card[data-state=nonfinite]")
            card.wait_for(timeout=TIMEOUT_MS)
            headline = card.locator(":scope > *").first
            assert headline.get_attribute("data-field") == "headline"
            assert headline.locator(".cause").get_attribute("data-cause") == "growth_overflow"
            assert card.locator(".card-title").inner_text().startswith("First NaN at step 40, ")
            assert _all_texts(card.locator("ol.remedies > li")) == OVERFLOW_CAUSE["remedies"]
            # The headline and the first remedy on the first screen, under TensorBoard's bar.
            for part in (headline, card.locator(".lead-remedy")):
                _on_first_screen(part, 1024, 1000)
            line = frame.locator('.run-item[data-run="broken"] [data-field=cause]')
            assert line.inner_text().startswith(LABELS["growth_overflow"])
            iframe = watched.page.locator('iframe[src*="plugin_entry.html?name=nanwatch"]')
            right = iframe.bounding_box()
            box = card.bounding_box()
            assert box["x"] + box["width"] <= right["x"] + right["width"] + 1
            assert card.evaluate("e => e.scrollWidth <= e.clientWidth")
            button = card.locator("[data-action=copy-snippet]")
            button.click()
            card.locator("[data-field=copy-status]:not(:empty)").wait_for(timeout=TIMEOUT_MS)
            if button.get_attribute("data-outcome") == "copied":
                assert watched.page.evaluate("navigator.clipboard.readText()") == SNIPPET
            else:
                selected = card.evaluate("e => e.ownerDocument.getSelection().toString()")
                assert selected == SNIPPET
            card.scroll_into_view_if_needed()
            ARTIFACTS.mkdir(exist_ok=True)
            watched.page.screenshot(path=str(ARTIFACTS / "card-tensorboard-1024.png"))
            assert watched.errors == [], watched.errors
        finally:
            watched.close()
