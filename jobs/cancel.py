"""Stopping work: cancel a run, cancel a whole Celery canvas by its root id, time out a run
past its max_duration, force-release a device's lock."""

from __future__ import annotations

from django.db.models import Q

from devices.locks import device_lock_pass_on, device_lock_state
from devices.models import Device

from .engine.batch import attempt_end_apply, rows_start, run_cancel_apply, run_time_out_apply
from .engine.kinds import run_deadline
from .engine.plan import holder_step_id
from .events import event_record
from .models import (
    RUN_TERMINAL,
    STEP_IN_FLIGHT,
    CanvasLink,
    JobRun,
    RunEvent,
    RunStatus,
    StepRun,
    StepStatus,
)

# The event that marks a canvas canceled (no run; data: root_id, by). The database, not Redis,
# holds it, so a Redis restart cannot let a canceled canvas start commands again; it goes
# with the other events of no run (IOTQUEUE_ORPHAN_EVENT_RETENTION_DAYS).
CANVAS_CANCELED = "canvas.canceled"


def run_cancel(*, run: JobRun, by: str) -> bool:
    """Cancel a pending or running run; False when it had already ended.

    One transition (jobs/engine/batch.py `run_cancel_apply`, planned by
    `planner.cancel_plan`): queued steps leave their device queue; an in-flight step's
    device gets a `cancel` command for it and the lock is handed on at once (the device's
    late `done` for the canceled command is recorded as stale).
    """
    canceled = run_cancel_apply(str(run.pk), reason=f"canceled by {by or 'unknown'}")
    if canceled:
        run.status = RunStatus.CANCELED
    return canceled


def canvas_canceled_by(root_id: str) -> str | None:
    """Who canceled the canvas of this root id, or None while it is not canceled.

    One query on the event kind's index. How it fails: raises DatabaseError without the
    database; the park task retries on it, so no command starts unchecked.
    """
    event = RunEvent.objects.filter(kind=CANVAS_CANCELED, data__root_id=root_id).only("data").first()
    return event.data.get("by", "") if event is not None else None


def canvas_links(root_id: str):
    """The links (`CanvasLink`) of the canvas whose root task has this id: the root itself
    when it was a device command, and every link that inherited it as `root_id`."""
    return CanvasLink.objects.filter(Q(request__root_id=root_id) | Q(task_id=root_id))


def canvas_cancel(*, root_id: str, by: str) -> int | None:
    """Cancel a whole canvas: every run of it that has not ended, and its later commands.

    Returns how many runs were canceled, or None when no device command of that root id
    was ever parked (an unknown canvas). The marker is set first, then the runs are read:
    a command parking meanwhile either sees the marker before it starts a run, or its
    run is committed before the read and canceled here, or it reads the marker after its
    commit and cancels its own run (jobs/canvas.py `canvas_park`). Each run is canceled
    through `run_cancel`, so its timeline says who canceled it, and its link fails
    (DeviceCommandFailed): its chain stops and its errbacks run.
    """
    if not canvas_links(root_id).exists():
        return None
    who = by or "unknown"
    if canvas_canceled_by(root_id) is None:
        event_record(CANVAS_CANCELED, message=f"canvas {root_id} canceled by {who}", root_id=root_id, by=who)
    runs = JobRun.objects.filter(canvas_link__in=canvas_links(root_id)).exclude(status__in=RUN_TERMINAL)
    return sum(run_cancel(run=run, by=who) for run in runs.order_by("created_at"))


@run_deadline("run")
def run_time_out(run_id: str) -> None:
    """The `run` deadline: a run still running past its max_duration ends.

    Its rows at work end `timed_out` as a cancel ends them (in-flight commands get a `cancel`,
    locks are handed on), rows not started are skipped; then the current step's policy
    decides as for a step that timed out: `rollback` compensates (the run ends compensated
    or failed), `abort` and `continue` end the run `timed_out`. A run that ended, or is
    compensating, is left alone. One transition (jobs/engine/batch.py `run_time_out_apply`,
    planned by `planner.run_time_out_plan`).
    """
    run_time_out_apply(run_id)


def lock_force_release(*, device: Device, by: str) -> str | None:
    """Take the lock from whoever holds it (audited); returns the holder it was taken from.

    A step that held it has its attempt ended as failed (retried if it has budget left).
    """
    state = device_lock_state(device.name)
    if state.holder is None:
        return None
    reason = f"lock force-released by {by or 'unknown'}"
    step_id = holder_step_id(state.holder)
    step_run = None
    if step_id is not None:
        step_run = StepRun.objects.select_related("run", "device").filter(pk=step_id).first()
    event_record(
        "lock.force_released",
        run=step_run.run if step_run else None,
        device=device.name,
        message=reason,
        holder=state.holder,
        fence=state.fence,
    )
    if step_run is not None and step_run.status in STEP_IN_FLIGHT and step_run.fence == state.fence:
        attempt_end_apply(step_run.pk, fence=state.fence, error=reason)
        return state.holder
    device_lock_pass_on(device.name, holder=state.holder, fence=state.fence or 0, force=True)
    if step_run is not None and step_run.status == StepStatus.QUEUED:
        rows_start([step_run.pk])  # granted but not sent yet (e.g. spaced): back in the queue
    return state.holder
