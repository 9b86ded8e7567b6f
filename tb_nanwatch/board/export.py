"""``tb-nanwatch export``: one self-contained HTML file of a log dir's runs.

The file holds the plugin's own frontend bundle and stylesheet (as ``data:``
URLs, so no byte of them can end the surrounding ``<script>``) and the answers
of the plugin's routes for every run, produced by the real plugin over
TensorBoard's loader. The frontend reads them from
``window.__NANWATCH_DATA__`` instead of fetching (see ``frontend/src/api.js``).
Nothing is fetched from anywhere: a teammate opens the file by double-click,
offline.

Embedded once: the ``runs`` list and the ``vocabulary`` (labels, text keys,
non-finite words). Embedded per run: the ``incident`` answer (card, heatmap,
hints), the ``timeline`` at exact resolution up to ``max_points`` steps (else
reduced to ``max_points`` buckets, and zooming shows that reduced series), and
the per-layer ``step`` tables of up to ``max_step_tables`` recorded steps (the
flight window first, then snapshots nearest the incident).
"""

from __future__ import annotations

import base64
import html
import json
import os
from urllib.parse import urlencode

from tb_nanwatch import __version__
from tb_nanwatch.board import plugin
from tb_nanwatch.evidence import metadata

DEFAULT_MAX_POINTS = plugin.MAX_MAX_POINTS  # the most the timeline route answers
DEFAULT_MAX_STEP_TABLES = 64


class ExportError(RuntimeError):
    """The log dir could not be exported."""


def _client(data_provider, logdir: str):
    from tensorboard.backend import application
    from tensorboard.plugins import base_plugin
    from werkzeug import test as werkzeug_test

    context = base_plugin.TBContext(data_provider=data_provider, logdir=logdir, sampling_hints={})
    app = application.TensorBoardWSGI([plugin.NanWatchPlugin(context)], data_provider=data_provider)
    return werkzeug_test.Client(app)


def _get(client, route: str, params: dict) -> tuple[int, object]:
    url = f"/data/plugin/{metadata.PLUGIN_NAME}/{route}"
    if params:
        url += "?" + urlencode(params)
    response = client.get(url)
    return response.status_code, json.loads(response.get_data(as_text=True))


def _pick_steps(recorded: list[int], incident_step: int | None, limit: int) -> list[int]:
    """At most ``limit`` recorded steps, those nearest the incident first."""
    if len(recorded) <= limit:
        return list(recorded)
    center = incident_step if incident_step is not None else recorded[-1]
    return sorted(sorted(recorded, key=lambda s: (abs(s - center), s))[:limit])


def collect(
    data_provider,
    logdir: str,
    *,
    runs: list[str] | None = None,
    max_points: int = DEFAULT_MAX_POINTS,
    max_step_tables: int = DEFAULT_MAX_STEP_TABLES,
) -> dict:
    """The route answers to embed: ``{"routes": [{route, params, body}], ...}``."""
    client = _client(data_provider, logdir)
    status, listing = _get(client, "runs", {})
    if status != 200:
        raise ExportError(f"the runs of {logdir!r} could not be read: {listing}")
    entries = listing["runs"]
    if runs is not None:
        unknown = sorted(set(runs) - {e["run"] for e in entries})
        if unknown:
            raise ExportError(f"no NaN Watch run named {', '.join(map(repr, unknown))}")
        entries = [e for e in entries if e["run"] in runs]
    status, words = _get(client, "vocabulary", {})
    if status != 200:
        raise ExportError(f"the plugin's vocabulary could not be read: {words}")
    routes = [
        {"route": "runs", "params": {}, "body": {"runs": entries}},
        {"route": "vocabulary", "params": {}, "body": words},
    ]
    for entry in entries:
        run = entry["run"]
        total = max(int(entry.get("steps") or 0), 1)
        points = max(1, min(max_points, total, plugin.MAX_MAX_POINTS))  # the route refuses more
        status, timeline = _get(client, "timeline", {"run": run, "max_points": points})
        if status == 200:
            # Answers the frontend's first request and, by run, its zooms.
            routes.append({"route": "timeline", "params": {"run": run}, "body": timeline})
        status, incident = _get(client, "incident", {"run": run})
        if status == 200:
            routes.append({"route": "incident", "params": {"run": run}, "body": incident})
        recorded = timeline.get("recorded_steps", []) if isinstance(timeline, dict) else []
        first = entry.get("first_nonfinite") or {}
        for step in _pick_steps(recorded, first.get("step"), max_step_tables):
            status, table = _get(client, "step", {"run": run, "step": step})
            if status == 200:
                routes.append(
                    {"route": "step", "params": {"run": run, "step": step}, "body": table}
                )
    return {"version": __version__, "routes": routes}


def _script_json(value: object) -> str:
    """JSON that is safe inside an HTML ``<script>`` element."""
    text = json.dumps(value, allow_nan=False, ensure_ascii=True, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _data_url(content: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(content).decode('ascii')}"


def _static(name: str) -> bytes:
    path = os.path.join(plugin.STATIC_DIR, name)
    try:
        with open(path, "rb") as infile:
            return infile.read()
    except OSError as error:
        raise ExportError(f"the frontend bundle {name} is not installed: {error}") from None


def render_html(data: dict, title: str) -> str:
    """The standalone page: embedded data, stylesheet and frontend module."""
    script = _data_url(_static("index.js"), "text/javascript")
    style = _data_url(_static("style.css"), "text/css")
    # The <link data-nanwatch-style> stands for the stylesheet the frontend
    # would otherwise load from the relative URL "style.css".
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; script-src 'unsafe-inline' data:; style-src 'unsafe-inline' data:; img-src data:; font-src data:">
<meta name="generator" content="tb-nanwatch {html.escape(__version__)} export">
<title>{html.escape(title)}</title>
<link rel="stylesheet" data-nanwatch-style href="{style}">
<script>window.__NANWATCH_DATA__ = {_script_json(data)};</script>
</head>
<body>
<script type="module">
import("{script}").then((m) => m.render()).catch((err) => {{
  document.body.textContent = "NaN Watch export could not start: " + err;
}});
</script>
</body>
</html>
"""


def export(
    logdir: str,
    output: str,
    *,
    runs: list[str] | None = None,
    max_points: int = DEFAULT_MAX_POINTS,
    max_step_tables: int = DEFAULT_MAX_STEP_TABLES,
    data_provider=None,
) -> dict:
    """Writes the HTML file; returns a summary ``{"runs": [...], "bytes": n}``."""
    if data_provider is None:
        from tb_nanwatch.board import report

        data_provider = report.load_provider(logdir)
    data = collect(
        data_provider, logdir, runs=runs, max_points=max_points, max_step_tables=max_step_tables
    )
    names = [e["run"] for e in data["routes"][0]["body"]["runs"]]
    title = "NaN Watch: " + (", ".join(names[:3]) + (" …" if len(names) > 3 else "") or "no runs")
    page = render_html(data, title)
    with open(output, "w", encoding="utf-8") as outfile:
        outfile.write(page)
    return {"runs": names, "bytes": len(page.encode("utf-8"))}
