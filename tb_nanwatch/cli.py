"""The ``tb-nanwatch`` command line.

``tb-nanwatch report LOGDIR [--json]`` prints, per NaN Watch run found under
LOGDIR, the first non-finite step (or "healthy"), the explosion onset and the
skipped steps. Exit status: 0 when LOGDIR was read, 2 for a bad path or usage.
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

EXIT_OK = 0
EXIT_USAGE = 2


def _is_remote(path: str) -> bool:
    return "://" in path


def _prefer_tensorflow_free_io(logdir: str) -> None:
    """Lets TensorBoard read a local LOGDIR without importing TensorFlow.

    TensorBoard uses its built-in file layer instead of ``tf.io.gfile`` when
    the module ``tensorboard.compat.notf`` exists (its no-TensorFlow build).
    Local files need nothing more, and this saves seconds of TF import.
    Remote paths (``gs://`` ...) keep TensorFlow's file systems.
    """
    if _is_remote(logdir) or "tensorflow" in sys.modules:
        return
    sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("notf"))


def _check_logdir(logdir: str) -> str | None:
    """An error message when LOGDIR is not a readable directory."""
    if _is_remote(logdir):
        from tensorboard.compat import tf

        if not tf.io.gfile.isdir(logdir):
            return f"LOGDIR {logdir!r} is not a directory"
        return None
    if not os.path.exists(logdir):
        return f"LOGDIR {logdir!r} does not exist"
    if not os.path.isdir(logdir):
        return f"LOGDIR {logdir!r} is not a directory"
    return None


def _report(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    problem = _check_logdir(args.logdir)
    if problem:
        print(f"tb-nanwatch report: error: {problem}", file=err)
        return EXIT_USAGE
    from tb_nanwatch import report

    data_provider = report.load_provider(args.logdir)
    body, runs = report.build_report(data_provider)
    if args.json:
        out.write(json.dumps(body, allow_nan=False) + "\n")
        return EXIT_OK
    if not runs:
        print(f"no NaN Watch runs found under {args.logdir}", file=out)
        return EXIT_OK
    blocks = [
        report.format_run(runs[name], report.run_hints(data_provider, runs[name]))
        for name in sorted(runs)
    ]
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
    report.add_argument(
        "--json", action="store_true", help="print one JSON object instead of text"
    )
    report.set_defaults(handler=_report)
    return parser


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
