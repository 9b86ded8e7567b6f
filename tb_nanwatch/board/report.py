"""A text or JSON report of the NaN Watch runs in a log directory.

The log directory is walked by :mod:`tb_nanwatch.board.logdir_walk` (which survives
unreadable directories, symlink cycles and FIFOs), each run is read by
TensorBoard's own loader (``EventMultiplexer`` with TensorBoard's default
sampling, wrapped in ``MultiplexerDataProvider``), then through
:mod:`tb_nanwatch.board.reader`, exactly as the plugin reads it.
"""

from __future__ import annotations

import logging
import math
import os

import numpy as np
from tensorboard import context

from tb_nanwatch.board import logdir_walk, reader
from tb_nanwatch.evidence import causes, diagnosis, limits, recoveries, run_dir_box, vocabulary
from tb_nanwatch.evidence.causes.case import output_word
from tb_nanwatch.evidence.printable import printable, printable_lines
from tb_nanwatch.evidence.recorded import Record
from tb_nanwatch.evidence.warning_record import warning_line, warnings_of

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
                printable(path),
                printable(reason),
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
                message = printable(f"{type(error).__name__}: {error}".replace("\n", " "))
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


def _run_title(name: str, logdir: str | None) -> str:
    """The run's name as the text report shows it: a log dir that is itself the
    run (TensorBoard names it ".") by the directory's own name."""
    if name == os.curdir and logdir and not logdir_walk.is_remote(logdir):
        return os.path.basename(os.path.abspath(logdir)) or _run_path(name)
    return _run_path(name)


def _first_nonfinite(incident: dict | None) -> dict | None:
    if not incident:
        return None
    layer = incident.get("layer")
    op = incident.get("op")
    return {
        "step": int(incident["step"]),
        "phase": str(incident["phase"]),
        "layer": None if layer is None else str(layer),
        "tensor": str(incident.get("tensor", "")),
        "kind": str(incident.get("kind", "nan")),
        "op": json_safe(op) if isinstance(op, dict) else None,
    }


def _explosion(explosion: dict | None) -> dict | None:
    if not explosion:
        return None
    return {"step": int(explosion["step"]), "signal": str(explosion["signal"])}


def json_safe(value: object) -> object:
    """``value`` with each non-finite float as TensorBoard writes it in JSON
    (``"NaN"``, ``"Infinity"``, ``"-Infinity"``): kept, not dropped."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        if math.isnan(value):
            return vocabulary.NON_FINITE["nan"]
        return vocabulary.NON_FINITE["posinf" if value > 0 else "neginf"]
    return value


def run_report(run: reader.Run, cause: dict | None = None) -> dict:
    """The JSON report entry of one run (the documented shape, nothing more)."""
    return {
        "run": _run_path(run.name),
        "steps": int(run.summary["steps"]),
        "first_nonfinite": _first_nonfinite(run.summary.get("first_nonfinite")),
        "explosion": _explosion(run.summary.get("explosion")),
        "skipped_steps": run.skipped_steps(),
        "cause": json_safe(cause),
        "recoveries": recoveries.recoveries(run.summary),
        "warnings": json_safe(warnings_of(run.summary)),
    }


def build_report(
    data_provider, ctx=None, logdir: str | None = None
) -> tuple[dict, dict[str, reader.Run]]:
    """``({"runs": [...]}, runs by name)`` for every readable run; with the
    local ``logdir``, an input-data cause names the bundle's bad rows."""
    source = _source(data_provider, ctx)
    runs = source.runs()
    body = [run_report(runs[name], run_cause(source, runs[name], logdir)) for name in sorted(runs)]
    return {"runs": body}, runs


def run_record(source: reader.Source, run: reader.Run, logdir: str | None = None) -> Record:
    """What the hints and the cause read of one run (with the local ``logdir``,
    its remedy trials too)."""
    incident = source.incident(run)
    return reader.run_record(run, incident, source.series(run), source.flight(run), logdir)


