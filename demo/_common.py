"""Shared bits of the demo scripts: quiet TensorFlow, an argument parser."""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main_with_log_dir(run, default: str) -> None:
    parser = argparse.ArgumentParser(description=run.__doc__)
    parser.add_argument("log_dir", nargs="?", default=default)
    args = parser.parse_args()
    result = run(args.log_dir)
    print(result)
