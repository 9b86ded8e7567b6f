"""A run dir from anyone, round two: rewind points, replay's imports, the
writer's lock, FIFOs (issue 57).

Each attack is a run dir recorded by a real NanWatch ``fit`` (an explosion
with its rewind point and the model beside it; an incident with its bundle, a
custom layer and a rewind point), copied, then tampered with as a stranger
could. ``tb-nanwatch`` then opens it in a guarded interpreter
(closed_box_lib): nothing outside is opened or written, its memory grows by
less than ``MEMORY_BOUND_MB``, the refusal is one line, the other runs are
still reported, and a timeout turns a hang into a failure.
"""

from __future__ import annotations

import builtins
import importlib.util
import io
import json
import os
import shutil
import sys
import tracemalloc
import zipfile

import keras
import numpy as np
import pytest
from closed_box_lib import assert_contained, guarded_cli, refusal_lines, tiny_model, write_npz_bomb

import tb_nanwatch
from tb_nanwatch import cli
from tb_nanwatch.evidence import limits, run_dir_box
from tb_nanwatch.evidence import trials as evidence_trials
from tb_nanwatch.record.after_incident import rewind_file, trials_file
from tb_nanwatch.record.after_incident import trials as remedy_trials
from tb_nanwatch.record.writing import run_dirs

BUNDLE = "repro/step_000000003"
REWIND = "repro/rewind"
# What a run dir carries to be run: each writes this marker when imported.
MARKER = "ran.txt"
ACME = "import keras\n\n\nclass AcmeDense(keras.layers.Dense):\n    pass\n"
EVIL = "import os\nopen(os.path.join({outside!r}, 'ran.txt'), 'w').write('{what}')\n"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> dict:
    """Two run dirs recorded by real fits (no trials: the tests run them):
    ``explosion`` (repro/rewind with model.json and model.keras) and
    ``incident`` (a bundle with an AcmeDense model, and a rewind point);
    ``user``: the folder of the user's own ``acme_layers.py``."""
    from scenarios import exploding

    root = tmp_path_factory.mktemp("recorded")
    user = root / "user"
    user.mkdir()
    (user / "acme_layers.py").write_text(ACME)
    spec = importlib.util.spec_from_file_location("acme_layers", user / "acme_layers.py")
    acme = importlib.util.module_from_spec(spec)
    sys.modules["acme_layers"] = acme
    spec.loader.exec_module(acme)
    model, fit_args, _ = exploding()
    watch = tb_nanwatch.NanWatch(str(root / "explosion"), rewind_every=20, remedy_trials=False)
    model.fit(**fit_args, callbacks=[watch], verbose=0)
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((3,)), acme.AcmeDense(4, name="big"), keras.layers.Dense(1, name="out")]
    )
    model.compile("sgd", "mse")
    x = np.ones((32, 3), np.float32)
    x[13, 1] = np.nan  # step 3 of batch 4
    watch = tb_nanwatch.NanWatch(str(root / "incident"), rewind_every=2, remedy_trials=False)
    model.fit(
        x, np.ones((32, 1), np.float32), batch_size=4, shuffle=False, verbose=0, callbacks=[watch]
    )
    del sys.modules["acme_layers"]
    for name in ("explosion", "incident"):
        assert os.path.isfile(root / name / REWIND / "rewind.json"), name
    assert os.path.isfile(root / "explosion" / REWIND / "model.json")
    assert os.path.isfile(root / "incident" / BUNDLE / "model.keras")
    return {"root": str(root), "user": str(user)}


def copy_run(recorded: dict, kind: str, logdir: str, name: str | None = None) -> str:
    """A copy of the recorded ``kind`` run as ``logdir/name``."""
    run_dir = os.path.join(logdir, name or kind)
    shutil.copytree(os.path.join(recorded["root"], kind), run_dir)
    return run_dir


def edit_json(path: str, **changes) -> None:
    with open(path, encoding="utf-8") as infile:
        body = json.load(infile)
    body.update(changes)
    with open(path, "w", encoding="utf-8") as outfile:
        json.dump(body, outfile)


