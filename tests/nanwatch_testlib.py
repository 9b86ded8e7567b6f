"""Helpers for the plugin, reader and report tests: runs, providers, clients.

Runs are written by :func:`tb_nanwatch.record.writing.synthetic.write_synthetic_run` (the real
journal). Providers are built with TensorBoard's DEFAULT sampling (10 tensors
per tag on the Python loader, 100 on the Rust data server).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
from tensorboard import context
from tensorboard.backend import application
from tensorboard.plugins import base_plugin
from werkzeug import test as werkzeug_test

from tb_nanwatch.board.plugin import NanWatchPlugin
from tb_nanwatch.evidence import metadata
from tb_nanwatch.evidence.options import WatchOptions
from tb_nanwatch.evidence.schema import Schema
from tb_nanwatch.record.writing.journal import RunJournal
from tb_nanwatch.record.writing.synthetic import build_schema, write_synthetic_run

# The trials' budget in tests that judge a trial's outcome: a slow or paused CI
# machine must not turn a "fixed" into an over-budget "not_tried".
TRIAL_BUDGET_S = 3600.0
BIG_STEPS = 5000
BIG_INCIDENT = 4321
BIG_LAYER = 3
HEALTHY_STEPS = 300
XSS_RUN = "<img src=x onerror=alert(1)>"

# Debian's Chromium, headless; the networking flags keep it off this machine's
# closed network (Playwright must not download a browser of its own).
CHROMIUM = os.environ.get("NANWATCH_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

CTX = context.RequestContext()


def write_standard_runs(logdir: str) -> dict[str, dict]:
    """big (incident at BIG_INCIDENT), healthy, and a run with a hostile name."""
    return {
        "big": write_synthetic_run(
            os.path.join(logdir, "big"),
            BIG_STEPS,
            incident_step=BIG_INCIDENT,
            incident_layer=BIG_LAYER,
        ),
        "healthy": write_synthetic_run(os.path.join(logdir, "healthy"), HEALTHY_STEPS),
        XSS_RUN: write_synthetic_run(os.path.join(logdir, XSS_RUN), 40, num_layers=3),
    }


def write_fast_series_run(log_dir: str, steps: int, num_layers: int = 4) -> dict:
    """A long healthy run written chunk by chunk (the journal's own format),
    much faster than recording step by step."""
    schema = build_schema(num_layers)
    journal = RunJournal(log_dir, schema, {"model": "fast"}, WatchOptions(flush_secs=1e9))
    width = len(journal.series_columns)
    rng = np.random.default_rng(0)
    for start in range(0, steps, metadata.CHUNK_STEPS):
        rows = min(metadata.CHUNK_STEPS, steps - start)
        chunk = rng.random((rows, width)).astype(np.float32)
        chunk[:, journal.series_columns.index("nonfinite")] = 0
        journal.writer.write_array(
            metadata.series_tag(start // metadata.CHUNK_STEPS),
            metadata.KIND_SERIES,
            start,
            chunk,
        )
    journal.steps = steps
    journal.close()
    return journal.summary()


def base_vector(schema, step: int) -> np.ndarray:
    """A healthy stats vector: loss = 1 + step / 1000, unit stats elsewhere."""
    vector = np.zeros(schema.size, np.float32)
    for entry in schema.entries:
        if entry.kind in ("activation", "input", "logits"):
            vector[entry.index("min")], vector[entry.index("max")] = -1.0, 1.0
        elif entry.kind in ("grad_out", "grad_var", "grad_in"):
            vector[entry.index("norm")] = 0.5
        elif entry.kind == "loss":
            vector[entry.index("value")] = 0.5
    header = {"loss": 1.0 + step / 1000, "grad_norm": 1.0, "lr": 1e-3, "iterations": step}
    for field, value in header.items():  # loss_scale and skipped stay 0
        vector[schema.header_index(field)] = value
    return vector


def write_vector_run(
    log_dir: str,
    steps: int,
    edit=None,
    num_layers: int = 3,
    flush_every: int = 0,
    **journal_kwargs,
) -> dict:
    """Records ``steps`` steps through the real journal; ``edit(step, vector,
    schema)`` may change each vector. Stops at the first incident."""
    schema = build_schema(num_layers)
    journal = RunJournal(
        log_dir, schema, {"model": "vectors"}, WatchOptions(flush_secs=1e9, **journal_kwargs)
    )
    status = "finished"
    for step in range(steps):
        vector = base_vector(schema, step)
        if edit is not None:
            edit(step, vector, schema)
        if journal.record(step, step // 100, step % 100, vector) is not None:
            status = "stopped"
            break
        if flush_every and step % flush_every == flush_every - 1:
            journal.flush()
    journal.close(status)
    return journal.summary()


def multiplexer_provider(logdir: str):
    """TensorBoard's Python loader with its default sampling."""
    from tensorboard.backend.event_processing import (
        data_provider,
        plugin_event_multiplexer,
    )

    multiplexer = plugin_event_multiplexer.EventMultiplexer()
    multiplexer.AddRunsFromDirectory(logdir)
    multiplexer.Reload()
    return data_provider.MultiplexerDataProvider(multiplexer, logdir)


def data_server_binary():
    """The Rust data server binary, or None when it is not installed."""
    from tensorboard.data import server_ingester

    try:
        return server_ingester.get_server_binary()
    except server_ingester.NoDataServerError:
        return None


@contextlib.contextmanager
def data_server_provider(logdir: str, expect_runs: int, timeout: float = 30.0):
    """The Rust data server over ``logdir`` (default sampling), once loaded."""
    from tensorboard.data import server_ingester
    from tensorboard.util import grpc_util

    ingester = server_ingester.SubprocessServerDataIngester(
        data_server_binary(),
        logdir,
        reload_interval=0,
        channel_creds_type=grpc_util.ChannelCredsType.LOCAL,
    )
    ingester.start()
    try:
        provider = ingester.data_provider
        deadline = time.monotonic() + timeout
        while True:
            runs = provider.list_tensors(CTX, experiment_id="", plugin_name=metadata.PLUGIN_NAME)
            loaded = [r for r, tags in runs.items() if metadata.TAG_RUN in tags]
            if len(loaded) >= expect_runs or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        yield provider
    finally:
        # The server exits when its stdin closes (--die-after-stdin).
        ingester._stdin_handle.close()


def make_client(provider, logdir: str) -> werkzeug_test.Client:
    """A werkzeug client on TensorBoard's WSGI app holding only our plugin."""
    tb_context = base_plugin.TBContext(data_provider=provider, logdir=logdir, sampling_hints={})
    app = application.TensorBoardWSGI([NanWatchPlugin(tb_context)], data_provider=provider)
    return werkzeug_test.Client(app)


def route_client(logdir) -> werkzeug_test.Client:
    """A test client of the NaN Watch routes over ``logdir``, read by TensorBoard's Python loader."""
    logdir = str(logdir)
    return make_client(multiplexer_provider(logdir), logdir)


def get_json(client: werkzeug_test.Client, url: str, status: int = 200):
    """GETs ``url`` and returns its JSON body, checking status and headers."""
    response = client.get(url)
    assert response.status_code == status, (url, response.status_code, response.data)
    assert response.headers["Content-Type"].startswith("application/json"), url
    assert response.headers.get("X-Content-Type-Options") == "nosniff"
    return strict_json(response.get_data(as_text=True))


def _reject_constant(token: str):
    raise AssertionError(f"non-standard JSON token {token}")


def strict_json(text: str):
    """Parses JSON, refusing NaN/Infinity tokens (browsers refuse them)."""
    return json.loads(text, parse_constant=_reject_constant)


PLUGIN = "/data/plugin/nanwatch"


# -- a real TensorBoard process ---------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http_get(url: str) -> tuple[int, dict, bytes]:
    """(status, headers, body); HTTP errors are answers, not exceptions."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


@contextlib.contextmanager
def tensorboard_process(
    logdir, log_path, ready, *, extra_args=(), path_prefix: str = "", timeout: float = 120.0
):
    """Runs ``tensorboard`` on 127.0.0.1 until ``ready(base_url)`` is true; yields the base URL.

    ``ready`` may raise OSError/ValueError/KeyError while the server warms up.
    """
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "tensorboard.main",
        f"--logdir={logdir}",
        f"--port={port}",
        "--host=127.0.0.1",
        *extra_args,
    ]
    if path_prefix:
        command.append(f"--path_prefix={path_prefix}")
    base = f"http://127.0.0.1:{port}{path_prefix}"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise AssertionError(f"tensorboard exited: {Path(log_path).read_text()[-3000:]}")
            with contextlib.suppress(OSError, ValueError, KeyError):
                if ready(base):
                    break
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"tensorboard was not ready in {timeout} s: {Path(log_path).read_text()[-3000:]}"
                )
            time.sleep(0.5)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def canvas_ink(frame_or_page, selector: str) -> int:
    """Number of non-white pixels of the first canvas matching ``selector``."""
    return frame_or_page.locator(selector).first.evaluate(
        """c => {
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            let n = 0;
            for (let i = 0; i < d.length; i += 4) {
                if (d[i + 3] > 0 && (d[i] < 240 || d[i + 1] < 240 || d[i + 2] < 240)) n++;
            }
            return n;
        }"""
    )


# -- a worker in a fresh process --------------------------------------------

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def worker_env() -> dict[str, str]:
    """A test worker's environment: the repository and tests/ importable,
    TensorFlow's C++ log quiet, no cluster configuration."""
    path = [os.path.dirname(TESTS_DIR), TESTS_DIR, os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("TF_CONFIG", None)
    return env


def logical_cpus(count: int) -> None:
    """Splits the CPU into ``count`` logical devices (a strategy's replicas);
    only before TensorFlow has initialized its devices."""
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * count
    )


def run_worker(args: list[str], result, timeout: float = 400) -> dict:
    """Runs ``python *args`` in a fresh process (:func:`worker_env`), asserts that
    it exited 0 (showing the end of its stderr) and returns the JSON it wrote to
    the file ``result``."""
    done = subprocess.run(
        [sys.executable, *args], env=worker_env(), capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-4000:]
    with open(result) as f:
        return json.load(f)


# -- the built tab served with fixture answers ------------------------------

STATIC = Path(__file__).resolve().parents[1] / "tb_nanwatch" / "board" / "static"
TAB_PAGE = b"""<!doctype html><html><head><meta charset="utf-8"></head><body>
<script type="module">import { render } from "./index.js"; render();</script></body></html>"""


def fixture_timeline(run: str, steps: int, incident, explosion, **columns) -> dict:
    """The ``timeline`` route's answer for a fixture run of ``steps`` steps;
    ``columns`` replace the default series (a falling loss, no non-finite step)."""
    defaults = {
        "loss": [1.0 / (1 + s) for s in range(steps)],
        "grad_norm": [2.0 + s % 3 for s in range(steps)],
        "logit_min": [-2.0 - s / 10 for s in range(steps)],
        "logit_max": [2.0 + s / 10 for s in range(steps)],
        "lr": [0.01] * steps,
        "loss_scale": [None] * steps,
        "skipped": [0] * steps,
        "nonfinite": [0] * steps,
        "iterations": list(range(steps)),
        "epoch": [0] * steps,
        "batch": list(range(steps)),
    }
    return {
        "run": run,
        "start": 0,
        "end": steps,
        "bucket": 1,
        "steps": list(range(steps)),
        "columns": {**defaults, **columns},
        "total_steps": steps,
        "first_nonfinite": incident,
        "explosion": explosion,
        "skipped_ranges": [],
        "recorded_steps": [],
    }


def _fixture_handler(runs: dict[str, dict], vocabulary: dict) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # keep pytest's output clean
            pass

        def _send(self, status: int, body: bytes, mime: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", mime)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, status: int, value) -> None:
            self._send(status, json.dumps(value, allow_nan=False).encode(), "application/json")

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            url = urllib.parse.urlsplit(self.path)
            route = url.path.lstrip("/")
            run = urllib.parse.parse_qs(url.query).get("run", [None])[0]
            if route == "":
                self._send(200, TAB_PAGE, "text/html; charset=utf-8")
            elif route == "favicon.ico":
                self._send(204, b"", "image/x-icon")
            elif route in ("index.js", "style.css"):
                mime = "text/javascript" if route.endswith(".js") else "text/css"
                self._send(200, (STATIC / route).read_bytes(), mime)
            elif route == "vocabulary":
                self._json(200, vocabulary)
            elif route == "runs":
                self._json(200, {"runs": [runs[r]["entry"] for r in sorted(runs)]})
            elif route in ("incident", "timeline") and run in runs:
                self._json(200, runs[run][route])
            else:
                self._json(404, {"error": f"not in the fixture: {self.path}"})

    return Handler


@contextlib.contextmanager
def fixture_tab(runs: dict[str, dict], vocabulary: dict):
    """Serves the built tab (tb_nanwatch/board/static) on 127.0.0.1 with fixture
    answers: ``vocabulary``, the ``runs`` list (each run's ``entry``, by name) and
    each run's ``incident`` and ``timeline``; yields the base URL."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _fixture_handler(runs, vocabulary))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    finally:
        httpd.shutdown()
        httpd.server_close()


def write_named_run(
    run_dir: str,
    layers: list[str],
    *,
    bad_layer: int,
    bad_step: int,
    steps: int,
    model: str,
    tensor_suffix: str = "",
) -> None:
    """A tiny run through the real journal whose layer names are given.

    Layer ``layers[bad_layer]`` has a NaN at ``bad_step``; the run then stops.
    For tests of names that must stay text (markup, path tricks, unicode).
    """
    schema = Schema()
    schema.add("header", "header", None, "step header")
    for name in layers:
        schema.add("forward", "activation", name, f"output of {name}{tensor_suffix}")
    schema.add("loss", "loss", None, "total loss")
    journal = RunJournal(run_dir, schema, {"model": model})
    for step in range(steps):
        vector = np.zeros(schema.size, np.float32)
        if step == bad_step:
            vector[schema.find(kind="activation")[bad_layer].offset] = 1.0
        journal.record(step, 0, step, vector)
    journal.close("stopped")


FRONTEND = Path(__file__).resolve().parent.parent / "frontend"


def run_node_module(script: str):
    """Runs ``script`` (an ES module importing ``./src/...``) in node from
    ``frontend/``; returns the JSON it printed. Skips without node, unless
    ``NANWATCH_REQUIRE_NPM=1`` (CI), where a missing node fails."""
    import pytest

    node = shutil.which("node")
    if node is None:
        if os.environ.get("NANWATCH_REQUIRE_NPM", "") not in ("", "0"):
            pytest.fail("NANWATCH_REQUIRE_NPM=1 but node is not on PATH")
        pytest.skip("node is not on PATH")
    result = subprocess.run(
        [node, "--input-type=module", "-e", script],
        cwd=FRONTEND,
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def report_json(log_dir) -> list[dict]:
    """``tb-nanwatch report LOG_DIR --json``'s runs, from a real CLI process."""
    out = subprocess.run(
        [sys.executable, "-m", "tb_nanwatch.cli", "report", str(log_dir), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)["runs"]


def is_chunk_call(op) -> bool:
    """Whether graph op ``op`` calls an XLA chunk's traced count conditional
    (``XlaStats._chunk_counts``): its inputs are the chunk's triggers, then
    its tensors."""
    return op.type in ("PartitionedCall", "StatefulPartitionedCall") and (
        "chunk" in op.get_attr("f").name
    )


@contextlib.contextmanager
def traced_graphs():
    """The graphs NanWatch's Keras train step is traced in while inside, one
    entry a replica a trace."""
    import tensorflow as tf

    from tb_nanwatch.record.in_step import train_step

    graphs = []
    traced = train_step.recorded_train_step

    def recorded(recorder, data):
        graphs.append(tf.compat.v1.get_default_graph())
        return traced(recorder, data)

    train_step.recorded_train_step = recorded
    try:
        yield graphs
    finally:
        train_step.recorded_train_step = traced


_CALLS = ("PartitionedCall", "StatefulPartitionedCall")
_CONDITIONALS = ("If", "StatelessIf")


def watched_step(watcher, model, optimizer, loss_fn=None, *, jit_compile=False, on_trace=None):
    """A custom loop's train step watched by the StepWatcher ``watcher``, as a
    tf.function: ``loss_fn(y, y_pred)`` (recorded with ``y_pred``), or the mean
    squared error without it; ``on_trace()`` runs at the end of its trace (to
    look at the graph)."""
    import tensorflow as tf

    @tf.function(jit_compile=jit_compile)
    def train_step(x, y):
        with tf.GradientTape() as tape, watcher.forward(tape, x, y) as rec:
            y_pred = model(x, training=True)
            if loss_fn is None:
                loss = rec.loss(tf.reduce_mean((y_pred - y) ** 2))
            else:
                loss = rec.loss(loss_fn(y, y_pred), y_pred=y_pred)
        grads = rec.gradients(tape.gradient(loss, rec.sources(model.trainable_variables)))
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        rec.after_update()
        if on_trace is not None:
            on_trace()
        return loss

    return train_step


def plain_mse_step(model, optimizer, jit_compile: bool = False):
    """The unwatched counterpart of :func:`watched_mse_step`: a tf.function
    train step on the mean squared error that returns the loss."""
    import tensorflow as tf

    @tf.function(jit_compile=jit_compile)
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    return train_step


def watched_mse_step(watcher, model, optimizer, jit_compile: bool = False, on_trace=None):
    """:func:`watched_step` with the mean squared error."""
    return watched_step(watcher, model, optimizer, jit_compile=jit_compile, on_trace=on_trace)


def op_types_run(graph) -> list[str]:
    """The op type of every op of ``graph``, where a call of a function and a
    conditional on a constant (``XlaStats._lowered_once``, which XLA takes
    away) count as the ops of the function they run, recursively."""
    library = {f.signature.name: f for f in graph.as_graph_def().library.function}

    def in_function(name: str) -> list[str]:
        nodes = {n.name: n for n in library[name].node_def}
        types: list[str] = []
        for node in nodes.values():
            pred = nodes.get(node.input[0].split(":")[0]) if node.input else None
            called = _runs(
                node.op,
                lambda attr, node=node: node.attr[attr].func.name,
                pred is not None and pred.op == "Const",
            )
            types += in_function(called) if called in library else [node.op]
        return types

    types: list[str] = []
    for op in graph.get_operations():
        constant = bool(op.inputs) and op.inputs[0].op.type == "Const"
        called = _runs(op.type, lambda attr, op=op: op.get_attr(attr).name, constant)
        types += in_function(called) if called in library else [op.type]
    return types


def _runs(op_type: str, function_attr, first_input_is_constant: bool) -> str | None:
    """The function an op runs in full: a call's, or a constant conditional's branch."""
    if op_type in _CALLS:
        return function_attr("f")
    if op_type in _CONDITIONALS and first_input_is_constant:
        return function_attr("then_branch")
    return None
