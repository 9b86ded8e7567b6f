"""Variables created while a step is traced, kept from the tf.function tracing it.

A ``tf.function`` whose first trace creates variables throws that trace away:
it traces the step again and runs only the second trace. Variables created
eagerly (under ``tf.init_scope``) inside :func:`hidden_from_tf_function` are
not counted, so a first trace that creates only those is the one that runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import tensorflow as tf


@contextlib.contextmanager
def hidden_from_tf_function(hidden: bool = True):
    """Variables created inside are not seen by the tf.function being traced
    (when ``hidden``; create them under ``tf.init_scope``)."""
    if not hidden:
        yield
        return

    def unlifted(next_creator, **kwargs):
        # tf.function counts (and lifts) only the variables it may lift.
        return next_creator(**{**kwargs, "experimental_enable_variable_lifting": False})

    with tf.variable_creator_scope(unlifted):
        yield


@contextlib.contextmanager
def seen_creations():
    """Yields a list that gains one name per variable created inside that
    the tf.function being traced sees (and so traces the step again for)."""
    created: list = []

    def counting(next_creator, **kwargs):
        if kwargs.get("experimental_enable_variable_lifting") is not False:
            created.append(kwargs.get("name"))
        return next_creator(**kwargs)

    with tf.variable_creator_scope(counting):
        yield created


def built_unseen(build: Callable[[], object]) -> bool:
    """Runs ``build`` eagerly, the variables it creates hidden from the
    tf.function being traced; whether it worked (if not, the caller leaves
    the building to the trace, as without NanWatch)."""
    try:
        with tf.init_scope(), hidden_from_tf_function():
            build()
    except Exception:  # noqa: BLE001 - built in the trace instead
        return False
    return True
