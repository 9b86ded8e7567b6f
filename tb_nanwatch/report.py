"""A text or JSON report of the NaN Watch runs in a log directory.

The log directory is walked by :mod:`tb_nanwatch.logdir_walk` (which survives
unreadable directories, symlink cycles and FIFOs), each run is read by
TensorBoard's own loader (``EventMultiplexer`` with TensorBoard's default
sampling, wrapped in ``MultiplexerDataProvider``), then through
:mod:`tb_nanwatch.reader`, exactly as the plugin reads it.
"""

from __future__ import annotations

import logging
import os

from tensorboard import context

from tb_nanwatch import diagnosis, hints, logdir_walk, reader

EXPERIMENT_ID = ""
logger = logging.getLogger(__name__)


def load_provider(logdir: str):
    """A ``MultiplexerDataProvider`` over every readable run under ``logdir``."""
    # Imported here: TensorBoard's event processing pulls in its I/O layer.
    from tensorboard.backend.event_processing import (
        data_provider,
        plugin_event_multiplexer,
    )

    multiplexer = plugin_event_multiplexer.EventMultiplexer()
    if logdir_walk.is_remote(logdir):  # gs:// ...: TensorBoard's walk, no local one
        multiplexer.AddRunsFromDirectory(logdir)
    else:
        for run_dir in logdir_walk.find_run_dirs(logdir):
            name = logdir_walk.run_name(logdir, run_dir)
            multiplexer.AddRun(run_dir, name)
            _load_only_regular_files(multiplexer.GetAccumulator(name))
    _reload_each_run(multiplexer)
    return data_provider.MultiplexerDataProvider(multiplexer, logdir)


def _load_only_regular_files(accumulator) -> None:
    """Makes a run's directory watcher skip event-file names that are not
    readable regular files (a FIFO would block its reader forever).

    TensorBoard offers no argument for this filter: it is set on the
    accumulator's ``DirectoryWatcher`` (``_generator._path_filter``).
    """
    from tensorboard.backend.event_processing import directory_watcher

    watcher = getattr(accumulator, "_generator", None)
    if isinstance(watcher, directory_watcher.DirectoryWatcher):
        watcher._path_filter = logdir_walk.is_loadable_event_file


class _TruncatedRecordWarner(logging.Handler):
    """Stands in for the ``tensorboard`` logger's propagation while loading:
    turns its debug line about a truncated or corrupt record (where its loader
    stops reading a file) into one warning line, and passes on the records the
    logger would have passed on anyway."""

    def __init__(self, forward_level: int) -> None:
        super().__init__(logging.DEBUG)
        self.forward_level = forward_level

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("Truncated record in"):
            path, reason = (list(record.args or ()) + ["?", "?"])[:2]
            if isinstance(reason, bytes):
                reason = reason.decode("utf-8", "replace")
            reason = str(reason).replace(str(path), "").replace("\n", " ").strip(" b'")
            logger.warning(
                "nanwatch: %s: stopped at a truncated or corrupt record (%s); "
                "the rest of that file is not read",
                path,
                reason,
            )
        elif record.levelno >= self.forward_level:
            logging.getLogger().handle(record)


def _reload_each_run(multiplexer) -> None:
    """``multiplexer.Reload()``, except that an event file TensorBoard cannot
    parse costs only the rest of that run (one warning line), not the report."""
    tb_logger = logging.getLogger("tensorboard")
    handler = _TruncatedRecordWarner(tb_logger.getEffectiveLevel())
    level, propagate = tb_logger.level, tb_logger.propagate
    tb_logger.addHandler(handler)
    tb_logger.setLevel(logging.DEBUG)
    tb_logger.propagate = False
    try:
        for run in sorted(multiplexer.Runs()):
            try:
                multiplexer.GetAccumulator(run).Reload()
            except Exception as error:  # noqa: BLE001 - e.g. a DecodeError
                message = f"{type(error).__name__}: {error}".replace("\n", " ")
                logger.warning(
                    "nanwatch: run %r: stopped reading at an unreadable event (%s)", run, message
                )
                try:  # TensorBoard reads the first event again for listing
                    multiplexer.FirstEventTimestamp(run)
                except Exception:  # noqa: BLE001 - nothing readable: drop the run
                    with multiplexer._accumulators_mutex:
                        multiplexer._accumulators.pop(run, None)
                        multiplexer._paths.pop(run, None)
    finally:
        tb_logger.removeHandler(handler)
        tb_logger.setLevel(level)
        tb_logger.propagate = propagate


def _run_path(name: str) -> str:
    return name.replace(os.sep, "/") if os.sep != "/" else name


def _first_nonfinite(incident: dict | None) -> dict | None:
    if not incident:
        return None
    layer = incident.get("layer")
    return {
        "step": int(incident["step"]),
        "phase": str(incident["phase"]),
        "layer": None if layer is None else str(layer),
        "tensor": str(incident.get("tensor", "")),
        "kind": str(incident.get("kind", "nan")),
    }


def _explosion(explosion: dict | None) -> dict | None:
    if not explosion:
        return None
    return {"step": int(explosion["step"]), "signal": str(explosion["signal"])}


def run_report(run: reader.Run) -> dict:
    """The JSON report entry of one run (the documented shape, nothing more)."""
    return {
        "run": _run_path(run.name),
        "steps": int(run.summary["steps"]),
        "first_nonfinite": _first_nonfinite(run.summary.get("first_nonfinite")),
        "explosion": _explosion(run.summary.get("explosion")),
        "skipped_steps": run.skipped_steps(),
    }


def build_report(data_provider, ctx=None) -> tuple[dict, dict[str, reader.Run]]:
    """``({"runs": [...]}, runs by name)`` for every readable run."""
    runs = _source(data_provider, ctx).runs()
    return {"runs": [run_report(runs[name]) for name in sorted(runs)]}, runs


def run_hints(data_provider, run: reader.Run, ctx=None) -> list[dict]:
    """The incident-card hints of one run."""
    source = _source(data_provider, ctx)
    incident = run.summary.get("first_nonfinite")
    record = hints.run_record(run, incident, source.series(run), source.flight(run))
    return hints.compute_hints(record)


def _source(data_provider, ctx) -> reader.Source:
    return reader.Source(data_provider, ctx or context.RequestContext(), EXPERIMENT_ID)


def format_run(run: reader.Run, run_hints: list[dict] | None = None) -> str:
    """Human-readable lines for one run."""
    summary = run.summary
    steps = int(summary["steps"])
    lines = [f"run {_run_path(run.name)}: {steps} steps, {summary.get('status', '?')}"]
    incident = summary.get("first_nonfinite")
    if incident:
        kind = diagnosis.KIND_TEXT.get(str(incident.get("kind")), str(incident.get("kind")))
        where = f"layer {incident['layer']}" if incident.get("layer") else "no layer"
        lines.append(
            f"  first non-finite: {kind} at step {incident['step']} "
            f"(epoch {incident.get('epoch', '?')}, batch {incident.get('batch', '?')}), "
            f"phase {incident.get('phase')}, {where}, tensor {incident.get('tensor')!r}"
        )
        if incident.get("note"):
            lines.append(f"  note: {incident['note']}")
    else:
        lines.append("  healthy: no NaN/Inf recorded")
    explosion = summary.get("explosion")
    if explosion:
        lines.append(f"  explosion onset: step {explosion['step']} ({explosion['signal']})")
    else:
        lines.append("  explosion onset: none")
    lines.append(f"  skipped steps: {run.skipped_count()}")
    for hint in run_hints or []:
        lines.append(f"  hint: {hint['title']}: {hint['text']}")
    return "\n".join(lines)
