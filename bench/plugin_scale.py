"""The NaN Watch plugin on a long run: route latency, TensorBoard memory, browser.

    python bench/plugin_scale.py [--steps 100000] [--layers 200] [--json out.json]

1. Writes a synthetic run (``tb_nanwatch.record.writing.synthetic.write_synthetic_run``,
   through the real journal) of ``--steps`` steps and ``--layers`` layers with
   a forward NaN near the end.
2. For each data provider (``--load_fast=false``: the Python loader;
   ``--load_fast=true``: the Rust data server) starts a real ``tensorboard``,
   waits until the ``runs`` route reports the run with all its steps (the run
   summary is the last event of the file, so the whole file has been read),
   then times ``timeline`` and ``incident`` (first request, then the median
   and max of ``--requests`` more) and reads TensorBoard's RSS (and the data
   server's, a child process) from ``/proc``.
3. With the Python loader still up, opens the NaN Watch tab in headless
   Chromium (Playwright) and measures the time to the first render of the
   timeline and heatmap, zooms and pans on the timeline and records how long
   each takes and the long tasks (> 50 ms of main-thread work, via
   ``PerformanceObserver``) seen meanwhile. Skipped with a note if Playwright,
   Chromium or the frontend is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

# The browser is launched exactly as the browser tests launch it.
from nanwatch_testlib import CHROMIUM, CHROMIUM_ARGS, free_port  # noqa: E402
from worker import dir_bytes, vm_rss_kib  # noqa: E402

IFRAME = 'iframe[src*="plugin_entry.html?name=nanwatch"]'


def log(msg: str) -> None:
    print(f"[plugin_scale {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def rss_mib(pid: int) -> float | None:
    try:
        kib = vm_rss_kib(pid)
    except OSError:  # the process is gone
        return None
    return kib / 1024 if kib >= 0 else None


def children(pid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                out.append(int(name))
        except (OSError, IndexError, ValueError):
            pass
    return out


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


def get(url: str, timeout: float = 60.0) -> tuple[float, int, bytes]:
    start = time.perf_counter()
    with urllib.request.urlopen(url, timeout=timeout) as response:
        body = response.read()
        code = response.status
    return time.perf_counter() - start, code, body


def generate(logdir: str, run: str, steps: int, layers: int, incident_step: int) -> dict:
    from tb_nanwatch.record.writing.synthetic import write_synthetic_run

    start = time.perf_counter()
    summary = write_synthetic_run(
        os.path.join(logdir, run),
        steps=steps,
        num_layers=layers,
        incident_step=incident_step,
        incident_layer=layers // 2,
        seed=0,
    )
    return {
        "generate_s": time.perf_counter() - start,
        "recorded_steps": summary["steps"],
        "event_bytes": dir_bytes(os.path.join(logdir, run)),
        "first_nonfinite": summary["first_nonfinite"],
    }


class TensorBoard:
    def __init__(self, logdir: str, load_fast: bool) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = tempfile.mktemp(prefix="nwbench-tb-", suffix=".log")
        self.proc = subprocess.Popen(
            [
                shutil.which("tensorboard") or "tensorboard",
                "--logdir",
                logdir,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                f"--load_fast={'true' if load_fast else 'false'}",
                "--reload_interval",
                "5",
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(self.log_path, "w"),
            cwd=tempfile.gettempdir(),
        )

    def url(self, route: str, **params) -> str:
        query = urllib.parse.urlencode(params)
        return f"{self.base}/data/plugin/nanwatch/{route}" + (f"?{query}" if query else "")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def tail(self) -> str:
        try:
            with open(self.log_path) as f:
                return f.read()[-600:]
        except OSError:
            return ""


def wait_loaded(tb: TensorBoard, run: str, steps: int, timeout: float) -> float:
    """Seconds from start until the runs route lists ``run`` with all steps."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if tb.proc.poll() is not None:
            raise RuntimeError(f"tensorboard exited: {tb.tail()}")
        try:
            _, code, body = get(tb.url("runs"), timeout=10)
            if code == 200:
                for entry in json.loads(body).get("runs", []):
                    if entry.get("run") == run and entry.get("steps") == steps:
                        return time.perf_counter() - start
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.5)
    raise RuntimeError(f"run not loaded after {timeout:.0f} s")


def time_route(tb: TensorBoard, route: str, params: dict, n: int) -> dict:
    first, code, body = get(tb.url(route, **params))
    if code != 200:
        raise RuntimeError(f"{route} answered {code}")
    times = [get(tb.url(route, **params))[0] for _ in range(n)]
    return {
        "first_ms": 1e3 * first,
        "median_ms": 1e3 * statistics.median(times),
        "max_ms": 1e3 * max(times),
        "bytes": len(body),
        "body": body,
    }


