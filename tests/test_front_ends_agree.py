"""Both front ends are one watch session: ``fit`` with NanWatch and a custom loop
with StepWatcher, on the same model, data and initial weights, write the same
run record and find the same incident."""

from __future__ import annotations

import numpy as np
import scenarios
from scenarios import fit, train_custom_loop


def _loss_series(journal) -> tuple[list[int], np.ndarray]:
    steps, window = journal.flight_window()
    return [int(s) for s in steps], window[:, journal.schema.header_index("loss")]


def test_fit_and_custom_loop_write_the_same_record_and_incident(tmp_path):
    # ratio_multi_io seeds its own weights and data: both runs start alike.
    _, watch, truth, _ = fit(scenarios.ratio_multi_io, tmp_path / "fit")
    loop, _ = train_custom_loop(scenarios.ratio_multi_io, tmp_path / "loop")

    fit_entries = [(e.phase, e.kind, e.layer, e.tensor) for e in watch.journal.schema.entries]
    loop_entries = [(e.phase, e.kind, e.layer, e.tensor) for e in loop.journal.schema.entries]
    assert loop_entries == fit_entries

    fields = ("step", "phase", "layer", "tensor", "kind")
    assert {k: loop.incident[k] for k in fields} == {k: watch.incident[k] for k in fields}
    assert scenarios.origin(watch.incident) == truth

    fit_steps, fit_losses = _loss_series(watch.journal)
    loop_steps, loop_losses = _loss_series(loop.journal)
    assert fit_steps == loop_steps == list(range(truth["step"] + 1))
    assert np.isfinite(fit_losses[:-1]).all()  # healthy up to the incident step
    np.testing.assert_allclose(loop_losses, fit_losses, rtol=1e-6)

    for journal in (watch.journal, loop.journal):
        assert journal.status == "stopped" and journal.steps == truth["step"] + 1
