"""The ``tb-nanwatch`` command line.

``tb-nanwatch report LOGDIR [--json]`` prints, per NaN Watch run found under
LOGDIR, the first non-finite step (or "healthy"), the explosion onset and the
skipped steps. Exit status: 0 when LOGDIR was read, 2 for a bad path or usage.
``tb-nanwatch replay RUN_DIR`` re-runs a run's incident step from its bundle and
names the op and source line of the first NaN/Inf (``tb_nanwatch/replay.py``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import types
from collections.abc import Sequence
from typing import TextIO

from tb_nanwatch.board import logdir_walk

EXIT_OK = 0
EXIT_USAGE = 2


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


# -- replay (tb_nanwatch/replay.py) ------------------------------------------


def _replay(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from tb_nanwatch.record import bundle, replay

    try:
        saved = bundle.load_bundle(args.run_dir)
        model, loss_fn = bundle.load_model(saved, unsafe=args.unsafe)
    except (OSError, ValueError, TypeError) as error:  # TypeError: an unknown custom layer
        hint = " (pass --unsafe to load it, for a run dir you trust)" * ("safe_mode" in str(error))
        print(f"tb-nanwatch replay: error: {error}{hint}", file=err)
        return EXIT_USAGE
    origin = replay.replay_step(model, saved, loss_fn)
    replay.write_result(saved, origin)
    if args.json:
        out.write(json.dumps({"step": saved.step, "op": origin and origin.to_json()}) + "\n")
    else:
        print(replay.describe(saved.step, origin), file=out)
    return EXIT_OK


def _add_replay_command(commands) -> None:
    replay = commands.add_parser(
        "replay",
        help="re-run the incident's step from its bundle: the op and source line of the first NaN/Inf",
        description="Loads RUN_DIR's reproduction bundle and the model saved beside it, "
        "re-runs the offending step eagerly under TensorFlow's numeric checks, prints the "
        "op, the user's source line and whether the incident reproduced, and writes it to "
        "the bundle's replay.json. Exit status: 0 done, 2 bad path, no bundle or no model.",
    )
    replay.add_argument("run_dir", metavar="RUN_DIR", help="the run dir (or its bundle dir)")
    replay.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    replay.add_argument(
        "--unsafe",
        action="store_true",
        help="allow a model holding Python code (Lambda layers): loading it runs that code",
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
    return args.handler(args, out, err)


if __name__ == "__main__":
    sys.exit(main())
