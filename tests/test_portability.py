"""Portable run dirs: copied, renamed or zipped runs read the same; any
``tf.io.gfile`` file system works for writing and reading (tested on TF's
in-memory ``ram://``)."""

from __future__ import annotations

import io
import json
import os
import shutil
import uuid
from urllib.parse import quote

import numpy as np
import pytest
from nanwatch_testlib import PLUGIN, get_json, route_client

from tb_nanwatch import cli
from tb_nanwatch.record.after_incident import bundle
from tb_nanwatch.record.writing.synthetic import write_synthetic_run

RUNS = ("incident", "nested/healthy")


def write_runs(logdir: str) -> None:
    write_synthetic_run(
        os.path.join(logdir, "incident"), 120, incident_step=90, incident_layer=2, snapshot_every=50
    )
    write_synthetic_run(os.path.join(logdir, "nested", "healthy"), 60, num_layers=3)


def add_bundle(run_dir: str, step: int = 90) -> str:
    """A reproduction bundle, saved the way the callback saves it."""
    return bundle.save_bundle(
        run_dir,
        step,
        {"dense/kernel": np.arange(6, dtype=np.float32).reshape(2, 3)},
        [np.ones((4, 2), np.float32), np.zeros((4, 1), np.float32)],
        [0, 0],
        {"exact": True},
    )


def report(logdir: str, as_json: bool = True) -> str:
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(["report", logdir] + (["--json"] if as_json else []), out=out, err=err)
    assert code == 0, err.getvalue()
    return out.getvalue()


def plugin_views(logdir: str) -> dict:
    """Every route's answer for every run (the frontend's view of the log dir)."""
    client = route_client(logdir)
    views = {"runs": get_json(client, f"{PLUGIN}/runs")}
    for entry in views["runs"]["runs"]:
        run = quote(entry["run"], safe="")
        views[entry["run"]] = {
            "timeline": get_json(client, f"{PLUGIN}/timeline?run={run}"),
            "incident": get_json(client, f"{PLUGIN}/incident?run={run}"),
            "step": get_json(client, f"{PLUGIN}/step?run={run}&step=50", status=200)
            if entry["run"].startswith("incident")
            else None,
        }
    return views


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    logdir = str(tmp_path_factory.mktemp("original") / "logs")
    write_runs(logdir)
    return logdir, report(logdir), report(logdir, as_json=False), plugin_views(logdir)


def test_report_names_every_run(original):
    _, body, _, _ = original
    runs = {r["run"]: r for r in json.loads(body)["runs"]}
    assert sorted(runs) == sorted(RUNS)
    assert runs["incident"]["first_nonfinite"]["step"] == 90


@pytest.mark.parametrize("how", ["copy", "rename", "zip"])
def test_moved_log_dir_reads_the_same(original, tmp_path, how):
    logdir, body, text, views = original
    if how == "copy":
        moved = shutil.copytree(logdir, str(tmp_path / "copied"))
    elif how == "rename":
        staged = shutil.copytree(logdir, str(tmp_path / "staged"))
        moved = str(tmp_path / "renamed elsewhere")
        os.rename(staged, moved)
    else:
        archive = shutil.make_archive(str(tmp_path / "logs"), "zip", logdir)
        moved = str(tmp_path / "unzipped")
        shutil.unpack_archive(archive, moved)
    assert report(moved) == body
    assert report(moved, as_json=False) == text
    assert plugin_views(moved) == views


def test_renamed_run_dir_reads_the_same_under_its_new_name(original, tmp_path):
    logdir, body, _, views = original
    moved = shutil.copytree(logdir, str(tmp_path / "logs"))
    os.rename(os.path.join(moved, "incident"), os.path.join(moved, "incident-renamed"))
    expected = json.loads(body)
    for run in expected["runs"]:
        if run["run"] == "incident":
            run["run"] = "incident-renamed"
    expected["runs"].sort(key=lambda r: r["run"])
    assert json.loads(report(moved)) == expected
    renamed = plugin_views(moved)["incident-renamed"]
    for route in ("timeline", "incident", "step"):
        assert renamed[route] == {**views["incident"][route], "run": "incident-renamed"}


def test_copied_single_run_dir_is_its_own_log_dir(original, tmp_path):
    """A teammate gets just the run dir: it is a log dir with one run '.'."""
    logdir, body, _, _ = original
    moved = shutil.copytree(os.path.join(logdir, "incident"), str(tmp_path / "mine"))
    runs = json.loads(report(moved))["runs"]
    expected = next(r for r in json.loads(body)["runs"] if r["run"] == "incident")
    assert runs == [{**expected, "run": "."}]


def test_bundle_path_is_relative_and_moves_with_the_run(tmp_path):
    pytest.importorskip("tensorflow")
    logdir = str(tmp_path / "logs")
    run_dir = os.path.join(logdir, "run")
    write_synthetic_run(run_dir, 10)
    relative = add_bundle(run_dir)
    assert relative == "repro/step_000000090" and not os.path.isabs(relative)
    meta = json.load(open(os.path.join(run_dir, relative, "bundle.json")))
    assert str(tmp_path) not in json.dumps(meta)  # no absolute path inside
    moved = str(tmp_path / "elsewhere")
    shutil.move(logdir, moved)
    loaded = bundle.load_bundle(os.path.join(moved, "run"))
    assert loaded.step == 90
    np.testing.assert_array_equal(loaded.weights["dense/kernel"], np.arange(6).reshape(2, 3))
    # Nothing in the event files names the original directory either.
    for name in os.listdir(os.path.join(moved, "run")):
        path = os.path.join(moved, "run", name)
        if os.path.isfile(path):
            assert str(tmp_path).encode() not in open(path, "rb").read()


# -- any tf.io.gfile file system (ram:// here; gs://, s3:// ... take the same path) --


def test_ram_filesystem_synthetic_write_and_report(original):
    tf = pytest.importorskip("tensorflow")
    logdir = f"ram://nanwatch-{uuid.uuid4().hex}/logs"
    write_runs(logdir)
    assert tf.io.gfile.isdir(logdir)
    _, body, text, views = original
    assert report(logdir) == body
    assert report(logdir, as_json=False) == text
    assert plugin_views(logdir) == views


def test_ram_filesystem_nanwatch_callback_and_bundle():
    tf = pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    import tb_nanwatch

    logdir = f"ram://nanwatch-{uuid.uuid4().hex}/logs"
    x = np.random.RandomState(0).uniform(0.5, 1.5, (64, 3)).astype("float32")
    x[5 * 8 + 2, 1] = np.nan  # input NaN at step 5
    y = np.ones((64, 1), "float32")
    model = keras.Sequential(
        [keras.Input((3,), name="feats"), keras.layers.Dense(2, name="d"), keras.layers.Dense(1)]
    )
    model.compile(optimizer="sgd", loss="mse")
    watch = tb_nanwatch.NanWatch(logdir + "/run", flush_secs=1e9)
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[watch])
    assert watch.incident is not None and watch.incident["step"] == 5

    runs = json.loads(report(logdir))["runs"]
    assert [r["run"] for r in runs] == ["run"]
    assert runs[0]["first_nonfinite"]["step"] == 5
    assert runs[0]["first_nonfinite"]["phase"] == "input"
    assert tf.io.gfile.exists(f"{logdir}/run/{watch.journal.repro_bundle}/bundle.npz")
    loaded = tb_nanwatch.load_bundle(logdir + "/run")
    assert loaded.step == 5 and np.isnan(loaded.x).any()
