"""Replay, then trials: what follows an incident, in one place.

After training stops (the session's ``close``), at a rewind (``recovery.py``,
the trials only) and in ``tb-nanwatch replay`` (``cli.py``), the same steps
run, in this order (:func:`replay_then_trials`):

1. the replay, when there is a bundle to replay: the incident's step re-run
   eagerly from its exact bundle to name the op and its source line
   (``replay.py``); the answer is written beside the bundle (``replay.json``)
   and handed to the caller's ``named``;
2. the caller's ``then``: the session closes its record here, so that the
   op is in it and the record is safe on disk before the trials, which take
   a while (False: no trials);
3. ``trials`` says what the trials need (:class:`TrialInput`, read now: after
   the op is named and the record closed; None: no trials); a cause without
   a remedy to try runs none;
4. the remedy trials (``trials.py``), written to ``<run dir>/repro/trials.json``
   (``trials_file.py``).

The caller's :class:`Hooks` say what it does after the replay (``named``),
between the two (``then``) and on a failure of either (``failed(stage,
error)``, ``stage`` ``"replay"`` or ``"trials"``, which may raise it again;
without it the error is raised). The trials' progress goes to the caller's
``progress`` (default: one updating console line, ``console.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from tb_nanwatch.evidence.options import WatchOptions
from tb_nanwatch.evidence.printable import printable
from tb_nanwatch.record.after_incident import replay as replays
from tb_nanwatch.record.after_incident import trials as remedy_trials
from tb_nanwatch.record.after_incident import trials_file
from tb_nanwatch.record.after_incident.bundle import ReproBundle
from tb_nanwatch.record.after_incident.console import CONSOLE
from tb_nanwatch.record.after_incident.replay import OpOrigin
from tb_nanwatch.record.after_incident.trial_episodes import TrialData
from tb_nanwatch.record.after_incident.trials import Progress, TrialList


@dataclasses.dataclass(frozen=True)
class TrialInput:
    """What the trials need: the cause (their remedies), the step they are of
    (for the trials file), the run's options (the budget, the explosion line)
    and a reader of what they start from (called only when the cause offers a
    remedy to try)."""

    cause: dict | None
    step: int | None
    options: WatchOptions
    data: Callable[[], TrialData]


@dataclasses.dataclass(frozen=True)
class Hooks:
    """How the caller takes part: ``named(op)`` after the replay, ``then()``
    between the replay and the trials (False: no trials), ``failed(stage,
    error)`` on a failure (None: raised) and ``progress`` for the trials'
    lines (None: stderr)."""

    named: Callable[[OpOrigin | None], None] | None = None
    then: Callable[[], bool] | None = None
    failed: Callable[[str, Exception], None] | None = None
    progress: Progress | None = None


@dataclasses.dataclass
class FollowUp:
    """What the sequence found: the replay's op (None: not replayed, nothing
    named, or failed) and the trials (None: not run, only advice, or failed)."""

    origin: OpOrigin | None = None
    trials: TrialList | None = None


def replay_then_trials(
    model,
    loss_fn: Callable | None,
    run_dir: str,
    replay: Callable[[], ReproBundle] | None = None,
    trials: Callable[[], TrialInput | None] | None = None,
    hooks: Hooks = Hooks(),
) -> FollowUp:
    """The replay of the bundle ``replay`` returns (None: no replay), then the
    remedy trials ``trials`` asks for (None: none), on ``model`` with
    ``loss_fn`` (a custom loop's loss; None: the compiled model's own), the
    trials file written in ``run_dir``; see the module docstring."""
    done = FollowUp()
    if replay is not None:
        try:
            saved = replay()
            origin = replays.replay_step(model, saved, loss_fn)
            replays.write_result(saved, origin)
        except Exception as error:  # noqa: BLE001 - the caller says what a failure does
            _failed(hooks.failed, "replay", error)
        else:
            done.origin = origin
            if hooks.named is not None:
                hooks.named(origin)
    if (hooks.then is not None and not hooks.then()) or trials is None:
        return done
    try:
        wanted = trials()
        if wanted is None or not wanted.cause or not wanted.cause.get("remedy_ids"):
            return done
        try:
            found = remedy_trials.run_trials(
                model, wanted.cause, wanted.data(), loss_fn, wanted.options, hooks.progress
            )
        finally:
            CONSOLE.end_progress()  # an updating progress line ends before what follows
        if not found:
            return done  # only advice: nothing to try
        trials_file.write_trials(run_dir, wanted.step, wanted.cause, found)
    except Exception as error:  # noqa: BLE001 - the caller says what a failure does
        _failed(hooks.failed, "trials", error)
        return done
    done.trials = found
    return done


def _failed(failed: Callable[[str, Exception], None] | None, stage: str, error: Exception) -> None:
    if failed is None:
        raise error
    failed(stage, error)


def print_tried(found: TrialList, run_dir: str) -> None:
    """The trials' outcome in two console lines: how many remedies worked and
    where every trial is, then the best one in words (the first tried when
    none worked)."""
    lines = remedy_trials.tried_lines(found)
    fixed = sum(1 for trial in found if trial.outcome == "fixed")
    first = f"  {'best' if fixed else 'first tried'}: {lines[0]}" if lines else "  none tried"
    CONSOLE.lines(
        [
            printable(
                "NanWatch remedies, tried on a re-run of the recorded steps: "
                f"{fixed} of {len(lines)} worked (each: tb-nanwatch report {run_dir})"
            ),
            printable(first),
        ]
    )
