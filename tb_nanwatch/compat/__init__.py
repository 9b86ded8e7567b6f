"""NanWatch for code that is not TF2 Keras: ``tb_nanwatch.compat.v1`` (TF1
graph-mode code: placeholders, ``Session``, ``feed_dict``, a
``tf.compat.v1.train`` optimizer's ``minimize``, ``MonitoredTrainingSession``).

A front end like :mod:`tb_nanwatch.record`'s callback and custom-loop watcher:
the same statistics, run dir, record, tab, report, export and causes.
"""
