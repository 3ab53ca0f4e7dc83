"""Stopping work: cancel a run, time out a run past its max_duration, force-release a
device's lock."""

from __future__ import annotations

from functools import partial

from django.db import transaction
from django.utils import timezone

from devices.locks import device_lock_dequeue, device_lock_pass_on, device_lock_state
from devices.models import Device

from .deadlines import KINDS, Deadline, deadlines_clear
from .engine.batch import run_cancel_apply
from .engine.dispatch import cancel_command_send, step_acquire
from .engine.kinds import failure_policy_handler, row_commanded, run_deadline
from .engine.plan import holder_step_id, step_holder
from .engine.runs import attempt_end_continue, run_finish, run_step_done
from .events import event_record
from .models import (
    STEP_IN_FLIGHT,
    STEP_TERMINAL,
    JobRun,
    OnFailure,
    Phase,
    RunStatus,
    StepRun,
    StepStatus,
)


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


def step_cancel(*, step_run: StepRun, reason: str, status: str = StepStatus.CANCELED) -> None:
    """End a row that has not ended as `status` (canceled, or timed_out by max_duration): the
    device gets a `cancel` for an in-flight command, the lock is handed on or left."""
    previous = step_run.status
    if not StepRun.objects.filter(pk=step_run.pk, status=previous, attempt=step_run.attempt).update(
        status=status, error=reason, finished_at=timezone.now()
    ):
        return  # it moved on meanwhile; a finished attempt needs no cancel
    step_run.status = status
    deadlines_clear([Deadline.of(kind, step_run) for kind in KINDS])
    if previous in STEP_IN_FLIGHT and step_run.command_id:
        # A task step's body is not interrupted: its outcome will be stale.
        if row_commanded(step_run):
            transaction.on_commit(partial(cancel_command_send, step_run))
        if step_run.device_id:
            device_lock_pass_on(step_run.device.name, holder=step_holder(step_run), fence=step_run.fence)
    elif step_run.device_id:
        device_lock_dequeue(step_run.device.name, holder=step_holder(step_run))
    event_record(f"step.{status}", step_run=step_run, message=reason)


@run_deadline("run")
def run_time_out(run_id: str) -> None:
    """The `run` deadline: a run still running past its max_duration ends.

    Its rows at work end `timed_out` as a cancel ends them (in-flight commands get a `cancel`,
    locks are handed on), rows not started are skipped; then the current step's policy
    decides as for a step that timed out: `rollback` compensates (the run ends compensated
    or failed), `abort` and `continue` end the run `timed_out`. A run that ended, or is
    compensating, is left alone. Runs inside the deadline task's transaction.
    """
    run = JobRun.objects.select_for_update().filter(pk=run_id, status=RunStatus.RUNNING).first()
    if run is None or run.deadline is None or run.deadline > timezone.now():
        return
    reason = f"run exceeded its max_duration ({run.max_duration}s)"
    rows = run.step_runs.select_related("run", "device").filter(phase=Phase.FORWARD)
    for step_run in rows.exclude(status__in=STEP_TERMINAL):
        if step_run.status == StepStatus.PENDING:  # a fan-out row not started
            StepRun.objects.filter(pk=step_run.pk, status=StepStatus.PENDING).update(
                status=StepStatus.SKIPPED, error=reason, finished_at=timezone.now()
            )
        else:
            step_cancel(step_run=step_run, reason=reason, status=StepStatus.TIMED_OUT)
    index = min(run.cursor, len(run.plan) - 1)
    # A policy of its own (a rollback) handles the step's time-out; abort and continue end the run.
    if failure_policy_handler(run.plan[index].get("on_failure", OnFailure.ABORT)) is not None:
        run_step_done(run=run, index=index, ok=False, status=StepStatus.TIMED_OUT, error=reason)
    else:
        run_finish(run=run, status=RunStatus.TIMED_OUT, error=reason)


@transaction.atomic
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
        attempt_end_continue(
            step_run=step_run, command_id=step_run.command_id, ok=False, error=reason, retryable=True
        )
        return state.holder
    device_lock_pass_on(device.name, holder=state.holder, fence=state.fence or 0, force=True)
    if step_run is not None and step_run.status == StepStatus.QUEUED:
        step_acquire(step_run=step_run)  # granted but not sent yet (e.g. spaced): back in the queue
    return state.holder
