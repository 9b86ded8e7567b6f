"""No dead end at an explosion (issue 15, item 5): the onset step and the
steps around it have per-layer tables, like an incident's flight window."""

from __future__ import annotations

import nanwatch_testlib as lib

from tb_nanwatch.record.writing import journal

ONSET = 100


def _explodes(step, vector, schema):
    if step >= ONSET:
        vector[schema.header_index("loss")] = 1e5
        total = next(e for e in schema.entries if e.kind == "loss" and e.layer is None)
        vector[total.index("value")] = 1e5


def test_the_explosion_onset_and_its_neighbours_have_layer_tables(tmp_path):
    summary = lib.write_vector_run(str(tmp_path / "explodes"), 130, _explodes, window=32)
    onset = summary["explosion"]["step"]
    assert summary["first_nonfinite"] is None
    client = lib.route_client(tmp_path)
    timeline = lib.get_json(client, f"{lib.PLUGIN}/timeline?run=explodes")
    recorded = set(timeline["recorded_steps"])
    assert onset in recorded
    assert {onset - 1, onset - journal.ONSET_SNAPSHOT_RADIUS} <= recorded
    table = lib.get_json(client, f"{lib.PLUGIN}/step?run=explodes&step={onset}")
    assert table["source"] == "snapshot" and table["rows"]
    loss = next(r for r in table["rows"] if r["kind"] == "loss" and r["layer"] is None)
    assert loss["value"] == (1e5 if onset >= ONSET else 0.5)  # that step's own vector
    far = onset - journal.ONSET_SNAPSHOT_RADIUS - 1
    lib.get_json(client, f"{lib.PLUGIN}/step?run=explodes&step={far}", status=404)