def run_cause(source: reader.Source, run: reader.Run, logdir: str | None = None) -> dict | None:
    """The cause verdict of one run (see :mod:`tb_nanwatch.evidence.causes`)."""
    try:
        record = run_record(source, run, logdir)
        batch = None
        if logdir is not None and record.phase == "input":
            batch = _bundle_batch(logdir, run)
        return causes.diagnose(record, batch)
    except Exception as error:  # noqa: BLE001 - one run's odd record must not stop the report
        logger.warning(
            "nanwatch: run %r: no cause (%s: %s)", run.name, type(error).__name__, printable(error)
        )
        return None


def _bundle_batch(logdir: str, run: reader.Run) -> dict | None:
    """The batch arrays of the run's reproduction bundle, when it is a local
    file inside the run dir and declares no more than the bundle limit."""
    if not isinstance(run.summary.get("repro_bundle"), str) or logdir_walk.is_remote(logdir):
        return None
    try:
        path = reader.local_bundle_file(logdir, run.name, run.summary, "bundle.npz")
        infile = run_dir_box.open_regular(path, "bundle.npz")  # a FIFO: refused, not waited on
        with infile, np.load(infile, allow_pickle=False) as arrays:
            names = [k for k in arrays.files if k.startswith("batch/")]
            limits.check_npz(infile, names, limits.max_bundle_bytes(), "bundle.npz")
            return {k: arrays[k] for k in names}
    except (run_dir_box.RunDirError, limits.LimitError) as error:
        logger.warning("nanwatch: run %r: bundle not read: %s", run.name, error)
    except (OSError, ValueError) as error:
        logger.info("nanwatch: bundle of run %r not read: %s", run.name, error)
    return None


def load_runs(data_provider, ctx=None) -> dict[str, reader.Run]:
    """Every readable run, by name."""
    return _source(data_provider, ctx).runs()


def run_text(data_provider, run: reader.Run, logdir: str | None = None, ctx=None) -> str:
    """The human-readable block of one run: its cause first, then the record."""
    source = _source(data_provider, ctx)
    record = run_record(source, run, logdir)
    cause = run_cause(source, run, logdir)
    return format_run(run, causes.compute_hints(record), cause, logdir)


def _source(data_provider, ctx) -> reader.Source:
    return reader.Source(data_provider, ctx or context.RequestContext(), EXPERIMENT_ID)


