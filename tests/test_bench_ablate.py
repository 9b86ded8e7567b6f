"""The bench's measuring ablations take out the part they name, and only it."""

from __future__ import annotations

import os
import sys

import pytest
import scenarios
from scenarios import fit

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH)

from ablate import without  # noqa: E402


def _incident_and_stash(tmp_path, parts, jit_compile=False):
    with without(parts):
        model, watch, truth, _ = fit(
            scenarios.backward_sqrt_zero, tmp_path, compile_kwargs={"jit_compile": jit_compile}
        )
    assert model.jit_compile is jit_compile  # XLA stayed on where asked
    return watch.incident, watch._recorder.device.stashed_steps(), truth["step"]


@pytest.mark.parametrize(
    ("parts", "kept"),
    [((), (True, True)), (("copy",), (True, False)), (("stash",), (False, True))],
    ids=["nothing", "copy", "stash"],
)
@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_each_device_record_part_is_taken_out_alone(parts, kept, jit_compile, tmp_path):
    incident, (batch_of, weights_before), step = _incident_and_stash(tmp_path, parts, jit_compile)
    assert incident is not None and incident["step"] == step  # still diagnosed
    assert (batch_of == step, weights_before == step) == kept
    assert (batch_of is None, weights_before is None) == (not kept[0], not kept[1])


@pytest.mark.parametrize("jit_compile", [False, True])
def test_without_counts_only_the_loss_sees_the_nan(jit_compile, tmp_path):
    # The NaN is born in a backward pass and reaches the loss a step later;
    # without the watched tensors' counts only the loss's own count sees it.
    incident, _, step = _incident_and_stash(tmp_path / "ablated", ["counts"], jit_compile)
    assert incident["phase"] == "loss" and incident["step"] > step
    with_counts, _, _ = _incident_and_stash(tmp_path / "whole", [], jit_compile)
    assert with_counts["phase"] == "backward" and with_counts["step"] == step


def test_the_parts_come_back_and_unknown_parts_are_named(tmp_path):
    from tb_nanwatch.record.stats.graph import GraphStats
    from tb_nanwatch.record.stats.xla import XlaStats

    def current() -> tuple:
        return (
            GraphStats.rare_cond,
            GraphStats.rare_assign,
            XlaStats.rare_cond,
            XlaStats.rare_assign,
            XlaStats.counts_in_chunks,
            XlaStats.counted_in_pass,
            GraphStats.held_if_non_finite,
        )

    before = current()
    with without(["counts", "holds", "copy"]):
        assert all(now is not then for now, then in zip(current(), before, strict=True))
    assert current() == before
    with pytest.raises(ValueError, match=r"--without: unknown part\(s\) \['count'\]"):
        with without(["count"]):
            pass


def test_without_holds_the_counts_take_each_tensor_as_it_is():
    import tensorflow as tf

    from tb_nanwatch.record.stats import lazy_counts
    from tb_nanwatch.record.stats.graph import GraphStats

    sources = {}

    @tf.function
    def step(x):
        trigger = tf.reduce_sum(x)
        counts = GraphStats().transient_counts_of([x], trigger)
        sources[len(sources)] = counts["nan"].sources[0]
        return trigger

    x = tf.zeros([lazy_counts.HOLD_MIN_ELEMENTS])  # large enough to be held
    step(x)
    with without(["holds"]):
        tf.function(step.python_function)(x)  # the same step, traced afresh
    assert sources[0].op.type == "Slice"  # held: let go of on a healthy step
    assert sources[1].op.type == "Placeholder"  # the tensor itself
