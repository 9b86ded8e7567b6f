"""Measuring ablations: NanWatch with parts of its step taken out, to see what each part costs.

What a part costs is what taking it out saves: each run here is ``realistic_child.py``'s run of
NanWatch (one fresh process: time to the first step, step time, peak RSS and device memory), with
the named parts replaced by what a healthy step computes without them. An ablated NanWatch records
wrong statistics (without ``counts`` a NaN is seen only once it reaches the loss): a measuring
tool, never a setting.

Parts:

* ``counts``: the exact NaN/Inf counts' conditional at the end of the step (under XLA, the
  counts taken in each statistic's own pass, or the chunks' conditionals); every watched
  tensor's count is then 0 (only the loss's own counts, computed in place, still see a NaN);
* ``copy``: the conditional that copies the weights before a step that may be non-finite
  (``pre_step_weights="on_suspect"``, the default);
* ``stash``: the conditional that keeps a non-finite step's batch;
* ``holds``: the ops that let a watched tensor go before the end of the step (outside XLA); the
  counts' conditional then takes each tensor as it is.

    python bench/ablate.py resnet50 --without counts
    python bench/ablate.py transformer --without copy,stash --jit --steps 10

bench/history/RESULTS-history.md has what these measured; docs/xla.md the design they bear on.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PARTS = ("counts", "copy", "stash", "holds")
# The function whose rare conditional each part is (see ``without``).
_CONDITIONAL_OF = {
    "counts": "lazy_count_values",
    "copy": "copy_pre_step_weights",
    "stash": "write_row",
}


@contextlib.contextmanager
def without(parts) -> Iterator[None]:
    """NanWatch's step, traced while this is active, lacks ``parts`` (see the module docstring)."""
    import tensorflow as tf

    from tb_nanwatch.record.stats.graph import GraphStats
    from tb_nanwatch.record.stats.xla import XlaStats

    parts = set(parts)
    unknown = parts - set(PARTS)
    if unknown:
        raise ValueError(
            f"--without: unknown part(s) {sorted(unknown)}; choose from {', '.join(PARTS)}"
        )
    callers = {_CONDITIONAL_OF[p] for p in parts if p in _CONDITIONAL_OF}
    replaced = []
    for backend in (GraphStats, XlaStats):
        replaced += [
            (backend, "rare_cond", _ablated_rare_cond(backend.rare_cond, callers)),
            (backend, "rare_assign", _ablated_rare_assign(backend.rare_assign, callers)),
        ]
    if "counts" in parts:
        replaced.append(
            (
                XlaStats,
                "counts_in_chunks",
                lambda self, counts, phases=None: tf.zeros([len(counts)]),
            )
        )
        replaced.append((XlaStats, "counted_in_pass", lambda self, t: False))
    if "holds" in parts:
        replaced.append((GraphStats, "held_if_non_finite", lambda self, t, trigger_value: t))
    saved = [(owner, name, owner.__dict__.get(name)) for owner, name, _ in replaced]
    for owner, name, value in replaced:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            if value is None:  # inherited: back to the base class's
                delattr(owner, name)
            else:
                setattr(owner, name, value)


def _ablated_rare_cond(rare_cond, callers: set):
    def ablated(self, pred, true_fn, false_fn):
        # Called from the function that owns the conditional: a healthy step's branch, inline.
        if sys._getframe(1).f_code.co_name in callers:
            return false_fn()
        return rare_cond(self, pred, true_fn, false_fn)

    return ablated


def _ablated_rare_assign(rare_assign, callers: set):
    def ablated(self, pred, assign, carry=()):
        # A healthy step assigns nothing.
        if sys._getframe(1).f_code.co_name in callers:
            return list(carry)
        return rare_assign(self, pred, assign, carry)

    return ablated


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Other arguments (--jit, --steps, --warmup) go to realistic_child.py.",
    )
    parser.add_argument("model", help="mlp, conv, lstm, resnet50 or transformer")
    parser.add_argument("--without", required=True, help=f"comma list from {', '.join(PARTS)}")
    args, child_args = parser.parse_known_args()
    import realistic_child

    with contextlib.ExitStack() as ablated:
        try:
            ablated.enter_context(without(args.without.split(",")))
        except ValueError as error:  # an unknown part, before anything is built
            parser.error(str(error))
        print(f"NanWatch without: {args.without}", flush=True)
        sys.argv = ["realistic_child.py", args.model, "nanwatch", *child_args]
        realistic_child.main()


if __name__ == "__main__":
    main()
