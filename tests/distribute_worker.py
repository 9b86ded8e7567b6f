"""Subprocess body of tests/test_distribute.py (a distribution strategy needs a
fresh process: logical devices must be configured before TensorFlow starts).

    python distribute_worker.py mirrored <out.json> <log_dir>
    TF_CONFIG=... python distribute_worker.py multiworker <out.json> <log_dir>
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

BATCH = 8
ZERO_STEP = 9
STEPS = 12


def _jsonable(value):
    return json.loads(json.dumps(value, default=lambda o: getattr(o, "tolist", lambda: str(o))()))


def _entry_values(journal, step_vector, phase, kind, layer):
    for e in journal.schema.entries:
        if (e.phase, e.kind, e.layer) == (phase, kind, layer):
            return journal.schema.values(step_vector, e)
    raise KeyError((phase, kind, layer))


def _fit(log_dir, strategy=None):
    import scenarios
    from nanwatch_testlib import traced_graphs

    import tb_nanwatch

    if strategy is None:
        model, kwargs, truth = scenarios.ratio_multi_io()
    else:
        with strategy.scope():
            model, kwargs, truth = scenarios.ratio_multi_io()
    watch = tb_nanwatch.NanWatch(log_dir, snapshot_every=1)
    with traced_graphs() as graphs:
        model.fit(**kwargs, callbacks=[watch], verbose=0)
    journal = watch.journal
    steps, window = journal.flight_window()
    first = window[0]  # the flight window starts at step 0 here (12 steps < 32)
    assert int(steps[0]) == 0
    bundle = tb_nanwatch.load_bundle(log_dir)
    return {
        "incident": watch.incident,
        "truth": truth,
        "steps": journal.steps,
        "traces": len({id(g) for g in graphs}),
        "replicas": journal.summary()["replicas"],
        "input_num_step0": _entry_values(journal, first, "input", "input", "num"),
        "hidden_step0": _entry_values(journal, first, "forward", "activation", "hidden"),
        "ratio_at_incident": _entry_values(journal, window[-1], "forward", "activation", "ratio"),
        "bundle_info": {k: bundle.info[k] for k in ("batch_of_step", "exact")},
        "bundle_den": bundle.x["den"].ravel().tolist(),
    }


def _custom_loop(log_dir, strategy, per_worker_data):
    """A StepWatcher custom loop under ``strategy``; ``per_worker_data(pipeline_id)``
    gives each input pipeline its own (num, den, y_main, y_aux) arrays. The
    reproduction bundle is read back where the loop recorded an incident."""
    import keras
    import scenarios

    import tb_nanwatch

    with strategy.scope():
        model, _, truth = scenarios.ratio_multi_io()
        optimizer = keras.optimizers.SGD(0.01)
        watcher = tb_nanwatch.StepWatcher(log_dir, model, optimizer)
    replicas = strategy.num_replicas_in_sync
    per_replica = BATCH // replicas

    def dataset_fn(ctx):
        num, den, y_main, y_aux = per_worker_data(ctx.input_pipeline_id)
        ds = tf.data.Dataset.from_tensor_slices(
            ({"num": num, "den": den}, {"main": y_main, "aux": y_aux})
        )
        return ds.batch(ctx.get_per_replica_batch_size(BATCH))

    dist = strategy.distribute_datasets_from_function(dataset_fn)

    def replica_step(x, y):
        with tf.GradientTape() as tape, watcher.forward(tape, x, y) as rec:
            y_pred = model(x, training=True)
            per_output = {k: tf.reduce_mean(tf.square(y[k] - y_pred[k])) for k in ("main", "aux")}
            loss = rec.loss(tf.add_n(list(per_output.values())), y_pred=y_pred, outputs=per_output)
            scaled = loss / replicas
        grads = rec.gradients(tape.gradient(scaled, rec.sources(model.trainable_variables)))
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=False))
        rec.after_update()

    @tf.function
    def train_step(x, y):
        strategy.run(replica_step, args=(x, y))

    for x, y in dist:
        train_step(x, y)
        if watcher.end_step():
            break
    watcher.close()
    from tb_nanwatch.record.after_incident import bundle as bundle_module

    saved = bundle_module.load_bundle(watcher.log_dir) if watcher.incident else None
    return {
        "incident": watcher.incident,
        "truth": truth,
        "per_replica_batch": per_replica,
        "run_dir": watcher.log_dir,
        "steps": watcher.journal.steps,
        "summary_worker": watcher.journal.summary().get("worker"),
        "bundle_den": saved.x["den"].ravel().tolist() if saved is not None else None,
        "event_files": sorted(
            f for f in os.listdir(watcher.log_dir) if f.startswith("events.out.tfevents")
        ),
    }


def _later_fit(log_dir, strategy):
    """Two fits of one model under ``strategy`` with one NanWatch: the first on
    healthy steps, the second (stage 2) reuses its compiled step."""
    import scenarios
    from nanwatch_testlib import traced_graphs

    import tb_nanwatch

    with strategy.scope():
        model, kwargs, _ = scenarios.ratio_multi_io()
    rows = 4 * scenarios.BATCH
    healthy = {
        **kwargs,
        "x": tf.nest.map_structure(lambda a: a[:rows], kwargs["x"]),
        "y": tf.nest.map_structure(lambda a: a[:rows], kwargs["y"]),
    }
    watch = tb_nanwatch.NanWatch(log_dir)
    with traced_graphs() as graphs:
        model.fit(**healthy, callbacks=[watch], verbose=0)
        healthy_incident = watch.incident
        model.fit(**kwargs, callbacks=[watch], verbose=0)
    bundle = tb_nanwatch.load_bundle(os.path.join(log_dir, "stage_2"))
    return {
        "healthy_incident": healthy_incident,
        "incident": watch.incident,
        "steps": watch.journal.steps,
        "traces": len({id(g) for g in graphs}),
        "bundle_info": {k: bundle.info[k] for k in ("batch_of_step", "exact")},
    }


def mirrored(out, log_dir):
    from nanwatch_testlib import logical_cpus

    logical_cpus(2)
    import scenarios

    result = {"single": _fit(os.path.join(log_dir, "single"))}
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    result["mirrored"] = _fit(os.path.join(log_dir, "mirrored"), strategy)
    result["mirrored_later_fit"] = _later_fit(os.path.join(log_dir, "later"), strategy)

    def data(_pipeline):
        return scenarios.ratio_data(ZERO_STEP, STEPS)

    result["mirrored_custom_loop"] = _custom_loop(
        os.path.join(log_dir, "mirrored_loop"), strategy, data
    )
    with open(out, "w") as f:
        json.dump(_jsonable(result), f)


def multiworker(out, log_dir):
    import scenarios

    strategy = tf.distribute.MultiWorkerMirroredStrategy()

    def data(pipeline):
        # Each worker reads its own shard; only worker 1's has the zero
        # denominator, at step ZERO_STEP, row 1 of its 4-row shard.
        num, den, y_main, y_aux = scenarios.ratio_data(
            ZERO_STEP, STEPS, zero_row=1, seed=20 + pipeline
        )
        if pipeline != 1:
            den[den == 0] = 1.0
        half = BATCH // 2
        keep = [i for i in range(len(den)) if (i % BATCH) < half]
        return num[keep], den[keep], y_main[keep], y_aux[keep]

    result = _custom_loop(log_dir, strategy, data)
    result["task"] = json.loads(os.environ["TF_CONFIG"])["task"]
    with open(out, "w") as f:
        json.dump(_jsonable(result), f)


if __name__ == "__main__":
    mode, out, log_dir = sys.argv[1:4]
    {"mirrored": mirrored, "multiworker": multiworker}[mode](out, log_dir)
