"""The NaN Watch TensorBoard plugin: JSON routes and the frontend's static files.

See ``docs/reference/routes.md`` for the route contract. Data is read only through
``context.data_provider`` (works with the Python loader and the Rust data
server). This module must not import TensorFlow: TensorBoard does not catch an
import error in a dynamic plugin.

Every error is answered as JSON ``{"error": ...}``: 400 for a bad or missing
parameter, 404 for an unknown run or unrecorded step, 405 for a method other
than GET. An unexpected failure is logged and answered 400; never 500.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

from tensorboard import errors, plugin_util
from tensorboard.backend import http_util
from tensorboard.plugins import base_plugin
from werkzeug import wrappers

from tb_nanwatch.board import reader, views
from tb_nanwatch.evidence import causes, metadata, vocabulary
from tb_nanwatch.evidence.warning_record import warnings_of

logger = logging.getLogger(__name__)

STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
# Route -> (file in STATIC_DIR, MIME type). Hard-coded: never from the URL,
# never from the ``mimetypes`` registry.
STATIC_FILES = {
    "/index.js": ("index.js", "text/javascript"),
    "/style.css": ("style.css", "text/css"),
}

# Timeline buckets when the request names none (the frontend's timeline.js
# asks for the same number explicitly).
DEFAULT_MAX_POINTS = 4000
# The most a request may ask for: about 1.9 MB of JSON for a one-output model
# (12 columns), so parallel requests cannot grow TensorBoard by gigabytes
# (200000 points were 47 MB each). A longer exact range is read in windows.
MAX_MAX_POINTS = 8000

JSON = "application/json"


class _HttpError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _bad_request(message: str) -> _HttpError:
    return _HttpError(400, message)


def _not_found(message: str) -> _HttpError:
    return _HttpError(404, message)


def _error_response(request: wrappers.Request, code: int, message: str):
    return http_util.Respond(request, {"error": message}, JSON, code=code)


def _json_app(handler: Callable[[wrappers.Request], object]) -> Callable:
    """A WSGI app around ``handler(request)``, which returns a JSON body or a
    response; every failure becomes a JSON error, never a 500."""

    def app(environ, start_response):
        request = wrappers.Request(environ)
        try:
            if request.method not in ("GET", "HEAD"):
                raise _HttpError(405, f"method {request.method} not allowed; use GET")
            response = handler(request)
            if not isinstance(response, wrappers.Response):
                response = http_util.Respond(request, response, JSON)
        except _HttpError as error:
            response = _error_response(request, error.code, error.message)
        except errors.PublicError as error:
            code = error.http_code if 400 <= error.http_code < 500 else 400
            response = _error_response(request, code, str(error))
        except Exception as error:  # a route must never answer 500
            logger.exception("nanwatch: error serving %s", request.path)
            response = _error_response(
                request,
                400,
                f"nanwatch could not answer this request: {type(error).__name__}: "
                f"{error} (details in the TensorBoard log)",
            )
        return response(environ, start_response)

    return app


def _int_param(
    request: wrappers.Request,
    name: str,
    *,
    default: int | None = None,
    required: bool = False,
    low: int = 0,
    high: int = metadata.MAX_STEP,
) -> int | None:
    """A decimal integer query parameter in [low, high], or raises 400."""
    raw = request.args.get(name)
    if raw is None or raw == "":
        if required:
            raise _bad_request(f"missing query parameter {name!r}")
        return default
    if len(raw) > 20 or not raw.isascii() or not raw.isdigit():
        raise _bad_request(f"query parameter {name!r} must be a non-negative integer")
    value = int(raw)
    if not low <= value <= high:
        raise _bad_request(f"query parameter {name!r} must be in [{low}, {high}]")
    return value


def _run_param(request: wrappers.Request) -> str:
    run = request.args.get("run")
    if run is None:
        raise _bad_request("missing query parameter 'run'")
    return run


class NanWatchPlugin(base_plugin.TBPlugin):
    """Shows where NaN/Inf was born: timeline, incident card, per-layer tables."""

    plugin_name = metadata.PLUGIN_NAME

    def __init__(self, context: base_plugin.TBContext) -> None:
        self._data_provider = context.data_provider
        # The local log dir, where the run dirs' remedy trials are read from.
        self._logdir = getattr(context, "logdir", None)
        self._series_cache = reader.SeriesCache()

    def get_plugin_apps(self) -> dict[str, Callable]:
        apps = {
            "/runs": _json_app(self._serve_runs),
            "/timeline": _json_app(self._serve_timeline),
            "/incident": _json_app(self._serve_incident),
            "/step": _json_app(self._serve_step),
            "/vocabulary": _json_app(self._serve_vocabulary),
        }
        for route in STATIC_FILES:
            apps[route] = _json_app(functools.partial(self._serve_static, route))
        return apps

    def is_active(self) -> bool:
        return False  # `data_plugin_names` vs `list_plugins` decides

    def data_plugin_names(self) -> tuple[str, ...]:
        return (metadata.PLUGIN_NAME,)

    def frontend_metadata(self) -> base_plugin.FrontendMetadata:
        return base_plugin.FrontendMetadata(es_module_path="/index.js", tab_name="NaN Watch")

    # -- routes: each parses and validates its request, then calls its _impl --

    def _serve_runs(self, request: wrappers.Request) -> dict:
        return self.runs_impl(*_scope(request))

    def _serve_timeline(self, request: wrappers.Request) -> dict:
        run = _run_param(request)
        start = _int_param(request, "start")
        end = _int_param(request, "end")
        max_points = _int_param(
            request, "max_points", default=DEFAULT_MAX_POINTS, low=1, high=MAX_MAX_POINTS
        )
        if start is not None and end is not None and end <= start:
            raise _bad_request("'end' must be greater than 'start'")
        return self.timeline_impl(*_scope(request), run, (start, end), max_points)

    def _serve_incident(self, request: wrappers.Request) -> dict:
        return self.incident_impl(*_scope(request), _run_param(request))

    def _serve_step(self, request: wrappers.Request) -> dict:
        run = _run_param(request)
        step = _int_param(request, "step", required=True)
        return self.step_impl(*_scope(request), run, step)

    def _serve_vocabulary(self, request: wrappers.Request) -> dict:
        return vocabulary.vocabulary()

    def _serve_static(self, route: str, request: wrappers.Request):
        filename, mime = STATIC_FILES[route]
        try:
            with open(os.path.join(STATIC_DIR, filename), "rb") as infile:
                content = infile.read()
        except OSError:
            raise _not_found(f"static file {filename} is not installed") from None
        return http_util.Respond(request, content, mime)

    # -- implementations: plain values in, a JSON body out ----------------------

    def runs_impl(self, ctx, experiment: str) -> dict:
        """The ``runs`` route."""
        if self._data_provider is None:
            return {"runs": []}
        source = self._source(ctx, experiment)
        runs = source.runs()
        entries = (self._run_entry(source, runs[name]) for name in sorted(runs))
        return {"runs": [entry for entry in entries if entry is not None]}

    def _run_entry(self, source: reader.Source, run: reader.Run) -> dict | None:
        """One run of the ``runs`` route; None (one warning) for a run that
        cannot be listed: one bad run never hides the others."""
        try:
            return views.run_entry(run, self._cause(source, run))
        except Exception as error:  # noqa: BLE001
            logger.warning(
                "nanwatch: run %r left out of the list: %s: %s",
                run.name,
                type(error).__name__,
                error,
            )
            return None

    def timeline_impl(
        self,
        ctx,
        experiment: str,
        run_name: str,
        step_range: tuple[int | None, int | None],
        max_points: int,
    ) -> dict:
        """The ``timeline`` route over steps ``[start, end)`` (None: the run's)."""
        source = self._source(ctx, experiment)
        run = self._run(source, run_name)
        series = source.series(run, self._series_cache)
        if series is None:
            raise _not_found(f"the series of run {run.name!r} could not be read")
        flight = source.flight(run)
        recorded = set(run.listing.snapshot_steps())
        if flight is not None:
            recorded.update(flight.steps)
        start, end = step_range
        return views.timeline(run, series, start, end, max_points, sorted(recorded))

    def incident_impl(self, ctx, experiment: str, run_name: str) -> dict:
        """The ``incident`` route: the incident card, heatmap and hints."""
        source = self._source(ctx, experiment)
        run = self._run(source, run_name)
        incident = source.incident(run)
        flight = source.flight(run)
        series = source.series(run, self._series_cache)
        if series is None:
            raise _not_found(f"the series of run {run.name!r} could not be read")
        record = reader.run_record(run, incident, series, flight, self._logdir)
        return {
            "run": run.name,
            "incident": incident,
            "cause": causes.diagnose(record),
            "bundle": views.bundle_entry(run),
            "explosion": run.summary.get("explosion"),
            "heatmap": views.heatmap(flight, incident) if flight is not None else None,
            "hints": causes.compute_hints(record),
            "warnings": warnings_of(run.summary),
        }

    def step_impl(self, ctx, experiment: str, run_name: str, step: int) -> dict:
        """The ``step`` route: the per-layer table of one recorded step."""
        source = self._source(ctx, experiment)
        run = self._run(source, run_name)
        flight = source.flight(run)
        vector = flight.vector(step) if flight is not None else None
        origin = "flight"
        if vector is None:
            origin = "snapshot"
            vector = source.layers(run, step)
        if vector is None:
            raise _not_found(f"step {step} of run {run.name!r} has no per-layer record")
        return {
            "run": run.name,
            "step": step,
            "source": origin,
            "rows": views.step_rows(run.schema, vector),
        }

    # -- data access ------------------------------------------------------

    def _cause(self, source: reader.Source, run: reader.Run) -> dict | None:
        """The run's cause; the series and flight window are read only for a
        run with an incident (what the other causes need is in the summary)."""
        try:
            if not run.summary.get("first_nonfinite"):
                return causes.diagnose(reader.run_record(run, None, None, None, self._logdir))
            series = source.series(run, self._series_cache)
            incident = source.incident(run)
            record = reader.run_record(run, incident, series, source.flight(run), self._logdir)
            return causes.diagnose(record)
        except Exception:  # noqa: BLE001 - one run's odd record must not hide the list
            logger.warning("nanwatch: no cause for run %r", run.name, exc_info=True)
            return None

    def _source(self, ctx, experiment: str) -> reader.Source:
        if self._data_provider is None:
            raise _not_found("no data provider: TensorBoard has no log data loaded")
        return reader.Source(self._data_provider, ctx, experiment)

    @staticmethod
    def _run(source: reader.Source, name: str) -> reader.Run:
        found = source.run(name)
        if found is None:
            raise _not_found(f"no readable NaN Watch data for run {name!r}")
        return found


def _scope(request: wrappers.Request) -> tuple:
    """(request context, experiment id) of a request, as TensorBoard's own
    plugins take them."""
    return plugin_util.context(request.environ), plugin_util.experiment_id(request.environ)