def _number(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "[" + ", ".join(_number(v) for v in value) + "]"
    return str(value)


def format_cause(cause: dict) -> list[str]:
    """The lines of a cause in the card's order: the sentence, the remedy it
    leads with (under a heading that says whether it was shown to work) with
    its trial and code, the other remedies, then the evidence."""
    lines = [f"  cause ({cause['id']}): {cause['summary']}"]
    remedies = cause["remedies"]
    if remedies:
        lines.append(f"  {remedies_heading(remedies)}")
        lines += _remedy_lines(1, remedies[0])
    if len(remedies) > 1:
        lines.append(f"  {other_remedies_heading(remedies[1:])}")
        for rank, remedy in enumerate(remedies[1:], 2):
            lines += _remedy_lines(rank, remedy)
    evidence = ", ".join(f"{k}={_number(v)}" for k, v in cause["evidence"].items())
    if evidence:
        lines.append(f"  evidence: {evidence}")
    return lines


def _remedy_lines(rank: int, remedy: object) -> list[str]:
    """One remedy: its text, how its trial went (when tried), its code to paste."""
    lines = [f"    remedy {rank}: {causes.remedy_text(remedy)}"]
    trial = remedy.get("trial") if isinstance(remedy, dict) else None
    if isinstance(trial, dict) and trial.get("text"):
        lines.append(f"      {trial['text']}")
    code = remedy.get("code") if isinstance(remedy, dict) else None
    if isinstance(code, str) and code:
        lines.append("      code:")
        lines.extend(f"        {line}" for line in code.splitlines())
    return lines


def _outcomes(remedies: list) -> list:
    return [
        r["trial"].get("outcome")
        for r in remedies
        if isinstance(r, dict) and isinstance(r.get("trial"), dict)
    ]


def remedies_heading(remedies: list) -> str:
    """The heading over the remedy the report leads with (the card's words):
    whether it was shown to work, or that no remedy tried fixed the run."""
    outcomes = _outcomes(remedies)
    if "fixed" in outcomes:
        return "Shown to work on a re-run of your steps:"
    if "not_fixed" in outcomes:
        return "Nothing we tried fixed the run; what to try first:"
    if outcomes:
        return "What to try first (untested: no remedy trial could run):"
    return "What to try first:"


def other_remedies_heading(others: list) -> str:
    """The heading over the remedies after the first (the card's words)."""
    tried = any(outcome != "not_tried" for outcome in _outcomes(others))
    return f"Other things {'we tried' if tried else 'to try'} ({len(others)}):"


def _op_line(op: object) -> str | None:
    if not isinstance(op, dict):
        return None
    if not op.get("type") and not op.get("name"):
        why = op.get("why") or "the replay did not reproduce the non-finite value"
        return f"    op: not named: {why}"
    source = op.get("source") or "source line unknown"
    replay = {True: "reproduced by replay", False: "not reproduced by replay"}
    outcome = replay.get(op.get("reproduced"), "replay outcome unknown")
    return f"    op: {op.get('type')} {op.get('name')!r} at {source} ({outcome})"


def headline(run: reader.Run) -> str:
    """The run's headline (the card's first line): what, when, in which phase
    and layer; an explosion's onset and signal; or that it is healthy."""
    summary = run.summary
    incident = summary.get("first_nonfinite")
    explosion = summary.get("explosion")
    if incident:
        kind = _kind_text(incident)
        phase = f", born in the {incident['phase']} phase" if incident.get("phase") else ""
        layer = f" at layer {incident['layer']}" if incident.get("layer") else ""
        return f"First {kind} at step {incident['step']}{phase}{layer}"
    if explosion:
        signal = _signal(run)
        what = (
            f"the {signal} of {explosion['layer']}" if explosion.get("layer") else f"the {signal}"
        )
        return (
            f"Explosion from step {explosion['step']}: {what} started to blow up, no NaN or Inf yet"
        )
    return "healthy: no NaN/Inf recorded"


def _signal(run: reader.Run) -> str:
    """The explosion's signal in the tab's words (a regression's outputs are no logits)."""
    signal = str(run.summary["explosion"].get("signal"))
    return output_word(run.summary, run.schema) if signal == "logits" else signal


def _details(run: reader.Run) -> list[str]:
    """The incident's details, the explosion onset, skipped steps and recoveries."""
    summary = run.summary
    incident = summary.get("first_nonfinite")
    explosion = summary.get("explosion")
    lines = []
    if incident:
        kind = _kind_text(incident)
        where = f"layer {incident['layer']}" if incident.get("layer") else "no layer"
        lines.append(
            f"  first non-finite: {kind} at step {incident['step']} "
            f"(epoch {incident.get('epoch', '?')}, batch {incident.get('batch', '?')}), "
            f"phase {incident.get('phase')}, {where}, tensor {incident.get('tensor')!r}"
        )
        op = _op_line(incident.get("op"))
        if op:
            lines.append(op)
        if incident.get("note"):
            lines.append(f"  note: {incident['note']}")
    if explosion:
        lines.append(f"  explosion onset: step {explosion['step']} ({_signal(run)})")
    else:
        lines.append("  explosion onset: none")
    lines.append(f"  skipped steps: {run.skipped_count()}")
    return lines + recoveries.report_lines(summary)


def format_run(
    run: reader.Run,
    run_hints: list[dict] | None = None,
    cause: dict | None = None,
    logdir: str | None = None,
) -> str:
    """Human-readable lines for one run, in the card's order: the headline
    and the cause, the remedy it leads with, the other remedies, the
    evidence, then the details and the hints."""
    steps = int(run.summary["steps"])
    counted = f"{steps} step" if steps == 1 else f"{steps} steps"
    title = _run_title(run.name, logdir)
    lines = [f"run {title}: {counted}, {run.summary.get('status', '?')}", f"  {headline(run)}"]
    if cause:
        lines += format_cause(cause)
    lines += _details(run)
    lines += [f"  {warning_line(found)}" for found in warnings_of(run.summary)]
    for hint in run_hints or []:
        lines.append(f"  hint: {hint['title']}: {hint['text']}")
    return printable_lines(lines)  # names come from the run dir: no control character


def _kind_text(incident: dict) -> str:
    """The incident's kind in words ("NaN", "Inf", ...), else as recorded."""
    kind = str(incident.get("kind"))
    return diagnosis.KIND_TEXT.get(kind, kind)
