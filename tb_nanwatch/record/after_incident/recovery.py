"""The host side of ``on_nonfinite="skip"`` and ``"rewind"``.

The compiled step undoes a non-finite step itself (``record/in_step/step_undo.py``):
its weights, optimizer slots and iterations stay as before it. The session's
:class:`Recovery` learns which steps were undone from the rows it already
reads (the same rule, :class:`~tb_nanwatch.evidence.diagnosis.UndoneSteps`;
no extra device read) and:

* ``"skip"``: lists each one (``skipped_nonfinite_steps`` in the run
  summary, one console line each) and stops training after ``max_skips``;
* ``"rewind"``: at the first undone step or a newly confirmed explosion,
  runs the remedy trials (once, within ``trial_budget_s``), puts the weights
  and the optimizer's state back to the newest rewind point from before the
  onset, sets the best remedy whose trial said ``fixed`` and that a live run
  can take (``record/after_incident/live_remedies.py``) on the optimizer, tells the journal
  (the steps after are judged afresh) and goes on; the batches since the
  rewind point are not trained on again (the data iterator just continues).
  Each rewind is one entry of ``recoveries`` in the run summary (``step``,
  ``rewound_to``, ``remedy: {id, setting}``, ``skipped_batches``) and one
  console line; after ``max_rewinds`` the next one stops training. Without
  a remedy shown to work that a live run can take, it says so and skips from
  then on (``skip_fallback``).

Never raises into training: a failure is one warning, and the run goes on
skipping (the compiled step still undoes every non-finite step).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np

from tb_nanwatch.evidence import diagnosis
from tb_nanwatch.evidence import trials as evidence_trials
from tb_nanwatch.record.after_incident import follow_up, live_remedies, trials
from tb_nanwatch.record.after_incident.console import CONSOLE
from tb_nanwatch.record.after_incident.follow_up import TrialInput
from tb_nanwatch.record.after_incident.live_remedies import LiveChange, NotLive
from tb_nanwatch.record.after_incident.rewind_points import ONSET_MARGIN, Snapshot
from tb_nanwatch.record.after_incident.trial_replica import model_variables


class Recovery:
    """Skips and rewinds of one watched run (see the module docstring).

    ``session`` is the run's ``WatchSession``; ``trial_data`` reads what the
    remedy trials start from (the session's ``trial_data``: the bundle, the
    rewind point, the optimizer); ``retrace`` (given by the front end that can
    trace the step again, ``fit``'s, through :meth:`use_retrace`) makes the
    compiled step read an optimizer setting that is read at trace time.
    """

    def __init__(self, session, trial_data: Callable[[], trials.TrialData]) -> None:
        self.session = session
        self.trial_data = trial_data
        self.options = session.options
        self.rule: diagnosis.UndoneSteps | None = None
        self.skipped: list[int] = []
        self.recoveries: list[dict] = []
        self.fallback: dict | None = None
        self.stop_reason: str | None = None
        self.stop_step: int | None = None
        self.trials: trials.TrialList | None = None
        self.trials_ran = False
        self.retrace: Callable[[], None] | None = None
        self._applied: list[str] = []
        self._undone: list[int] = []
        self._kept: list[int] = []  # non-finite steps the compiled step could not undo
        self._explosion_seen: dict | None = None
        self._cause: dict | None = None

    def use_retrace(self, retrace: Callable[[], None]) -> None:
        """How the front end traces the compiled step again (see the class docstring)."""
        self.retrace = retrace

    # -- per step ------------------------------------------------------------------

    def note(self, step: int, vector: np.ndarray, schema) -> None:
        """Notes whether the compiled step undid step ``step`` (its row ``vector``)."""
        if self.rule is None:
            whole_step = self.options.pre_step_weights == "every_step"
            self.rule = diagnosis.UndoneSteps(schema, whole_step)
        verdict = self.rule.verdict(vector)
        if verdict == "undone":
            self._undone.append(step)
        elif verdict == "kept":
            self._kept.append(step)

    def after_steps(self) -> bool:
        """Acts on the steps noted since the last call; True when training
        is to stop now (once: ``stop_reason`` says why). Never raises."""
        undone, self._undone = self._undone, []
        kept, self._kept = self._kept, []
        if self.stop_reason is not None:
            return False
        try:
            explosion = self._new_explosion()
            if self._rewinding() and (undone or kept or explosion):
                self._rewind(undone, kept, explosion)
            else:
                self._skip(undone)
                self._cannot_undo(kept)
        except Exception as error:  # noqa: BLE001 - never break the user's training
            warnings.warn(
                f"NanWatch could not recover: {error!r}; non-finite steps are skipped from now on",
                RuntimeWarning,
                stacklevel=2,
            )
            self.fallback = self.fallback or {"step": self._last_step(), "why": repr(error)}
            self._skip(undone)
            self._cannot_undo(kept)
        return self.stop_reason is not None

    def _rewinding(self) -> bool:
        return self.options.on_nonfinite == "rewind" and self.fallback is None

    def _new_explosion(self) -> dict | None:
        journal = self.session.journal
        latest = None if journal is None else journal.latest_explosion
        if latest is None or latest is self._explosion_seen:
            return None
        self._explosion_seen = latest
        return latest if self._rewinding() else None

    def _last_step(self) -> int:
        return max(self.session.step - 1, 0)

    # -- skip --------------------------------------------------------------------------

    def _skip(self, undone: list[int]) -> None:
        for step in undone:
            self.skipped.append(step)
            CONSOLE.lines(
                f"NanWatch: step {step} was not applied (non-finite; weights and optimizer state "
                f"kept from before it; {len(self.skipped)} skipped, max_skips="
                f"{self.options.max_skips})"
            )
            if len(self.skipped) > self.options.max_skips:
                self._stop(
                    f"{len(self.skipped)} non-finite steps skipped, more than max_skips="
                    f"{self.options.max_skips}",
                    step,
                )
                break
        if undone:
            self._publish()

    def _cannot_undo(self, kept: list[int]) -> None:
        """A non-finite step that stayed applied: its weights are not finite,
        and skipping the steps after it cannot help; training stops."""
        if kept and self.stop_reason is None:
            self._stop(
                f"step {kept[0]} went non-finite in the optimizer's update, which cannot be "
                "undone with pre_step_weights='on_suspect' (the weights are copied only when "
                "the step is non-finite before the update); use pre_step_weights='every_step'",
                kept[0],
            )

    def _stop(self, reason: str, step: int) -> None:
        self.stop_reason, self.stop_step = reason, step
        CONSOLE.lines(f"NanWatch: {reason}: training stopped")
        self._publish()

    # -- rewind -----------------------------------------------------------------------

    def _rewind(self, undone: list[int], kept: list[int], explosion: dict | None) -> None:
        step = min(undone + kept) if undone or kept else self._last_step()
        if len(self.recoveries) >= self.options.max_rewinds:
            self._stop(
                f"a non-finite step or an explosion at step {step} after "
                f"{len(self.recoveries)} rewind(s), max_rewinds={self.options.max_rewinds}",
                step,
            )
            return
        journal = self.session.journal
        journal.settle()
        explosion = explosion or self._new_explosion()
        onset = None if explosion is None else int(explosion["step"])
        snapshot, why = self._snapshot(step, onset)
        change = None
        if snapshot is not None:
            self._run_trials(step)
            change, why = self._choose_remedy()
        if change is None:
            self._fall_back(step, why, undone)
            self._cannot_undo(kept)
            return
        recorder = self.session.recorder
        restore_snapshot(recorder.model, recorder.optimizer, snapshot)
        change.apply()
        if change.retrace:
            self.retrace()
        journal.mark_rewind()
        self._explosion_seen = journal.latest_explosion
        self._applied.append(change.remedy)
        self._drop_snapshots_after(snapshot.step)
        self._record_rewind(step, snapshot, change, onset)

    def _record_rewind(
        self, step: int, snapshot: Snapshot, change: LiveChange, onset: int | None
    ) -> None:
        last = self._last_step()
        entry = {
            "step": int(step),
            "rewound_to": int(snapshot.step),
            "remedy": {"id": change.remedy, "setting": change.setting},
            "skipped_batches": int(last - snapshot.step + 1),
        }
        if onset is not None:
            entry["onset"] = onset
        self.recoveries.append(entry)
        CONSOLE.lines(
            f"NanWatch: rewound to the state before step {snapshot.step} "
            f"(rewind {len(self.recoveries)} of max_rewinds={self.options.max_rewinds}): "
            f"{change.remedy} applied ({change.setting}); the batches of steps "
            f"{snapshot.step}-{last} are not trained on again; training goes on"
        )
        self._publish()

    def _fall_back(self, step: int, why: str, undone: list[int]) -> None:
        self.fallback = {"step": int(step), "why": why}
        CONSOLE.lines(
            f"NanWatch: no rewind at step {step}: {why}. Falling back to skip: non-finite "
            f"steps are not applied (max_skips={self.options.max_skips})"
        )
        self._skip(undone)
        self._publish()

    def _snapshot(self, step: int, onset: int | None) -> tuple[Snapshot | None, str]:
        """The newest snapshot from before the onset (the oldest kept when
        none is), or None and why there is none."""
        ring = self.session.rewind
        if ring is None:
            return None, "rewind points are off (rewind_every=0)"
        ring.settle(wait=True)  # a snapshot still being written counts
        if ring.not_taken_why is not None:
            return None, f"no rewind point is kept ({ring.not_taken_why})"
        kept = [s for s in ring.snapshots if s.step <= step]
        if not kept:
            return None, f"no rewind point from before step {step}"
        if not any(s.optimizer_built for s in kept):
            return None, "the only rewind point is from before the optimizer was built"
        kept = [s for s in kept if s.optimizer_built]
        target = step if onset is None else min(step, onset - ONSET_MARGIN)
        before = [s for s in kept if s.step <= target]
        return (max(before, key=_step) if before else min(kept, key=_step)), ""

    def _drop_snapshots_after(self, step: int) -> None:
        """The snapshots after the rewound one hold the failing run's state."""
        self.session.rewind.drop_after(step)

    # -- remedies -------------------------------------------------------------------------

    def _run_trials(self, step: int) -> None:
        """The remedy trials, once a run (the session's, run now instead of
        at the end), their file and their console lines."""
        if self.trials_ran:
            return
        self.trials_ran = True
        session = self.session
        if not self.options.remedy_trials or session.worker is not None:
            return
        done = follow_up.replay_then_trials(
            session.recorder.model,
            session.replay_loss,
            session.log_dir,
            trials=lambda: self._trial_input(step),
        )
        self.trials = done.trials
        if done.trials:
            follow_up.print_tried(done.trials, session.log_dir)

    def _trial_input(self, step: int) -> TrialInput:
        self._cause = self.session.journal.cause()
        return TrialInput(self._cause, step, self.options, self.trial_data)

    def _choose_remedy(self) -> tuple[LiveChange | None, str]:
        """The best remedy whose trial said ``fixed`` that this run can take
        and that is not set yet, or None and why there is none. In the order
        of :func:`evidence_trials.rank`: the first *learning* fix (its loss
        kept going down) that a live run can take; a fix that stopped learning
        only when no fix kept learning (never over one that the run cannot
        take live: the run would go on without learning)."""
        if not self.trials:
            if not self.options.remedy_trials:
                return None, "the remedy trials are off (remedy_trials=False)"
            return None, "no remedy was tried for this cause"
        by_id = evidence_trials.by_remedy(self.trials)
        learns = any(t.outcome == "fixed" and t.learning is True for t in self.trials)
        reasons = []
        for remedy in evidence_trials.rank(list(by_id), self.trials):
            trial = by_id[remedy]
            if trial.outcome == "cannot_verify":
                # Not shown to fail either: said as such, never "did not help".
                reasons.append(f"{remedy}: {evidence_trials.trial_text(trial)}")
                continue
            if trial.outcome != "fixed" or remedy in self._applied:
                continue
            if learns and trial.learning is not True:
                reasons.append(
                    f"{remedy} kept the trial finite but stopped learning: not set over a fix "
                    "that kept learning"
                )
                continue
            if not live_remedies.is_live(remedy):
                reasons.append(f"{remedy} kept the trial finite but cannot be set on a live run")
                continue
            try:
                change = live_remedies.plan(
                    remedy, trial, self.session.recorder.optimizer, self._cause
                )
            except NotLive as why:
                reasons.append(f"{remedy}: {why}")
                continue
            if change.retrace and self.retrace is None:
                reasons.append(f"{remedy} needs the train step traced again (your own tf.function)")
                continue
            return change, ""
        return None, "; ".join(reasons) or "no remedy shown to work that is not set already"

    # -- the record -------------------------------------------------------------------------

    def summary(self) -> dict:
        """What the run summary holds of the recovery."""
        out: dict = {
            "skipped_nonfinite_steps": list(self.skipped),
            "recoveries": [dict(r) for r in self.recoveries],
        }
        if self.fallback is not None:
            out["skip_fallback"] = dict(self.fallback)
        if self.stop_reason is not None:
            out["recovery_stopped"] = {"step": self.stop_step, "why": self.stop_reason}
        return out

    def _publish(self) -> None:
        journal = self.session.journal
        if journal is None:
            return
        journal.update_run_info(**self.summary())
        journal.flush()


def _step(snapshot: Snapshot) -> int:
    return snapshot.step


def restore_snapshot(model, optimizer, snapshot: Snapshot) -> None:
    """Assigns ``snapshot``'s weights to ``model`` and its optimizer state to
    ``optimizer``, matched by variable path; every shape is checked before
    anything is assigned. The learning-rate variable keeps its current value
    (a remedy set since, or the user's own changes)."""
    rates = {
        id(getattr(o, "_learning_rate", None))
        for o in (optimizer, getattr(optimizer, "inner_optimizer", None))
        if o is not None
    }
    variables = [v for v in getattr(optimizer, "variables", [])]
    pairs = _matched(model_variables(model), snapshot.weights)
    if len(pairs) != len(snapshot.weights):  # a snapshot of the weights alone
        pairs = _matched(list(model.weights), snapshot.weights)
    if len(pairs) != len(snapshot.weights):
        raise ValueError("the rewind point's weights are not the model's (other variable paths)")
    pairs += [(v, a) for v, a in _matched(variables, snapshot.optimizer) if id(v) not in rates]
    for variable, value in pairs:
        if tuple(variable.shape) != tuple(np.shape(value)):
            raise ValueError(
                f"the rewind point's {variable.path} has shape {np.shape(value)}, "
                f"the model's {tuple(variable.shape)}"
            )
    for variable, value in pairs:
        variable.assign(value)


def _matched(variables: list, values: dict[str, np.ndarray]) -> list[tuple]:
    """(variable, value) by path, a repeated path numbered as the snapshot's
    keys are (``<path>#1``, ...)."""
    out, seen = [], set()
    for v in variables:
        name = str(getattr(v, "path", None) or v.name)
        key, n = name, 1
        while key in seen:
            key, n = f"{name}#{n}", n + 1
        seen.add(key)
        if key in values:
            out.append((v, values[key]))
    return out
