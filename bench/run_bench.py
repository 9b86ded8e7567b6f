"""NanWatch cost benchmark: every tool, every model, one sitting, interleaved.

    python bench/run_bench.py            # full run (~20 min on 2 cores)
    python bench/run_bench.py --quick    # smoke run (< 3 min), writes nothing to RESULTS.md
    python bench/run_bench.py --only tools,memory   # a subset of the sections

Sections:

* ``tools``: plain ``fit`` vs TerminateOnNaN, NanWatch (defaults, and with
  ``pre_step_weights="every_step"``), ``enable_check_numerics``, Debugger V2
  CURT_HEALTH and FULL_HEALTH on three models (MLP 12x256 batch 64, a 6-conv
  net on 32x32 images batch 128, LSTM + self-attention batch 64).
* ``scaling``: NanWatch vs plain on MLPs of depth 10/50/200 (width 64, batch
  128) and on the 12x256 MLP at batch 32/128/512.
* ``memory``: a long NanWatch run (MLP 12x256): RSS and gc-object growth per
  step, device-to-host transfers per step, event-file bytes per step.
* ``plugin``: ``bench/plugin_scale.py`` (100,000-step, 200-layer synthetic
  run served by a real TensorBoard, both data providers).

Every (model, tool) runs in its own worker process (``bench/worker.py``) so
that process-global tools (check_numerics, Debugger V2) cannot leak into other
runs. For one model all workers are started, warmed up (tracing excluded) and
then driven round by round, alternating the order (A B C ... C B A ...), so
that the drift of a shared machine hits every tool alike. The ratio of a tool
is the median, over rounds, of (its median step time in the round / plain's
median step time in the same round).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "worker.py")
sys.path.insert(0, HERE)
import worker  # noqa: E402 (bench/ is not a package; its sibling module)

ALL_TOOLS = list(worker.TOOLS)  # the worker defines what each tool means
TOOL_LABELS = {
    "plain": "plain fit",
    "terminate_on_nan": "TerminateOnNaN",
    "nanwatch": "**NanWatch (defaults)**",
    "nanwatch_every_step": "NanWatch, pre_step_weights=every_step",
    "nanwatch+before": "NanWatch before the performance fixes (--compare-before)",
    "check_numerics": "tf.debugging.enable_check_numerics",
    "dbg_curt_health": "Debugger V2 CURT_HEALTH",
    "dbg_full_health": "Debugger V2 FULL_HEALTH",
}
MODEL_LABELS = {
    "mlp": "MLP 12x256, batch 64",
    "conv": "6-conv net, 32x32x3, batch 128",
    "lstm": "LSTM(64) + MHA(4x16), seq 32, batch 64",
}

BEGIN = "<!-- BEGIN GENERATED (bench/run_bench.py) -->"
END = "<!-- END GENERATED -->"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Worker:
    def __init__(
        self,
        model: str,
        tool: str,
        steps: int,
        rounds: int,
        warmup: int,
        logdir: str,
        extra: list[str] | None = None,
    ) -> None:
        self.model, self.tool = model, tool
        self.rounds: list[dict] = []
        self.done: dict | None = None
        self.error: str | None = None
        safe = model.replace(":", "_")
        self.stderr_path = os.path.join(logdir, f"{safe}-{tool}.stderr")
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(
            [
                sys.executable,
                WORKER,
                "--model",
                model,
                "--tool",
                tool,
                "--steps",
                str(steps),
                "--rounds",
                str(rounds),
                "--warmup",
                str(warmup),
            ]
            + (extra or []),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(self.stderr_path, "w"),
            text=True,
            cwd=ROOT,
            env=env,
        )

    def read_event(self, wanted: tuple[str, ...]) -> dict | None:
        for line in self.proc.stdout:
            if not line.startswith("BENCH "):
                continue
            event = json.loads(line[6:])
            if event["event"] == "done":
                self.done = event
                if event.get("error"):
                    self.error = event["error"]
                if "done" not in wanted:
                    return None
            if event["event"] in wanted:
                return event
        if self.error is None:
            self.error = f"worker exited (rc={self.proc.wait()}); see {self.stderr_path}"
        return None

    @property
    def alive(self) -> bool:
        return self.error is None and self.done is None

    def send(self, command: str) -> None:
        try:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.error = self.error or "worker closed its input"

    def finish(self) -> None:
        if self.alive:
            self.send("finish")
            self.read_event(("done",))
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        self.proc.wait()


def run_group(
    model: str, tools: list[str], steps: int, rounds: int, warmup: int, logdir: str
) -> dict:
    """Starts one worker per tool, interleaves ``rounds`` rounds, returns results."""
    log(f"{model}: starting {len(tools)} workers ({', '.join(tools)})")
    workers = [Worker(model, t, steps, rounds, warmup, logdir) for t in tools]
    for w in workers:
        if w.read_event(("ready",)) is None:
            log(f"{model}/{w.tool}: failed before timing: {w.error}")
    for r in range(rounds):
        order = workers if r % 2 == 0 else list(reversed(workers))
        for w in order:
            if not w.alive:
                continue
            w.send("go")
            event = w.read_event(("round",))
            if event is not None:
                w.rounds.append(event)
            elif w.error:
                log(f"{model}/{w.tool}: failed in round {r + 1}: {w.error}")
        log(
            f"{model}: round {r + 1}/{rounds}: "
            + ", ".join(
                f"{w.tool}={w.rounds[-1]['median_ms']:.2f}ms"
                for w in workers
                if w.rounds and len(w.rounds) == r + 1
            )
        )
    for w in workers:
        w.finish()
    return summarize(model, workers)


def summarize(model: str, workers: list[Worker]) -> dict:
    base = next((w for w in workers if w.tool == "plain"), None)
    rows = []
    for w in workers:
        times = [t for ev in w.rounds for t in ev["times_ms"]]
        row = {
            "tool": w.tool,
            "median_ms": statistics.median(times) if times else None,
            "round_medians_ms": [ev["median_ms"] for ev in w.rounds],
            "steps_timed": len(times),
            "times_ms": times,
            "error": w.error,
        }
        if base is not None and base.rounds and w.rounds:
            n = min(len(base.rounds), len(w.rounds))
            ratios = [w.rounds[i]["median_ms"] / base.rounds[i]["median_ms"] for i in range(n)]
            row["ratio"] = statistics.median(ratios)
            row["round_ratios"] = ratios
        done = w.done or {}
        for key in (
            "event_bytes",
            "steps_recorded",
            "schema_size",
            "schema_entries",
            "rss_kib",
            "layers",
            "params",
            "batch",
        ):
            if key in done:
                row[key] = done[key]
        if done.get("event_bytes") and done.get("steps_recorded"):
            row["event_bytes_per_step"] = done["event_bytes"] / done["steps_recorded"]
        rows.append(row)
    group = {"model": model, "rows": rows, "load": loadavg()}
    add_low_quantile_ratios(group)
    return group


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def add_low_quantile_ratios(group: dict) -> None:
    """Best-round ratio: the tool's fastest round median over plain's.

    On a shared machine step times are bimodal (our process alone on the
    cores, or sharing them with another job for a whole round); the fastest
    round estimates the uncontended cost, as ``timeit`` takes the minimum.
    """
    for row in group["rows"]:
        medians = row.get("round_medians_ms") or []
        row["best_ms"] = min(medians) if medians else None
    rows = {r["tool"]: r for r in group["rows"]}
    base = rows.get("plain", {}).get("best_ms")
    for row in group["rows"]:
        if base and row.get("best_ms"):
            row["best_ratio"] = row["best_ms"] / base


def run_memory(steps: int, logdir: str) -> list[dict]:
    """Long MLP runs (plain and NanWatch) with RSS / gc / transfer accounting."""
    out = []
    for tool in ("plain", "nanwatch"):
        log(f"memory: {tool}, {steps} steps of the MLP")
        w = Worker("mlp", tool, steps, 1, 5, logdir, ["--no-wait", "--memcheck"])
        w.read_event(("done",))
        w.proc.wait()
        out.append({"tool": tool, "error": w.error, **(w.done or {})})
    return out


def run_plugin(quick: bool, logdir: str) -> dict:
    log("plugin: synthetic run + real TensorBoard")
    out_json = os.path.join(logdir, "plugin.json")
    cmd = [sys.executable, os.path.join(HERE, "plugin_scale.py"), "--json", out_json]
    if quick:
        cmd += ["--steps", "10000", "--layers", "50", "--requests", "3", "--no-baseline"]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    rc = subprocess.call(cmd, cwd=ROOT, env=env)
    if rc != 0 or not os.path.exists(out_json):
        return {"error": f"plugin_scale.py exited with {rc}"}
    with open(out_json) as f:
        return json.load(f)


# -- reporting -------------------------------------------------------------------


def machine() -> dict:
    info = {"python": platform.python_version(), "cores": os.cpu_count()}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                info["cpu"] = line.split(":", 1)[1].strip()
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            info["mem_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    try:
        import importlib.metadata as md

        for dist in ("tensorflow", "tensorflow-cpu", "keras", "tensorboard", "numpy"):
            try:
                info[dist] = md.version(dist)
            except md.PackageNotFoundError:
                pass
    except ImportError:
        pass
    return info


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def fmt(value, spec: str = ".2f", none: str = "n/a") -> str:
    return none if value is None else format(value, spec)


def render(results: dict) -> str:
    m = results["machine"]
    lines = [
        f"Generated {results['date']} by `python bench/run_bench.py"
        f"{' --quick' if results['quick'] else ''}` in {results['wall_min']:.1f} min.",
        "",
        f"Machine: {m.get('cpu', '?')}, {m.get('cores')} cores, {m.get('mem_gib')} GiB; "
        f"Python {m.get('python')}, TensorFlow {m.get('tensorflow', m.get('tensorflow-cpu', '?'))}, "
        f"Keras {m.get('keras')}, TensorBoard {m.get('tensorboard')}, NumPy {m.get('numpy')}; "
        "CPU only, `jit_compile=False`.",
        "",
        f"Load average (1/5/15 min) at start: {results['load_start']}; at end: "
        f"{results['load_end']}. The machine was shared with other jobs during the run "
        "(see the load caveat below): absolute ms/step are noisy, ratios from interleaved "
        "rounds much less so.",
        "",
    ]
    if results.get("tools"):
        lines += [
            "### Step-time cost of each tool",
            "",
            "Median ms/step over all timed steps; ratio = median over rounds of "
            "(tool's round median / plain fit's round median in the same cycle). "
            "Rounds interleaved A B C ... C B A.",
            "",
        ]
        for group in results["tools"]:
            lines += [
                f"**{MODEL_LABELS.get(group['model'], group['model'])}** "
                f"({group.get('steps')} steps x {group.get('rounds')} rounds per tool)",
                "",
                "| tool | median ms/step | ratio vs plain (median of rounds) | "
                "best round ms/step | best-round ratio | per-round ratios |",
                "|---|---:|---:|---:|---:|---|",
            ]
            for row in group["rows"]:
                if row.get("error") and not row.get("median_ms"):
                    lines.append(
                        f"| {TOOL_LABELS.get(row['tool'], row['tool'])} | failed | "
                        f"| {row['error'][:160]} |"
                    )
                    continue
                ratios = " ".join(f"{r:.2f}" for r in row.get("round_ratios", []))
                lines.append(
                    f"| {TOOL_LABELS.get(row['tool'], row['tool'])} | {fmt(row['median_ms'])} | "
                    f"{fmt(row.get('ratio'))} | {fmt(row.get('best_ms'))} | "
                    f"{fmt(row.get('best_ratio'))} | {ratios} |"
                )
            nw = next((r for r in group["rows"] if r["tool"] == "nanwatch"), None)
            if nw and nw.get("schema_entries"):
                lines += [
                    "",
                    f"NanWatch watched {nw['schema_entries']} tensors "
                    f"({nw['schema_size']} floats per step, one transfer); event file "
                    f"{nw.get('event_bytes_per_step', 0):.1f} bytes/step over "
                    f"{nw.get('steps_recorded')} steps (includes fixed costs: run "
                    "summary, step-0 snapshot).",
                ]
            lines.append("")
    if results.get("scaling"):
        lines += [
            "### How NanWatch's cost grows (ratio vs plain fit, defaults)",
            "",
            "| model | batch | watched tensors | plain ms/step | NanWatch ms/step | ratio (median) | "
            "ratio (best round) | every_step ratio (median) | every_step ratio (best round) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for group in results["scaling"]:
            rows = {r["tool"]: r for r in group["rows"]}
            plain, nw = rows.get("plain", {}), rows.get("nanwatch", {})
            every = rows.get("nanwatch_every_step", {})
            spec = group["model"]
            if spec.startswith("mlpdeep:"):
                _, d, wdt, b = spec.split(":")
                name = f"MLP {d}x{wdt}"
            else:
                name, b = spec, "?"
            lines.append(
                f"| {name} | {b} | {nw.get('schema_entries', 'n/a')} | {fmt(plain.get('median_ms'))} | "
                f"{fmt(nw.get('median_ms'))} | {fmt(nw.get('ratio'))} | {fmt(nw.get('best_ratio'))} | "
                f"{fmt(every.get('ratio'))} | {fmt(every.get('best_ratio'))} |"
            )
        lines.append("")
    if results.get("memory"):
        lines += [
            "### Memory, transfers and disk over a long run (MLP 12x256, batch 64)",
            "",
            "| tool | steps | RSS growth bytes/step | gc objects growth/step | "
            "device-to-host reads/step | event-file bytes/step |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for row in results["memory"]:
            mc = row.get("memcheck") or {}
            eb = row.get("event_bytes")
            per = eb / row["steps_recorded"] if eb and row.get("steps_recorded") else None
            lines.append(
                f"| {TOOL_LABELS.get(row['tool'], row['tool'])} | {mc.get('steps', 'n/a')} | "
                f"{fmt(mc.get('rss_growth_bytes_per_step'), '.0f')} | "
                f"{fmt(mc.get('gc_objects_growth_per_step'), '.3f')} | "
                f"{fmt(mc.get('transfers_per_step'), '.2f')} | {fmt(per, '.1f', '-')} |"
            )
        lines += [
            "",
            "(device-to-host reads counted as `EagerTensor._numpy` calls; plain fit's "
            "own read is Keras' log conversion. NanWatch's own share is the difference.)",
            "",
        ]
    plugin = results.get("plugin")
    if plugin:
        lines += ["### Plugin at scale", ""]
        if plugin.get("error"):
            lines += [f"failed: {plugin['error']}", ""]
        else:
            lines += plugin_lines(plugin)
    return "\n".join(lines)


def plugin_lines(p: dict) -> list[str]:
    lines = [
        f"Synthetic run: {p['steps']} steps, {p['layers']} layers, incident at step "
        f"{p.get('incident_step')}; generated in {p['generate_s']:.1f} s; "
        f"{p['event_bytes'] / 2**20:.1f} MiB of event files.",
        "",
        "| data provider | load until runs route lists it (s) | timeline median ms | "
        "timeline max ms | incident median ms | incident max ms | TensorBoard RSS MiB "
        "(empty logdir) | data server RSS MiB (empty logdir) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in p["servers"]:
        if s.get("error"):
            lines.append(f"| {s['mode']} | failed: {s['error'][:120]} | | | | | | |")
            continue
        lines.append(
            f"| {s['mode']} | {fmt(s.get('load_s'), '.1f')} | {fmt(s.get('timeline_median_ms'), '.0f')} | "
            f"{fmt(s.get('timeline_max_ms'), '.0f')} | {fmt(s.get('incident_median_ms'), '.0f')} | "
            f"{fmt(s.get('incident_max_ms'), '.0f')} | {fmt(s.get('tb_rss_mib'), '.0f')} "
            f"({fmt(s.get('empty_tb_rss_mib'), '.0f')}) | "
            f"{fmt(s.get('server_rss_mib'), '.0f', '-')} ({fmt(s.get('empty_server_rss_mib'), '.0f', '-')}) |"
        )
    lines.append("")
    for s in p["servers"]:
        extra = s.get("notes")
        if extra:
            lines.append(f"- {s['mode']}: {extra}")
    browser = p.get("browser")
    if browser:
        lines += ["", "Browser (headless Chromium via Playwright, load_fast=false server):", ""]
        if browser.get("skipped"):
            lines.append(f"skipped: {browser['skipped']}")
        else:
            for key, value in browser.items():
                lines.append(f"- {key}: {value}")
    lines.append("")
    return lines


def write_results_md(text: str) -> None:
    path = os.path.join(HERE, "RESULTS.md")
    if os.path.exists(path):
        with open(path) as f:
            current = f.read()
    else:
        current = "# NanWatch benchmark results\n\n" + BEGIN + "\n" + END + "\n"
    if BEGIN in current and END in current:
        head, rest = current.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        current = head + BEGIN + "\n" + text + "\n" + END + tail
    else:
        current += "\n" + BEGIN + "\n" + text + "\n" + END + "\n"
    with open(path, "w") as f:
        f.write(current)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run, a few steps")
    parser.add_argument(
        "--only",
        default="tools,scaling,memory,plugin",
        help="comma-separated sections (tools, scaling, memory, plugin)",
    )
    parser.add_argument("--models", default="mlp,conv,lstm")
    parser.add_argument("--tools", default=",".join(ALL_TOOLS))
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steps per round (all models)"
    )
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    parser.add_argument(
        "--compare-before",
        default=None,
        metavar="DIR",
        help="also time NanWatch from another copy of the package (DIR holds "
        "a tb_nanwatch/ directory), e.g. the tree before a performance change",
    )
    parser.add_argument(
        "--render",
        default=None,
        metavar="RESULTS_JSON",
        help="only re-render RESULTS.md from a results JSON file",
    )
    args = parser.parse_args()
    if args.render:
        with open(args.render) as f:
            results = json.load(f)
        for group in results.get("tools", []) + results.get("scaling", []):
            add_low_quantile_ratios(group)
        text = render(results)
        print(text)
        if not args.no_write:
            write_results_md(text)
        return
    sections = set(args.only.split(","))
    quick = args.quick
    logdir = tempfile.mkdtemp(prefix="nwbench-logs-")
    log(f"worker logs in {logdir}")
    started = time.time()
    results: dict = {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "quick": quick,
        "machine": machine(),
        "load_start": loadavg(),
    }
    rounds = args.rounds or (2 if quick else 7)
    # timed steps per round: about 0.3-1 s of plain fit each on 2 cores
    steps = {"mlp": 10, "conv": 4, "lstm": 6} if quick else {"mlp": 40, "conv": 8, "lstm": 16}
    if args.steps:
        steps = dict.fromkeys(steps, args.steps)
    tools = args.tools.split(",")
    if args.compare_before:
        os.environ["NWBENCH_BEFORE_PATH"] = os.path.abspath(args.compare_before)
        tools.insert(
            tools.index("nanwatch") if "nanwatch" in tools else len(tools), "nanwatch+before"
        )
    if "tools" in sections:
        results["tools"] = []
        models = args.models.split(",")
        if quick and args.models == "mlp,conv,lstm":
            models = ["mlp", "lstm"]  # the conv net's steps are too slow for a smoke run
        for model in models:
            group_tools = tools
            if quick and model != "mlp":
                group_tools = [t for t in tools if t in ("plain", "nanwatch")]
            group = run_group(model, group_tools, steps[model], rounds, 5, logdir)
            group.update(steps=steps[model], rounds=rounds)
            results["tools"].append(group)
            print_group(group)
    if "scaling" in sections:
        results["scaling"] = []
        configs = [f"mlpdeep:{d}:64:128" for d in ((10,) if quick else (10, 50, 200))]
        configs += [f"mlpdeep:12:256:{b}" for b in (() if quick else (32, 128, 512))]
        for spec in configs:
            depth, batch = int(spec.split(":")[1]), int(spec.split(":")[3])
            n = max(4, min(40, int(40 * 128 / max(batch, 1) * 12 / max(depth, 12))))
            n = 5 if quick else n
            sc_tools = ["plain", "nanwatch"] + ([] if quick else ["nanwatch_every_step"])
            group = run_group(spec, sc_tools, n, 2 if quick else 5, 5, logdir)
            group.update(steps=n, rounds=2 if quick else 5)
            results["scaling"].append(group)
            print_group(group)
    if "memory" in sections:
        results["memory"] = run_memory(200 if quick else 2000, logdir)
        for row in results["memory"]:
            print(
                json.dumps(
                    {
                        k: row.get(k)
                        for k in ("tool", "memcheck", "event_bytes", "steps_recorded", "error")
                    }
                )
            )
    if "plugin" in sections:
        results["plugin"] = run_plugin(quick, logdir)
    results["load_end"] = loadavg()
    results["wall_min"] = (time.time() - started) / 60
    text = render(results)
    print(text)
    # Only a full run that updates RESULTS.md replaces bench/results.json
    # (the raw data behind it); any other run keeps its JSON in the log dir.
    if not quick and not args.no_write:
        json_path = os.path.join(HERE, "results.json")
    else:
        json_path = os.path.join(logdir, "results.json")
    with open(json_path, "w") as f:
        json.dump(results, f, indent=1)
    log(f"raw results in {json_path}")
    if not quick and not args.no_write:
        write_results_md(text)
        log("wrote bench/RESULTS.md")
    log(f"total {results['wall_min']:.1f} min")


def print_group(group: dict) -> None:
    print(f"\n== {group['model']}")
    for row in group["rows"]:
        print(
            f"  {row['tool']:22s} median {fmt(row.get('median_ms')):>9s} ms/step  "
            f"ratio {fmt(row.get('ratio')):>6s}  {row.get('error') or ''}",
            flush=True,
        )


if __name__ == "__main__":
    main()
