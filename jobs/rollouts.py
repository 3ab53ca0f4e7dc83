"""Steering a rollout in waves: pause, resume, approve the next wave, abort; the webhook's answer.

Each action runs under the run's row lock (as the engine's own decisions do, jobs/engine/
fanout_progress.py), so an operator's click and a wave ending at the same moment are decided one
after the other, never both; each is a RunEvent naming who decided (`by`: a user name,
"webhook" or "auto").
"""

from __future__ import annotations

from django.db import transaction
from django.db.models import Count
from django.utils.translation import gettext as _

from .engine.fanout import fanout_stop
from .engine.fanout_progress import fanout_decide
from .engine.wave_gates import rollout_pause
from .events import event_record
from .models import JobRun, Phase, Rollout, RolloutState, RunStatus, StepRun

ACTIONS = ("pause", "resume", "approve", "abort")
# The states each action applies to (anything else: RolloutConflict, a 409).
PAUSABLE = (
    RolloutState.RUNNING,
    RolloutState.SOAKING,
    RolloutState.AWAITING_APPROVAL,
    RolloutState.AWAITING_WEBHOOK,
)
APPLIES = {
    "pause": PAUSABLE,
    "resume": (RolloutState.PAUSED,),
    "approve": (RolloutState.AWAITING_APPROVAL, RolloutState.AWAITING_WEBHOOK, RolloutState.SOAKING),
    "abort": (*PAUSABLE, RolloutState.PAUSED),
}
REASON_MAX_LENGTH = 500


class RolloutNotFound(LookupError):
    """The run has no rollout in waves (at that step)."""


class RolloutConflict(ValueError):
    """The action does not apply to the rollout as it stands (e.g. resume one not paused)."""


def run_rollout(run: JobRun, step: int | None = None) -> Rollout:
    """The run's rollout at `step`, or its latest one; RolloutNotFound if it has none."""
    rollouts = Rollout.objects.filter(run=run)
    if step is not None:
        rollouts = rollouts.filter(index=step)
    rollout = rollouts.order_by("-index").first()
    if rollout is None:
        if step is None:
            raise RolloutNotFound(_("This run has no fan-out in waves (yet)."))
        raise RolloutNotFound(_("Step %(step)s of this run has no fan-out in waves (yet).") % {"step": step})
    return rollout


def rollout_act(*, run: JobRun, action: str, by: str, reason: str = "", step: int | None = None) -> Rollout:
    """Apply an operator's action to the run's rollout and return it as it stands after.

    pause: no more rows start (rows at work finish). resume: a paused rollout goes on (the
    open wave's rows start; a wave that already ended opens the next one, overriding its
    condition). approve: the gate (or soak) before the next wave opens it. abort: the rows
    not started are skipped and the step fails, as an abort criterion would.

    How it fails: RolloutNotFound without a rollout at that step; RolloutConflict when the
    action does not apply to its state, or the run is no longer at that step.
    """
    if action not in ACTIONS:
        raise RolloutConflict(_("Unknown action %(action)s.") % {"action": action})
    reason = reason[:REASON_MAX_LENGTH]
    with transaction.atomic():
        rollout = run_rollout(run, step)
        locked = JobRun.objects.select_for_update().filter(
            pk=run.pk, status=RunStatus.RUNNING, cursor=rollout.index
        )
        if not locked.exists():
            raise RolloutConflict(_("The run is no longer at this fan-out (it moved on or ended)."))
        rollout.refresh_from_db()
        if rollout.state not in APPLIES[action]:
            raise RolloutConflict(
                _("Cannot %(action)s a rollout that is %(state)s.")
                % {"action": action, "state": rollout.get_state_display()}
            )
        _apply(run=run, rollout=rollout, action=action, by=by, reason=reason)
    rollout.refresh_from_db()
    return rollout


