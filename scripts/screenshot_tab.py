"""Takes the README's screenshot of the NaN Watch tab: docs/images/tab.png.

    python scripts/screenshot_tab.py                 # demo runs, then the screenshot
    python scripts/screenshot_tab.py --logdir LOGS   # runs already written

Writes two demo runs (seed 000, NaN born inside a nested model, and the
healthy run) with demo/run_all.py into a temporary log dir, starts TensorBoard
on a free port, opens the NaN Watch tab in headless Chromium (Playwright,
Debian's /usr/bin/chromium or NANWATCH_CHROMIUM) at 1600 px wide (``--width``;
``--dark`` in a dark colour scheme), saves the PNG and stops TensorBoard.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from nanwatch_testlib import CHROMIUM, CHROMIUM_ARGS, tensorboard_process  # noqa: E402 - the tests' Chromium

SCENARIOS = ("seed000_nested_sigmoid_bce", "healthy")
IFRAME = 'iframe[src*="plugin_entry.html?name=nanwatch"]'
TIMEOUT_S = 120.0


def write_demo_runs(logdir: Path) -> None:
    command = [sys.executable, str(ROOT / "demo" / "run_all.py"), "--logdir", str(logdir)]
    subprocess.run([*command, "--only", *SCENARIOS], check=True, cwd=ROOT)


def runs_listed(base: str) -> int:
    with urllib.request.urlopen(f"{base}/data/plugin/nanwatch/runs", timeout=5) as response:
        return len(json.load(response)["runs"])


def screenshot(base: str, out: Path, width: int, height: int, dark: bool = False) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            scheme = "dark" if dark else "light"  # TensorBoard and the tab follow it
            page = browser.new_page(
                viewport={"width": width, "height": height}, color_scheme=scheme
            )
            page.goto(f"{base}/#nanwatch")
            frame = page.frame_locator(IFRAME)
            timeout_ms = TIMEOUT_S * 1000
            frame.locator("#nanwatch[data-state=ready]").wait_for(timeout=timeout_ms)
            frame.locator("#incident-card [data-field=step]").wait_for(timeout=timeout_ms)
            page.wait_for_timeout(1500)  # the canvases' last draw
            out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(out))
        finally:
            browser.close()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images" / "tab.png")
    parser.add_argument("--logdir", type=Path, help="serve these runs; write no demo runs")
    parser.add_argument("--width", type=int, default=1600)
    parser.add_argument("--height", type=int, default=1250)
    parser.add_argument("--dark", action="store_true", help="the browser prefers a dark theme")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="nanwatch_shot_") as tmp:
        logdir = args.logdir
        if logdir is None:
            logdir = Path(tmp) / "logs"
            write_demo_runs(logdir)
        want = len(SCENARIOS) if args.logdir is None else 1
        ready = lambda base: runs_listed(base) >= want  # noqa: E731
        log_path = Path(tmp) / "tensorboard.log"
        extra = ("--load_fast=false",)
        with tensorboard_process(
            logdir, log_path, ready, extra_args=extra, timeout=TIMEOUT_S
        ) as base:
            screenshot(base, args.out, args.width, args.height, args.dark)
    print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
