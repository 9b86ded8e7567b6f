"""NanWatch under tf.distribute: MirroredStrategy over two logical CPUs and
MultiWorkerMirroredStrategy with two worker processes on 127.0.0.1.

Each runs in fresh subprocesses (tests/distribute_worker.py): logical devices
and cluster config must be set before TensorFlow initializes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from nanwatch_testlib import run_worker, worker_env
from scenarios import origin

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "distribute_worker.py")
ORIGIN = {"step": 9, "phase": "forward", "layer": "ratio", "kind": "inf"}


@pytest.fixture(scope="module")
def mirrored(tmp_path_factory):
    out = tmp_path_factory.mktemp("mirrored")
    result = out / "result.json"
    return run_worker([WORKER, "mirrored", str(result), str(out / "logs")], result)


def test_single_and_two_replicas_agree_on_the_diagnosis(mirrored):
    single, multi = mirrored["single"], mirrored["mirrored"]
    assert single["replicas"] == 1 and multi["replicas"] == 2
    assert origin(single["incident"]) == origin(multi["incident"]) == ORIGIN
    assert single["incident"]["tensor"] == multi["incident"]["tensor"]
    assert single["steps"] == multi["steps"] == ORIGIN["step"] + 1


def test_the_step_is_traced_once_with_and_without_a_strategy(mirrored):
    # Under a strategy Keras builds the optimizer before the first trace;
    # without one NanWatch builds it out of the trace's sight. Either way
    # tf.function runs the first trace: nothing of ours may make it trace again.
    assert mirrored["mirrored"]["traces"] == mirrored["single"]["traces"] == 1


def test_statistics_are_reduced_across_replicas(mirrored):
    single, multi = mirrored["single"], mirrored["mirrored"]
    # min of mins, max of maxes: the two 4-row shards give the 8-row batch's extremes.
    assert multi["input_num_step0"] == single["input_num_step0"]
    for key in ("min", "max"):
        assert multi["hidden_step0"][key] == pytest.approx(single["hidden_step0"][key], rel=1e-6)
    # counts summed: one Inf in the whole batch, whichever replica had it.
    assert multi["ratio_at_incident"]["inf"] == single["ratio_at_incident"]["inf"] == 1


def test_incident_names_the_replica_that_went_non_finite_first(mirrored):
    incident = mirrored["mirrored"]["incident"]
    # The zero denominator is row 5 of the 8-row batch: the second replica's shard.
    assert incident["replica"] == 1 and incident["replicas_at_origin"] == [1]
    assert incident["num_replicas"] == 2
    first = incident["replica_first_nonfinite"]
    assert first[1]["phase"] == "forward" and first[1]["layer"] == "ratio"
    # Replica 0's own data stayed finite until the all-reduced update reached it.
    assert first[0] is None or first[0]["phase"] == "update"
    assert "replica" not in mirrored["single"]["incident"]


def test_bundle_holds_every_replica_shard_of_the_exact_step(mirrored):
    multi = mirrored["mirrored"]
    assert multi["bundle_info"] == {"batch_of_step": 9, "exact": True}
    assert multi["bundle_den"] == mirrored["single"]["bundle_den"]
    assert multi["bundle_den"][5] == 0.0


def test_a_later_fit_under_the_strategy_reuses_the_step_and_finds_the_origin(mirrored):
    # The second fit (stage 2) runs the step the first traced; every
    # replica's record starts over, so its step numbers, incident and
    # bundle are its own.
    later = mirrored["mirrored_later_fit"]
    assert later["healthy_incident"] is None
    assert later["traces"] == 1
    assert origin(later["incident"]) == ORIGIN
    assert later["steps"] == ORIGIN["step"] + 1
    assert later["bundle_info"] == {"batch_of_step": ORIGIN["step"], "exact": True}


def test_custom_loop_under_mirrored_strategy(mirrored):
    loop = mirrored["mirrored_custom_loop"]
    assert origin(loop["incident"]) == ORIGIN
    assert loop["incident"]["replica"] == 1
    assert loop["bundle_den"][4 + 1] == 0.0  # replica 1's shard, row 1
    assert len(loop["event_files"]) == 1


def _free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def test_multi_worker_mirrored_strategy_two_processes(tmp_path):
    ports = _free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    log_dir = tmp_path / "logs"
    procs = []
    for index in range(2):
        env = worker_env()
        env["TF_CONFIG"] = json.dumps(
            {"cluster": cluster, "task": {"type": "worker", "index": index}}
        )
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    WORKER,
                    "multiworker",
                    str(tmp_path / f"w{index}.json"),
                    str(log_dir),
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=400)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, output in zip(procs, outputs, strict=False):
        assert proc.returncode == 0, output[-4000:]
    chief, worker = (json.load(open(tmp_path / f"w{i}.json")) for i in range(2))
    # The chief's merged view and worker 1's own record agree on the origin,
    # and both name worker 1's replica (its data shard had the zero).
    for record in (chief, worker):
        assert origin(record["incident"]) == ORIGIN
        assert record["incident"]["replica"] == 1
        assert record["incident"]["worker"] == "worker_1"
        assert record["steps"] == ORIGIN["step"] + 1
    # Each process writes its own run dir: no event file is shared.
    assert chief["run_dir"] == str(log_dir)
    assert worker["run_dir"] == str(log_dir / "worker_1")
    assert worker["summary_worker"] == "worker_1" and chief["summary_worker"] == "worker_0"
    assert len(chief["event_files"]) == 1 and len(worker["event_files"]) == 1
    assert chief["event_files"] != worker["event_files"]
    # Each worker's bundle holds its own shard: only worker 1's has the zero.
    assert worker["bundle_den"][1] == 0.0
    assert 0.0 not in chief["bundle_den"]