def _apply(*, run: JobRun, rollout: Rollout, action: str, by: str, reason: str) -> None:
    index = rollout.index
    if action == "pause":
        rollout_pause(run=run, rollout=rollout, by=by, reason=reason)
        return
    if action == "abort":
        error = f"step {index}: rollout aborted by {by}" + (f": {reason}" if reason else "")
        fanout_stop(run=run, index=index, error=error, by=by, reason=reason)
        return
    kind = "rollout.resumed" if action == "resume" else "rollout.approved"
    verb = "resumed" if action == "resume" else "approved"
    message = f"{verb} by {by}" + (f": {reason}" if reason else "")
    rollout.state, rollout.reason, rollout.decided_by = RolloutState.RUNNING, "", by
    if action == "approve":
        # Approving skips what is left of a soak, and the gate: the wave's end was checked.
        rollout.wave_checked = True
    rollout.save()
    event_record(kind, run=run, message=message, index=index, by=by, reason=reason)
    fanout_decide(run=run, index=index)


def rollout_gate_answer(*, run_id: str, index: int, wave: int, approve: bool, detail: str) -> bool:
    """A webhook gate answered for `wave`: approve opens the next wave, anything else pauses
    with `detail` as the reason. False (nothing done) when the rollout no longer waits for
    that answer (an operator decided meanwhile, or the run moved on)."""
    with transaction.atomic():
        locked = JobRun.objects.select_for_update().filter(pk=run_id, status=RunStatus.RUNNING, cursor=index)
        run = locked.first()
        rollout = Rollout.objects.filter(run_id=run_id, index=index).first()
        if run is None or rollout is None:
            return False
        if rollout.state != RolloutState.AWAITING_WEBHOOK or rollout.wave != wave:
            return False
        if not approve:
            rollout_pause(run=run, rollout=rollout, by="webhook", reason=f"webhook: {detail}")
            return True
        rollout.state, rollout.reason, rollout.decided_by = RolloutState.RUNNING, "", "webhook"
        rollout.save()
        event_record(
            "rollout.approved", run=run, message=f"approved by webhook: {detail}", index=index, by="webhook"
        )
        fanout_decide(run=run, index=index)
    return True


def rollout_gate_request(*, run_id: str, index: int, wave: int) -> dict | None:
    """What a webhook gate is asked (its URL and the JSON body), or None when the rollout no
    longer waits for it."""
    rollout = Rollout.objects.filter(run_id=run_id, index=index).select_related("run__template").first()
    if rollout is None or rollout.state != RolloutState.AWAITING_WEBHOOK or rollout.wave != wave:
        return None
    spec = rollout.waves[wave]
    return {
        "url": spec["webhook_url"],
        "body": {
            "run": str(rollout.run_id),
            "template": rollout.run.template.name,
            "step": index,
            "wave": wave + 1,
            "waves": len(rollout.waves),
            "next_wave": wave + 2,
            # The wave that passed: its devices by status (a health check may weigh them).
            "counts": rollout_waves(rollout)[wave]["counts"],
        },
    }


def rollout_waves(rollout: Rollout) -> list[dict]:
    """Each wave of the rollout with its rows counted by status (one GROUP BY), for people:
    number (from 1), size, label, its condition and gate, counts, and whether it is open,
    done or to come."""
    counts: dict[int, dict[str, int]] = {}
    rows = StepRun.objects.filter(run_id=rollout.run_id, phase=Phase.FORWARD, index=rollout.index)
    for wave, status, n in rows.order_by().values_list("wave", "status").annotate(n=Count("pk")):
        counts.setdefault(wave, {})[status] = n
    waves = []
    for number, wave in enumerate(rollout.waves):
        if number < rollout.wave or (number == rollout.wave and rollout.state == RolloutState.ENDED):
            where = "done"
        elif number == rollout.wave:
            where = "open"
        else:
            where = "next"
        waves.append({**wave, "number": number + 1, "counts": counts.get(number, {}), "where": where})
    return waves