def edit_model_config(path: str, edit) -> None:
    """Rewrites ``config.json`` of the ``model.keras`` at ``path`` by ``edit(config)``."""
    with zipfile.ZipFile(path) as archive:
        members = {info.filename: archive.read(info) for info in archive.infolist()}
    config = json.loads(members["config.json"])
    edit(config)
    members["config.json"] = json.dumps(config).encode()
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)


def first_layer(config: dict) -> dict:
    """The first layer after the model's input."""
    return next(c for c in config["config"]["layers"] if c["class_name"] != "InputLayer")


def swap_for_link(path: str, outside: str) -> str:
    """Moves ``path`` outside and leaves a symlink to it in its place."""
    target = os.path.join(outside, os.path.basename(path))
    shutil.move(path, target)
    os.symlink(target, path)
    return target


def replace_by_fifo(path: str) -> None:
    os.remove(path)
    os.mkfifo(path)


def outside_dir(root) -> str:
    outside = os.path.join(str(root), "outside")
    os.makedirs(outside, exist_ok=True)
    return outside


def one_line(result: dict, *words: str) -> str:
    """The one error line of ``result`` holding ``words`` (asserted one)."""
    lines = refusal_lines(result, *words)
    assert len(lines) == 1, result["err"]
    return lines[0]


# -- 1, 2: what rewind.json and rewind.npz declare ---------------------------------------


@pytest.mark.timeout(120)
def test_1_huge_declared_counts_are_refused_before_any_array_name_is_built(recorded, tmp_path):
    run_dir = copy_run(recorded, "explosion", str(tmp_path))
    meta = os.path.join(run_dir, REWIND, "rewind.json")
    edit_json(meta, steps=100000, batch_size=100000, arrays={})
    assert os.path.getsize(meta) < 4096
    tracemalloc.start()
    try:
        with pytest.raises(limits.LimitError, match="more than the limit of 65536"):
            rewind_file.load_rewind_point(run_dir)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * limits.MB  # the 10^10 names are never made
    (result,) = guarded_cli([["replay", run_dir, "--json"]], [], tensorflow=True)
    assert_contained(result)
    assert result["code"] == 0
    one_line(result, "remedy trials not run", "arrays, more than the limit")


