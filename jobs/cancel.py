"""Stopping work: cancel a run, time out a run past its max_duration, force-release a
device's lock."""

from __future__ import annotations

from devices.locks import device_lock_pass_on, device_lock_state
from devices.models import Device

from .engine.batch import attempt_end_apply, rows_start, run_cancel_apply, run_time_out_apply
from .engine.kinds import run_deadline
from .engine.plan import holder_step_id
from .events import event_record
from .models import (
    STEP_IN_FLIGHT,
    JobRun,
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
