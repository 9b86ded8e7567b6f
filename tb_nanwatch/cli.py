"""The ``tb-nanwatch`` command line.

``tb-nanwatch report LOGDIR [--json]`` prints, per NaN Watch run found under
LOGDIR, the first non-finite step (or "healthy"), the explosion onset and the
skipped steps. Exit status: 0 when LOGDIR was read, 2 for a bad path or usage.
``tb-nanwatch replay RUN_DIR`` re-runs a run's incident step from its bundle and
names the op and source line of the first NaN/Inf (``record/after_incident/replay.py``), then
tries each remedy the cause offers on a copy of the model (``record/after_incident/trials.py``);
``--import MODULE`` names where custom layers are defined.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import types
from collections.abc import Sequence
from typing import TextIO

from tb_nanwatch.board import logdir_walk
from tb_nanwatch.evidence.printable import printable, printable_lines

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a reader that closed early

# A TensorFlow-free install (the plugin and `report`): `replay` names what it needs.
_TENSORFLOW_MODULES = frozenset({"tensorflow", "keras", "tf_keras"})
_NEEDS_TENSORFLOW = (
    "tb-nanwatch replay needs TensorFlow: pip install 'tb_nanwatch[tensorflow-cpu]' (or tensorflow)"
)


def _prefer_tensorflow_free_io(logdir: str) -> None:
    """Lets TensorBoard read a local LOGDIR without importing TensorFlow.

    TensorBoard uses its built-in file layer instead of ``tf.io.gfile`` when
    the module ``tensorboard.compat.notf`` exists (its no-TensorFlow build).
    Local files need nothing more, and this saves seconds of TF import.
    Remote paths (``gs://`` ...) keep TensorFlow's file systems.
    """
    if logdir_walk.is_remote(logdir) or "tensorflow" in sys.modules:
        return
    sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("notf"))


def _check_logdir(logdir: str) -> str | None:
    """An error message when LOGDIR is not a readable directory."""
    if logdir_walk.is_remote(logdir):
        from tensorboard.compat import tf

        if not tf.io.gfile.isdir(logdir):
            return f"LOGDIR {logdir!r} is not a directory"
        return None
    if not os.path.exists(logdir):
        return f"LOGDIR {logdir!r} does not exist"
    if not os.path.isdir(logdir):
        return f"LOGDIR {logdir!r} is not a directory"
    try:
        with os.scandir(logdir):
            pass
    except OSError as error:
        return f"LOGDIR {logdir!r} cannot be read ({error.strerror or error})"
    return None


def _report(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    problem = _check_logdir(args.logdir)
    if problem:
        print(f"tb-nanwatch report: error: {problem}", file=err)
        return EXIT_USAGE
    from tb_nanwatch.board import report

    data_provider = report.load_provider(args.logdir)
    if args.json:
        body, _ = report.build_report(data_provider, logdir=args.logdir)
        out.write(json.dumps(body, allow_nan=False) + "\n")
        return EXIT_OK
    runs = report.load_runs(data_provider)
    if not runs:
        print(f"no NaN Watch runs found under {args.logdir}", file=out)
        return EXIT_OK
    blocks = [report.run_text(data_provider, runs[name], args.logdir) for name in sorted(runs)]
    print("\n\n".join(blocks), file=out)
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tb-nanwatch",
        description="Inspect NaN Watch runs: where NaN/Inf was born.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    report = commands.add_parser(
        "report",
        help="summarize the NaN Watch runs of a log directory",
        description="Per run under LOGDIR (searched recursively): the first "
        "non-finite step, phase, layer and tensor, or 'healthy'; the explosion "
        "onset; the skipped steps.",
    )
    report.add_argument("logdir", metavar="LOGDIR", help="TensorBoard log directory")
    report.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    report.set_defaults(handler=_report)
    _add_export_command(commands)
    _add_replay_command(commands)
    return parser


# -- export (tb_nanwatch/export.py) ------------------------------------------


def _export(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    problem = _check_logdir(args.logdir)
    if problem:
        print(f"tb-nanwatch export: error: {problem}", file=err)
        return EXIT_USAGE
    from tb_nanwatch.board import export

    try:
        result = export.export(
            args.logdir,
            args.output,
            runs=args.run or None,
            max_points=args.max_points,
            max_step_tables=args.max_step_tables,
        )
    except (export.ExportError, OSError) as error:
        print(f"tb-nanwatch export: error: {error}", file=err)
        return EXIT_USAGE
    count = len(result["runs"])
    print(
        f"wrote {args.output} ({result['bytes'] / 1e6:.1f} MB, {count} run{'s' * (count != 1)}); "
        "open it in a browser, no server or network needed",
        file=out,
    )
    return EXIT_OK


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def _add_export_command(commands) -> None:
    from tb_nanwatch.board.export import DEFAULT_MAX_POINTS, DEFAULT_MAX_STEP_TABLES

    export = commands.add_parser(
        "export",
        help="write the runs of a log directory as one self-contained HTML file",
        description="Writes one HTML file holding the NaN Watch view (timeline, "
        "heatmap, incident card, per-layer tables) of the runs under LOGDIR, "
        "data included: it opens by double-click, offline, without TensorBoard.",
    )
    export.add_argument("logdir", metavar="LOGDIR", help="TensorBoard log directory")
    export.add_argument("-o", "--output", required=True, metavar="FILE.html", help="file to write")
    export.add_argument(
        "--run", action="append", metavar="RUN", help="export only this run (repeatable)"
    )
    export.add_argument(
        "--max-points",
        type=_positive,
        default=DEFAULT_MAX_POINTS,
        help=f"timeline points per run; longer runs are reduced (default and most: {DEFAULT_MAX_POINTS})",
    )
    export.add_argument(
        "--max-step-tables",
        type=_positive,
        default=DEFAULT_MAX_STEP_TABLES,
        help=f"per-layer step tables per run (default {DEFAULT_MAX_STEP_TABLES})",
    )
    export.set_defaults(handler=_export)


# -- replay (record/after_incident/follow_up.py: replay.py, then trials.py) -------------------


def _replay(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from tb_nanwatch.record.after_incident import bundle, replay

    try:
        custom = _import_modules(args.imports or [], args.run_dir)
    except Exception as error:  # noqa: BLE001 - the user's module: any error is theirs
        text = f"--import: {type(error).__name__}: {_one_line(error)}"
        print(f"tb-nanwatch replay: error: {text}", file=err)
        return EXIT_USAGE
    try:
        saved = bundle.load_bundle(args.run_dir)
    except FileNotFoundError as missing:
        return _replay_explosion(args, out, err, custom, missing)
    except (OSError, ValueError) as error:
        print(f"tb-nanwatch replay: error: {_one_line(error)}", file=err)
        return EXIT_USAGE
    try:
        model, loss_fn = bundle.load_model(saved, unsafe=args.unsafe, custom_objects=custom)
    except (OSError, ValueError, TypeError) as error:  # TypeError: an unknown custom class
        print(f"tb-nanwatch replay: error: {_load_error(error, saved.info)}", file=err)
        return EXIT_USAGE
    run_dir = os.path.dirname(os.path.dirname(saved.directory.rstrip("/")))
    origin, found = _replay_then_trials(args, run_dir, saved, model, loss_fn, err)
    if args.json:
        body = {"step": saved.step, "op": origin and origin.to_json()}
        out.write(json.dumps({**body, **_trials_json(found)}) + "\n")
        return EXIT_OK
    # Op names and source lines come from the model that was sent: no control character;
    # the line breaks are the tool's own, so each line is made printable on its own.
    print(printable_lines(replay.describe(saved.step, origin).split("\n")), file=out)
    _print_trials(found, out)
    return EXIT_OK


def _replay_explosion(args, out: TextIO, err: TextIO, custom: dict, missing: Exception) -> int:
    """A run dir without a bundle (an explosion): no op to name, the trials
    from the rewind point with the model saved beside it."""
    from tb_nanwatch.record.after_incident import bundle

    info: dict = {}
    try:
        model, loss_fn, info = bundle.load_model_beside_rewind_point(
            args.run_dir, unsafe=args.unsafe, custom_objects=custom
        )
    except FileNotFoundError:
        print(f"tb-nanwatch replay: error: {_one_line(missing)}", file=err)
        return EXIT_USAGE
    except (OSError, ValueError, TypeError) as error:
        print(f"tb-nanwatch replay: error: {_load_error(error, info)}", file=err)
        return EXIT_USAGE
    _, found = _replay_then_trials(args, args.run_dir, None, model, loss_fn, err)
    if args.json:
        out.write(json.dumps({"step": None, "op": None, **_trials_json(found)}) + "\n")
        return EXIT_OK
    print("no reproduction bundle (no NaN/Inf): no op to name", file=out)
    _print_trials(found, out)
    return EXIT_OK


def _trials_json(found) -> dict:
    return {} if found is None else {"trials": [t.to_json() for t in found]}


def _print_trials(found, out: TextIO) -> None:
    if not found:
        return
    from tb_nanwatch.record.after_incident import trials

    print("remedies, tried on a re-run of the recorded steps:", file=out)
    print("\n".join(f"  {printable(line)}" for line in trials.tried_lines(found)), file=out)


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return printable(text[0]) if text else type(error).__name__


_UNKNOWN_OBJECT = re.compile(r"Could not locate (?:class|function) '([^']+)'")


_MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def _load_error(error: BaseException, info: dict) -> str:
    """One line (made printable): which class could not be rebuilt and how
    to pass it. The module named in the run dir is quoted only when it is a
    module name (never a path: a file the run dir carries is never advised)."""
    text = str(error)
    if "safe_mode" in text:
        return f"{_one_line(error)} (pass --unsafe to load it, for a run dir you trust)"
    match = _UNKNOWN_OBJECT.search(text)
    if match is None:
        return _one_line(error)
    name = match.group(1)
    known = [
        entry
        for entry in info.get("custom_objects") or []
        if isinstance(entry, dict) and name in (entry.get("name"), entry.get("registered_name"))
    ]
    module = known[0].get("module") if known else None
    own = "your own copy of it: a module on your path or a .py file outside the run dir"
    if module == "__main__":
        how = (
            "it was defined in the training script itself: put it in a module and pass "
            f"--import that module ({own})"
        )
    elif isinstance(module, str) and _MODULE_NAME.fullmatch(module):
        how = f"pass --import {module}, {own}"
    else:
        how = f"pass --import MODULE, the module that defines it ({own})"
    return printable(f"the model uses {name}, which is not known here: {how}")


def _import_modules(names: list[str], run_dir: str) -> dict:
    """Imports each ``--import`` (a module name, looked up on the path with
    the current directory last, or a ``.py`` file); returns the classes and
    functions they define, by name, for ``keras.saving.load_model``'s
    ``custom_objects``. Nothing inside the run dir is imported: a file there
    is refused, and the path is searched without the run dir's entries."""
    import importlib
    import importlib.util

    from tb_nanwatch.evidence import run_dir_box
    from tb_nanwatch.record.after_incident import bundle, bundle_files

    box = bundle_files.bundle_box(os.fspath(run_dir))[0]
    found: dict = {}
    for name in names:
        if name.endswith(".py") or os.sep in name:
            if run_dir_box.within(box, name):
                raise ImportError(f"{name} is inside the run dir: what it carries is never run")
            stem = os.path.splitext(os.path.basename(name))[0]
            spec = importlib.util.spec_from_file_location(stem, os.path.abspath(name))
            if spec is None or spec.loader is None:
                raise ImportError(f"--import {name}: not a Python file")
            module = importlib.util.module_from_spec(spec)
            sys.modules[stem] = module
            with bundle.imports_outside(box):  # what it imports in turn, too
                spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:
                sys.path.append(os.getcwd())  # last: never before the installed modules
            with bundle.imports_outside(box):
                module = importlib.import_module(name)
        for attribute, value in vars(module).items():
            if callable(value) and getattr(value, "__module__", None) == module.__name__:
                found[attribute] = value
    return found


def _replay_then_trials(args, run_dir: str, saved, model, loss_fn, err: TextIO) -> tuple:
    """(op, trials): the replay of the bundle ``saved`` (None: no bundle, no
    replay), then the remedy trials from it and the run dir's rewind point,
    written to its ``repro/trials.json`` (None after a warning line when they
    cannot run, or when there is nothing to try; ``--no-trials``: not run)."""
    from tb_nanwatch.record.after_incident import follow_up

    def failed(stage: str, error: Exception) -> None:
        if stage == "replay":
            raise error
        print(f"tb-nanwatch replay: remedy trials not run: {_one_line(error)}", file=err)

    done = follow_up.replay_then_trials(
        model,
        loss_fn,
        run_dir,
        replay=None if saved is None else (lambda: saved),
        trials=None if args.no_trials else (lambda: _trial_input(run_dir, saved)),
        hooks=follow_up.Hooks(failed=failed, progress=_progress(err)),
    )
    return done.origin, done.trials


def _trial_input(run_dir: str, saved):
    """What the trials of the run written in ``run_dir`` need: its cause, the
    step (the bundle's, else the explosion's), its explosion line, and the
    bundle ``saved`` and the rewind point to start from."""
    from tb_nanwatch.evidence.options import WatchOptions
    from tb_nanwatch.record.after_incident import follow_up
    from tb_nanwatch.record.after_incident.trial_episodes import trial_data_of_run

    run = _run_of(run_dir)
    cause, summary = run["cause"], run["summary"]

    def data():  # a stranger's rewind point: read within the bundles' limit
        return trial_data_of_run(run_dir, summary, saved, run["losses"])

    options = WatchOptions(explosion_factor=summary.get("explosion_factor", 1e3))
    step = saved.step if saved is not None else (summary.get("explosion") or {}).get("step")
    return follow_up.TrialInput(cause, step, options, data)


def _progress(err: TextIO):
    # Remedy ids, settings and whys may quote the run dir's names.
    return lambda line: print(printable(line), file=err, flush=True)


def _run_of(run_dir: str) -> dict:
    """The cause and the run summary of the run written in ``run_dir``."""
    from tb_nanwatch.board import report

    provider = report.load_provider(run_dir)
    body, runs = report.build_report(provider, logdir=run_dir)
    entries = [e for e in body["runs"] if e["run"] in (".", "")] or body["runs"]
    if len(entries) != 1:
        raise ValueError(f"{run_dir} holds {len(entries)} NaN Watch runs, not one")
    name = next(n for n in runs if report.run_report(runs[n])["run"] == entries[0]["run"])
    return {
        "cause": entries[0]["cause"],
        "summary": runs[name].summary,
        "losses": _recorded_losses(provider, runs[name]),
    }


def _recorded_losses(provider, run) -> dict[int, float]:
    """The run's recorded loss by step (its series; {} when it has none)."""
    from tensorboard import context

    from tb_nanwatch.board import reader, report

    try:
        source = reader.Source(provider, context.RequestContext(), report.EXPERIMENT_ID)
        series = source.series(run)
    except Exception:  # noqa: BLE001 - without the series the trials say "cannot verify"
        return {}
    if series is None or "loss" not in series.columns:
        return {}
    return {int(s): float(v) for s, v in zip(series.steps, series.columns["loss"], strict=True)}


def _add_replay_command(commands) -> None:
    replay = commands.add_parser(
        "replay",
        help="re-run the incident's step from its bundle: the op and source line of the "
        "first NaN/Inf, and each remedy tried",
        description="Loads RUN_DIR's reproduction bundle and the model saved beside it, "
        "re-runs the offending step eagerly under TensorFlow's numeric checks, prints the "
        "op, the user's source line and whether the incident reproduced, and writes it to "
        "the bundle's replay.json. Then tries each remedy the cause offers on a copy of the "
        "model, from the bundle or the rewind point, and writes repro/trials.json. Exit "
        "status: 0 done, 2 bad path, no bundle, or a model that cannot be rebuilt.",
    )
    replay.add_argument("run_dir", metavar="RUN_DIR", help="the run dir (or its bundle dir)")
    replay.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    replay.add_argument(
        "--unsafe",
        action="store_true",
        help="allow a model holding Python code (Lambda layers): loading it runs that code",
    )
    replay.add_argument(
        "--import",
        dest="imports",
        action="append",
        metavar="MODULE",
        help="import MODULE first (a module name or a .py file): where the model's custom "
        "layers, losses or functions are defined (repeatable)",
    )
    replay.add_argument(
        "--no-trials", action="store_true", help="do not try the remedies (only name the op)"
    )
    replay.set_defaults(handler=_replay)


def main(
    argv: Sequence[str] | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Runs the command line; returns the exit status."""
    out = out or sys.stdout
    err = err or sys.stderr
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    if getattr(args, "logdir", None):
        _prefer_tensorflow_free_io(args.logdir)
    try:
        status = args.handler(args, out, err)
        out.flush()
    except BrokenPipeError:
        return _reader_gone(out)
    except ModuleNotFoundError as missing:
        if (
            args.handler is not _replay
            or (missing.name or "").partition(".")[0] not in _TENSORFLOW_MODULES
        ):
            raise
        print(_NEEDS_TENSORFLOW, file=err)
        return EXIT_USAGE
    return status


def _reader_gone(out: TextIO) -> int:
    """The reader of stdout closed it (``report | head -1``): no traceback, and
    stdout pointed at devnull so that the flush at exit does not fail again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
    except (OSError, ValueError, AttributeError):  # not a file descriptor (a StringIO in tests)
        pass
    return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