def baseline_rss(load_fast: bool) -> dict:
    """TensorBoard's RSS on an empty log dir (what the run adds is the rest)."""
    empty = tempfile.mkdtemp(prefix="nwbench-empty-")
    tb = TensorBoard(empty, load_fast)
    try:
        start = time.perf_counter()
        while time.perf_counter() - start < 120:
            try:
                if get(tb.url("runs"), timeout=10)[1] == 200:
                    break
            except Exception:  # noqa: BLE001
                time.sleep(0.5)
        time.sleep(6)  # one reload cycle
        kids = descendants(tb.proc.pid)
        return {
            "tb_rss_mib": rss_mib(tb.proc.pid),
            "server_rss_mib": sum(rss_mib(k) or 0 for k in kids) if load_fast and kids else None,
        }
    finally:
        tb.stop()
        shutil.rmtree(empty, ignore_errors=True)


def measure_server(
    logdir: str, run: str, steps: int, load_fast: bool, requests: int, keep: bool = False
) -> tuple[dict, TensorBoard | None]:
    mode = f"load_fast={'true' if load_fast else 'false'}"
    log(f"starting tensorboard {mode}")
    tb = TensorBoard(logdir, load_fast)
    out: dict = {"mode": mode}
    try:
        out["load_s"] = wait_loaded(tb, run, steps, timeout=600)
        log(f"{mode}: loaded in {out['load_s']:.1f} s")
        timeline = time_route(tb, "timeline", {"run": run}, requests)
        incident = time_route(tb, "incident", {"run": run}, requests)
        # a zoomed-in window near the incident, as the frontend asks after a zoom
        end = steps
        zoom = time_route(
            tb,
            "timeline",
            {"run": run, "start": max(0, end - 2000), "end": end, "max_points": 4000},
            requests,
        )
        for name, r in (("timeline", timeline), ("incident", incident), ("zoom", zoom)):
            out[f"{name}_first_ms"] = r["first_ms"]
            out[f"{name}_median_ms"] = r["median_ms"]
            out[f"{name}_max_ms"] = r["max_ms"]
            out[f"{name}_bytes"] = r["bytes"]
        parsed = json.loads(timeline["body"])
        out["timeline_points"] = len(parsed.get("steps", []))
        out["timeline_bucket"] = parsed.get("bucket")
        heat = json.loads(incident["body"]).get("heatmap") or {}
        out["heatmap_layers"] = len(heat.get("layers", []))
        out["heatmap_steps"] = len(heat.get("steps", []))
        out["tb_rss_mib"] = rss_mib(tb.proc.pid)
        kids = descendants(tb.proc.pid)
        server = [k for k in kids if (rss_mib(k) or 0) > 1]
        if load_fast:
            out["server_rss_mib"] = sum(rss_mib(k) or 0 for k in server) if server else None
        out["notes"] = (
            f"timeline: {out['timeline_points']} points (bucket {out['timeline_bucket']}), "
            f"{out['timeline_bytes'] / 1024:.0f} KiB, first request {out['timeline_first_ms']:.0f} ms; "
            f"incident: heatmap {out['heatmap_layers']} layers x {out['heatmap_steps']} steps, "
            f"{out['incident_bytes'] / 1024:.0f} KiB, first request {out['incident_first_ms']:.0f} ms; "
            f"zoomed timeline (last 2000 steps): median {out['zoom_median_ms']:.0f} ms"
        )
    except Exception as error:  # noqa: BLE001 - reported in the table
        out["error"] = f"{type(error).__name__}: {error}"
        log(f"{mode}: {out['error']}")
    if keep and "error" not in out:
        return out, tb
    tb.stop()
    return out, None


