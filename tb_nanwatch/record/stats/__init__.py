"""How one step's statistics are built: a backend per kind of graph.

:func:`~tb_nanwatch.record.stats.choose.for_current_graph` picks, once for
the step being built, :class:`~tb_nanwatch.record.stats.graph.GraphStats`
(TensorFlow's graph executor, or eager) or
:class:`~tb_nanwatch.record.stats.xla.XlaStats` (a step XLA compiles). The
backend holds everything the build caches (constants, traced functions,
each tensor's shared results) for that one step.
"""