@pytest.mark.timeout(240)
def test_2_a_rewind_npz_bomb_gets_the_bundles_limit(recorded, tmp_path):
    outside = outside_dir(tmp_path)
    runs = {}
    for name, declared in (("declares_the_bomb", True), ("declares_a_small_array", False)):
        run_dir = runs[name] = copy_run(recorded, "explosion", str(tmp_path / "logs"), name)
        meta_path = os.path.join(run_dir, REWIND, "rewind.json")
        write_npz_bomb(os.path.join(run_dir, REWIND, "rewind.npz"), "w/0", gib=1.0)
        assert os.path.getsize(os.path.join(run_dir, REWIND, "rewind.npz")) < 2 * limits.MB
        if declared:
            with open(meta_path) as f:
                arrays = json.load(f)["arrays"]
            arrays["w/0"] = ["<f4", [2**30 // 4]]
            edit_json(meta_path, arrays=arrays)
    commands = [["replay", runs[name], "--json"] for name in sorted(runs)]
    results = guarded_cli(commands, [outside], tensorflow=True)
    for result in results:
        assert_contained(result)
        assert result["code"] == 0
    small, bomb = results
    one_line(bomb, "remedy trials not run", f"more than {limits.MAX_BUNDLE_BYTES // limits.MB} MB")
    line = one_line(small, "remedy trials not run")
    assert "larger than declared" in line or "limit" in line, line


# -- 3: a symlinked repro or repro/rewind ------------------------------------------------


@pytest.mark.timeout(300)
def test_3_a_symlinked_repro_or_rewind_dir_is_never_followed(recorded, tmp_path):
    outside, logdir = outside_dir(tmp_path), str(tmp_path / "logs")
    explosion = copy_run(recorded, "explosion", logdir, "linked_rewind_of_explosion")
    swap_for_link(os.path.join(explosion, REWIND), outside)
    incident = copy_run(recorded, "incident", logdir, "linked_rewind_of_incident")
    os.makedirs(os.path.join(outside, "incident"))
    swap_for_link(os.path.join(incident, REWIND), os.path.join(outside, "incident"))
    repro = copy_run(recorded, "incident", logdir, "linked_repro")
    os.makedirs(os.path.join(outside, "repro_of"))
    swap_for_link(os.path.join(repro, "repro"), os.path.join(outside, "repro_of"))
    acme = os.path.join(recorded["user"], "acme_layers.py")  # the user's own, named by path
    commands = [
        ["replay", explosion, "--json"],
        ["replay", incident, "--json", "--import", acme],
        ["replay", repro, "--no-trials", "--import", acme],
        ["report", logdir, "--json"],
    ]
    results = guarded_cli(commands, [outside], tensorflow=True)
    for result in results:
        assert_contained(result)
    linked_explosion, linked_incident, linked_repro, report = results
    assert linked_explosion["code"] == 2
    one_line(linked_explosion, "error", "not followed")
    assert linked_incident["code"] == 0, linked_incident["err"]
    one_line(linked_incident, "remedy trials not run", "not followed")
    assert linked_repro["code"] == 2
    one_line(linked_repro, "error", "not followed")
    reported = {run["run"] for run in json.loads(report["out"])["runs"]}
    assert reported == {os.path.basename(p) for p in (explosion, incident, repro)}


# -- 4: FIFOs in place of the files replay reads -------------------------------------------


@pytest.mark.timeout(400)
def test_4_fifos_in_place_of_run_dir_files_are_refused_without_waiting(recorded, tmp_path):
    logdir = str(tmp_path / "logs")
    places = {
        "fifo_trials_json": ("incident", "repro/trials.json"),
        "fifo_rewind_json": ("explosion", f"{REWIND}/rewind.json"),
        "fifo_rewind_npz": ("explosion", f"{REWIND}/rewind.npz"),
        "fifo_model_json": ("explosion", f"{REWIND}/model.json"),
        "fifo_bundle_json": ("incident", f"{BUNDLE}/bundle.json"),
        "fifo_bundle_npz": ("incident", f"{BUNDLE}/bundle.npz"),  # the report reads its batch
    }
    acme = os.path.join(recorded["user"], "acme_layers.py")
    commands = []
    for name, (kind, relative) in places.items():
        run_dir = copy_run(recorded, kind, logdir, name)
        path = os.path.join(run_dir, *relative.split("/"))
        if os.path.exists(path):
            os.remove(path)
        os.mkfifo(path)
        commands.append(["replay", run_dir, "--json", "--import", acme])
    commands.append(["report", logdir, "--json"])
    results = guarded_cli(commands, [], tensorflow=True)
    for result in results:
        assert_contained(result)
    by_name = dict(zip(places, results, strict=False))
    for name in ("fifo_trials_json", "fifo_rewind_json", "fifo_rewind_npz"):
        assert by_name[name]["code"] == 0, by_name[name]["err"]
        one_line(by_name[name], "remedy trials not run", "FIFO")
    for name in ("fifo_model_json", "fifo_bundle_json", "fifo_bundle_npz"):
        assert by_name[name]["code"] == 2
        one_line(by_name[name], "error", "FIFO")
    reported = {run["run"] for run in json.loads(results[-1]["out"])["runs"]}
    assert reported == set(places)


# -- 5, 6: the writer's lock and the choice of run_N ---------------------------------------


def short_fit(log_dir: str) -> tb_nanwatch.NanWatch:
    """Four healthy steps of a tiny model watched into ``log_dir``."""
    watch = tb_nanwatch.NanWatch(log_dir, rewind_every=0, remedy_trials=False)
    x, y = np.ones((16, 3), np.float32), np.ones((16, 1), np.float32)
    tiny_model().fit(x, y, batch_size=4, verbose=0, callbacks=[watch])
    return watch


def nanwatch_warnings(caplog, recwarn) -> list[str]:
    logged = [r.getMessage() for r in caplog.records if r.levelname in ("WARNING", "ERROR")]
    warned = [str(w.message) for w in recwarn if "NanWatch" in str(w.message)]
    return [line for line in logged + warned if "NanWatch" in line]


@pytest.mark.timeout(120)
def test_5_a_fifo_planted_as_the_writers_lock_never_hangs_fit(tmp_path, caplog, recwarn):
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    os.mkfifo(log_dir / run_dirs.LOCK_FILE)
    short_fit(str(log_dir))
    assert run_dirs.holds_record(str(log_dir / "run_2"))
    assert not run_dirs.holds_record(str(log_dir))
    assert os.path.exists(log_dir / run_dirs.LOCK_FILE)  # left as it was
    (line,) = nanwatch_warnings(caplog, recwarn)
    assert "run_2" in line and "\n" not in line


@pytest.mark.timeout(120)
def test_6_a_planted_run_n_file_or_symlink_is_skipped_as_taken(tmp_path, caplog, recwarn):
    outside, log_dir = tmp_path / "outside", tmp_path / "logs"
    outside.mkdir()
    short_fit(str(log_dir))  # the log dir's own run
    caplog.clear()
    (log_dir / "run_2").write_text("not a directory")
    os.symlink(outside, log_dir / "run_3")
    short_fit(str(log_dir))
    assert os.listdir(outside) == []  # never followed
    assert (log_dir / "run_2").read_text() == "not a directory"
    assert run_dirs.holds_record(str(log_dir / "run_4"))
    (line,) = nanwatch_warnings(caplog, recwarn)
    assert "run_4" in line
    out, err = io.StringIO(), io.StringIO()
    assert cli.main(["report", str(log_dir), "--json"], out, err) == 0, err.getvalue()
    assert {run["run"] for run in json.loads(out.getvalue())["runs"]} == {".", "run_4"}


# -- 7: control characters from model.keras and bundle.json ---------------------------------

ESCAPES = ("\x1b", "\x07", "\u202e")


def assert_inert(result: dict) -> None:
    for stream in ("out", "err"):
        assert not any(c in result[stream] for c in ESCAPES), repr(result[stream])


@pytest.mark.timeout(300)
def test_7_names_from_the_run_dir_reach_the_terminal_inert(recorded, tmp_path):
    logdir = str(tmp_path / "logs")
    evil_class = "Acme\x1b]52;c;ZXZpbA==\x07Dense\u202e"
    incident = copy_run(recorded, "incident", logdir)
    bundle_dir = os.path.join(incident, BUNDLE)

    def rename(config: dict) -> None:
        first_layer(config).update(class_name=evil_class, registered_name=evil_class)

    edit_model_config(os.path.join(bundle_dir, "model.keras"), rename)
    entry = {"name": evil_class, "registered_name": evil_class, "module": "\x1b[2Jacme"}
    edit_json(os.path.join(bundle_dir, "bundle.json"), custom_objects=[entry])
    explosion = copy_run(recorded, "explosion", logdir)
    # A weight name the model does not have: the trials' line quotes it.
    point = rewind_file.load_rewind_point(explosion)
    point.weights["evil\x1b[2J\x1b]0;title\x07"] = np.zeros(1, np.float32)
    for name in (rewind_file.ARRAYS_FILE, rewind_file.META_FILE):
        os.remove(os.path.join(explosion, REWIND, name))
    rewind_file.save_rewind_point(explosion, point)
    unknown, trials = guarded_cli(
        [["replay", incident, "--no-trials"], ["replay", explosion]], [], tensorflow=True
    )
    for result in (unknown, trials):
        assert_contained(result)
        assert_inert(result)
    assert unknown["code"] == 2
    line = one_line(unknown, "which is not known here")
    assert "\\x1b]52" in line and "\\u202e" in line
    assert trials["code"] == 0, trials["err"]
    assert any("\\x1b[2J" in line for line in trials["err"].splitlines()), trials["err"]
    stream = io.StringIO()
    cli._progress(stream)(f"NanWatch trial 1/1: lower_lr: Not tried: {evil_class}")
    assert "\\x1b]52" in stream.getvalue()
    assert not any(c in stream.getvalue() for c in ESCAPES)


# -- 8: nothing the run dir carries is imported or run ---------------------------------------


def plant(path: str, outside: str, what: str) -> None:
    """Code that leaves ``MARKER`` in ``outside`` when it runs."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(EVIL.format(outside=outside, what=what) + ACME)


@pytest.mark.timeout(300)
def test_8_replay_never_advises_or_imports_code_the_run_dir_carries(recorded, tmp_path):
    outside, logdir = outside_dir(tmp_path), str(tmp_path / "logs")
    advised = copy_run(recorded, "incident", logdir, "advised")
    carried = os.path.join(advised, BUNDLE, "acme_layers.py")
    plant(carried, outside, "the bundle's acme_layers")
    module = f"{BUNDLE}/acme_layers.py"
    entry = {"name": "AcmeDense", "registered_name": "AcmeDense", "module": module}
    edit_json(os.path.join(advised, BUNDLE, "bundle.json"), custom_objects=[entry])
    advice, by_path = guarded_cli(
        [["replay", advised, "--no-trials"], ["replay", advised, "--import", carried]],
        [],
        tensorflow=True,
    )
    assert advice["code"] == by_path["code"] == 2
    line = one_line(advice, "which is not known here")
    assert "acme_layers.py" not in line and "--import repro" not in line, line
    one_line(by_path, "--import", "inside the run dir")
    # Run from inside the run dir (the current directory first on sys.path, as
    # `python -m` puts it): its acme_layers.py and keras_hub/ shadow nothing.
    shadowing = copy_run(recorded, "incident", logdir, "shadowing")
    plant(os.path.join(shadowing, "acme_layers.py"), outside, "the run dir's acme_layers")
    (own,) = guarded_cli(
        [["replay", ".", "--no-trials", "--json", "--import", "acme_layers"]],
        [],
        tensorflow=True,
        cwd=shadowing,
        path=(recorded["user"],),
    )
    assert own["code"] == 0, own["err"]
    assert json.loads(own["out"])["step"] == 3
    hub = copy_run(recorded, "explosion", logdir, "keras_hub")
    plant(os.path.join(hub, "keras_hub", "__init__.py"), outside, "the run dir's keras_hub")

    def from_keras_hub(config: dict) -> None:
        first_layer(config).update(
            module="keras_hub.src.layers", class_name="Evil", registered_name="keras_hub>Evil"
        )

    edit_model_config(os.path.join(hub, REWIND, "model.keras"), from_keras_hub)
    (safe_mode,) = guarded_cli([["replay", ".", "--no-trials"]], [], tensorflow=True, cwd=hub)
    assert safe_mode["code"] == 2
    one_line(safe_mode, "tb-nanwatch replay: error")
    for result in (advice, by_path, own, safe_mode):
        assert_contained(result)
    assert not os.path.exists(os.path.join(outside, MARKER))


# -- 9: trial entries, and repro swapped while the trials run -------------------------------


def test_9_a_malformed_trial_entry_is_not_tried_never_a_fix(recorded, tmp_path):
    run_dir = copy_run(recorded, "explosion", str(tmp_path))
    found = remedy_trials.TrialList(
        [
            evidence_trials.Trial("lower_lr", "fixed", steps=20, setting="lr x0.1", learning=True),
            evidence_trials.Trial("clip_gradients", "not_fixed", steps=20),
        ]
    )
    path = trials_file.write_trials(run_dir, 48, {"id": "explosion"}, found)
    with open(path) as f:
        body = json.load(f)
    body["trials"].insert(0, {**body["trials"][0], "remedy": "fix_schedule", "steps": "x"})
    body["trials"].append({**body["trials"][1], "remedy": "lr_warmup", "learning": "yes"})
    with open(path, "w") as f:
        json.dump(body, f)
    with open(path) as f:
        parsed = evidence_trials.by_remedy(evidence_trials.parse_trials(json.load(f)))
    for remedy in ("fix_schedule", "lr_warmup"):
        assert parsed[remedy].outcome == "not_tried"
        assert (
            evidence_trials.trial_text(parsed[remedy]) == f"Not tried: {evidence_trials.MALFORMED}"
        )
    ids = ["fix_schedule", "lower_lr", "clip_gradients", "lr_warmup"]
    assert evidence_trials.rank(ids, parsed.values())[0] == "lower_lr"


def opened_paths(monkeypatch, seen_off: list) -> list[str]:
    """Records the real path of every file this process opens from now on
    (not while ``seen_off`` holds anything): what ``os.open`` opened, by its
    fd (an open refused by ``O_NOFOLLOW`` opened nothing)."""
    import tensorflow as tf

    seen: list[str] = []

    def by_path(function):
        def opened(path, *args, **kwargs):
            if not seen_off and isinstance(path, (str, bytes, os.PathLike)):
                seen.append(os.path.realpath(os.fsdecode(path)))
            return function(path, *args, **kwargs)

        return opened

    def by_fd(path, *args, **kwargs):
        fd = real_open(path, *args, **kwargs)
        if not seen_off:
            seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        return fd

    real_open = os.open
    monkeypatch.setattr(builtins, "open", by_path(builtins.open))
    monkeypatch.setattr(os, "open", by_fd)
    monkeypatch.setattr(tf.io.gfile, "GFile", by_path(tf.io.gfile.GFile))
    return seen


@pytest.mark.timeout(300)
def test_9_repro_swapped_for_a_symlink_while_the_trials_run(recorded, tmp_path, monkeypatch):
    outside = outside_dir(tmp_path)
    run_dir = copy_run(recorded, "explosion", str(tmp_path / "logs"))
    stolen = os.path.join(outside, "repro")
    sent = copy_run(recorded, "explosion", str(tmp_path / "other"))
    trials_file.write_trials(sent, 1, {"id": "explosion"}, remedy_trials.TrialList())
    with open(os.path.join(sent, "repro", "trials.json")) as f:
        victim = f.read()
    swapped = []

    def swap_then_print(err):
        say = real_progress(err)

        def progress(line: str) -> None:
            if not swapped:  # the first trial has run: repro changes under the rest
                paused.append(True)  # the test's own copying is not the replay's
                shutil.copytree(os.path.join(sent, "repro"), stolen)
                shutil.rmtree(os.path.join(run_dir, "repro"))
                os.symlink(stolen, os.path.join(run_dir, "repro"))
                paused.clear()
                swapped.append(line)
            say(line)

        return progress

    real_progress = cli._progress
    monkeypatch.setattr(cli, "_progress", swap_then_print)
    paused: list = []
    seen = opened_paths(monkeypatch, paused)
    out, err = io.StringIO(), io.StringIO()
    assert cli.main(["replay", run_dir, "--json"], out, err) == 0, err.getvalue()
    assert swapped
    real_outside = os.path.realpath(outside) + os.sep
    assert not [p for p in seen if p.startswith(real_outside)]
    with open(os.path.join(stolen, "trials.json")) as f:
        assert f.read() == victim  # not written either
    lines = [line for line in err.getvalue().splitlines() if "remedy trials not run" in line]
    assert len(lines) == 1 and "not followed" in lines[0], err.getvalue()
    assert "trials" not in json.loads(out.getvalue())


def test_the_read_primitive_refuses_every_non_regular_file(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "repro").mkdir(parents=True)
    os.mkfifo(run_dir / "repro" / "fifo")
    os.symlink("/dev/zero", run_dir / "repro" / "device")
    (run_dir / "repro" / "big").write_bytes(b"x" * 100)
    for name, words in (("fifo", "a FIFO"), ("device", "a symlink")):
        with pytest.raises(run_dir_box.RunDirError, match=words):
            run_dir_box.read_inside(str(run_dir), f"repro/{name}", 10)
    with pytest.raises(ValueError, match="limit"):
        run_dir_box.read_inside(str(run_dir), "repro/big", 10)


def test_the_limits_page_states_the_rewind_point_row():
    page = os.path.join(
        os.path.dirname(os.path.dirname(__file__)), "docs", "reference", "limits.md"
    )
    with open(page, encoding="utf-8") as f:
        rows = [line for line in f if line.startswith("|") and "`rewind.npz`" in line]
    assert len(rows) == 1
    assert f"{limits.MAX_BUNDLE_BYTES // limits.MB} MB" in rows[0]
    assert str(limits.MAX_REWIND_ARRAYS) in rows[0]