def browser(tb: TensorBoard, steps: int) -> dict:
    static = os.path.join(ROOT, "tb_nanwatch", "board", "static", "index.js")
    if not os.path.exists(static):
        return {"skipped": "tb_nanwatch/static/index.js does not exist"}
    if not os.path.exists(CHROMIUM):
        return {"skipped": f"no Chromium at {CHROMIUM}"}
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return {"skipped": "playwright is not installed"}
    out: dict = {}
    with sync_playwright() as p:
        browser_ = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser_.new_page(viewport={"width": 1400, "height": 1000})
        try:
            start = time.perf_counter()
            page.goto(f"{tb.base}/#nanwatch")
            frame = page.frame_locator(IFRAME)
            frame.locator("#timeline[data-state=ready]").wait_for(timeout=120_000)
            out["first_timeline_render_s"] = round(time.perf_counter() - start, 2)
            frame.locator("#heatmap[data-state=ready]").wait_for(timeout=120_000)
            out["first_heatmap_render_s"] = round(time.perf_counter() - start, 2)
            handle = page.locator(IFRAME).element_handle()
            inner = handle.content_frame()
            inner.evaluate(
                """() => {
                  window.__longtasks = [];
                  try {
                    new PerformanceObserver(list => {
                      for (const e of list.getEntries()) window.__longtasks.push(e.duration);
                    }).observe({type: 'longtask', buffered: false});
                    window.__lt_ok = true;
                  } catch (e) { window.__lt_ok = false; }
                }"""
            )
            timeline = frame.locator("#timeline")
            info = lambda: timeline.evaluate(  # noqa: E731
                "e => ({state: e.dataset.state, bucket: +e.dataset.bucket, "
                "start: +e.dataset.viewStart, end: +e.dataset.viewEnd})"
            )
            out["initial_view"] = info()
            zooms = []
            for _ in range(4):  # zoom in 4 times on the end of the run (the incident)
                box = frame.locator("#timeline .u-over").bounding_box()
                y = box["y"] + box["height"] / 2
                x0, x1 = box["x"] + box["width"] * 0.80, box["x"] + box["width"] * 0.995
                before = info()
                t0 = time.perf_counter()
                page.mouse.move(x0, y)
                page.mouse.down()
                page.mouse.move((x0 + x1) / 2, y, steps=4)
                page.mouse.move(x1, y, steps=4)
                page.mouse.up()
                t_drawn = None
                deadline = time.perf_counter() + 30
                while time.perf_counter() < deadline:
                    now = info()
                    if now["start"] != before["start"] and t_drawn is None:
                        t_drawn = time.perf_counter() - t0
                    if (
                        now["state"] == "ready"
                        and now["start"] != before["start"]
                        and (now["bucket"] < before["bucket"] or now["bucket"] == 1)
                    ):
                        break
                    time.sleep(0.01)
                settled = time.perf_counter() - t0
                page.wait_for_timeout(300)
                now = info()
                zooms.append(
                    {
                        "view": f"{now['start']}-{now['end']}",
                        "bucket": now["bucket"],
                        "visible_change_ms": round(1e3 * (t_drawn or settled)),
                        "refined_data_ms": round(1e3 * settled),
                    }
                )
            out["zooms"] = zooms
            pans = []
            for _ in range(4):
                before = info()
                t0 = time.perf_counter()
                frame.locator("#timeline [data-action=pan-left]").click()
                deadline = time.perf_counter() + 30
                while time.perf_counter() < deadline:
                    now = info()
                    if now["start"] != before["start"] and now["state"] == "ready":
                        break
                    time.sleep(0.01)
                pans.append(round(1e3 * (time.perf_counter() - t0)))
                page.wait_for_timeout(300)
            out["pan_left_ms"] = pans
            t0 = time.perf_counter()
            frame.locator("#timeline [data-action=reset-zoom]").click()
            frame.locator("#timeline[data-view-start='0']").wait_for(timeout=30_000)
            out["reset_zoom_ms"] = round(1e3 * (time.perf_counter() - t0))
            page.wait_for_timeout(500)
            tasks = inner.evaluate("() => window.__longtasks")
            out["longtask_observer"] = inner.evaluate("() => window.__lt_ok")
            out["long_tasks_during_interaction"] = len(tasks)
            out["longest_task_ms"] = round(max(tasks), 1) if tasks else 0
            out["long_tasks_total_ms"] = round(sum(tasks), 1)
            out["tb_rss_mib_after_browser"] = round(rss_mib(tb.proc.pid) or 0)
        except Exception as error:  # noqa: BLE001
            out["error"] = f"{type(error).__name__}: {str(error)[:300]}"
            try:
                page.screenshot(
                    path=os.path.join(tempfile.gettempdir(), "nwbench-browser-error.png")
                )
            except Exception:  # noqa: BLE001
                pass
        browser_.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--layers", type=int, default=200)
    parser.add_argument("--requests", type=int, default=7)
    parser.add_argument("--logdir", default=None, help="reuse/keep this log dir")
    parser.add_argument("--json", default=None)
    parser.add_argument("--no-browser", action="store_true")
    parser.add_argument(
        "--no-baseline", action="store_true", help="skip TensorBoard's RSS on an empty log dir"
    )
    args = parser.parse_args()
    logdir = args.logdir or tempfile.mkdtemp(prefix="nwbench-plugin-")
    run = f"synthetic_{args.steps}x{args.layers}"
    incident_step = args.steps - max(args.steps // 100, 5)
    result: dict = {"steps": args.steps, "layers": args.layers, "incident_step": incident_step}
    if os.path.isdir(os.path.join(logdir, run)):
        log(f"reusing {os.path.join(logdir, run)}")
        result.update(generate_s=0.0, event_bytes=dir_bytes(os.path.join(logdir, run)))
    else:
        log(f"writing {run} into {logdir}")
        result.update(generate(logdir, run, args.steps, args.layers, incident_step))
        log(f"generated in {result['generate_s']:.1f} s, {result['event_bytes'] / 2**20:.1f} MiB")
    recorded = incident_step + 1  # training stops at the incident
    servers = []
    slow, tb = measure_server(logdir, run, recorded, False, args.requests, keep=not args.no_browser)
    servers.append(slow)
    if tb is not None:
        log("browser")
        result["browser"] = browser(tb, recorded)
        tb.stop()
    fast, _ = measure_server(logdir, run, recorded, True, args.requests)
    servers.append(fast)
    for server, load_fast in () if args.no_baseline else ((slow, False), (fast, True)):
        base = baseline_rss(load_fast)
        server["empty_tb_rss_mib"] = base["tb_rss_mib"]
        server["empty_server_rss_mib"] = base["server_rss_mib"]
    result["servers"] = servers
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    if not args.logdir:
        shutil.rmtree(logdir, ignore_errors=True)


if __name__ == "__main__":
    main()
