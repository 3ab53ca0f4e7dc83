"""Step kinds that wait without a worker or a lock: a delay, or until a device is online."""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

from ..deadlines import Deadline, deadlines_set
from ..events import event_record
from ..models import JobRun, Phase, StepKind, StepRun, StepStatus
from .batch import run_continue, step_row_queue
from .kinds import deadline_handler, row_deadline, row_resume, step_kind


# A delay holds no device: there is nothing to compensate.
@step_kind(StepKind.DELAY, compensable=False)
def delay_start(run: JobRun, index: int) -> None:
    """Wait plan[index].delay_seconds in the deadline set; the monitor's `wake` ends it."""
    spec = run.plan[index]
    now = timezone.now()
    step_run, created = StepRun.objects.get_or_create(
        run=run,
        phase=Phase.FORWARD,
        index=index,
        device=None,
        defaults={
            "action": "delay",
            "status": StepStatus.IN_PROGRESS,
            "queued_at": now,
            "dispatched_at": now,
            "deadline": now + timedelta(seconds=spec["delay_seconds"]),
        },
    )
    if created:
        step_run.run = run
        deadlines_set({Deadline.of("wake", step_run, 0): step_run.deadline})
        event_record("step.waiting", step_run=step_run, message=f"delay {spec['delay_seconds']}s")


def delay_end(*, step_run: StepRun) -> None:
    if StepRun.objects.filter(pk=step_run.pk, status=StepStatus.IN_PROGRESS).update(
        status=StepStatus.SUCCEEDED, finished_at=timezone.now(), result={}
    ):
        step_run.status = StepStatus.SUCCEEDED
        event_record("step.succeeded", step_run=step_run, message="delay over")
        run_continue(step_run=step_run)


@row_deadline(StepKind.DELAY)
@deadline_handler("wake")
def delay_due(step_run: StepRun, deadline: Deadline) -> None:
    """Whatever found a delay's row due (its `wake`, the database sweep), the delay is over."""
    delay_end(step_run=step_run)


@step_kind(StepKind.WAIT_ONLINE, queue_timeout_error="device {device} did not come online within {seconds}s")
def wait_online_start(run: JobRun, index: int) -> None:
    wait_online_check(step_run=step_row_queue(run, index, acquire=False))


@row_resume(StepKind.WAIT_ONLINE)
def wait_online_check(*, step_run: StepRun) -> bool:
    """Succeed a wait-for-online step if its device is reachable; else it stays queued
    (its queue deadline bounds the wait, jobs/presence.py re-checks on presence)."""
    if not step_run.device.reachable:
        deadlines_set({Deadline.of("queue", step_run): step_run.deadline})
        event_record("step.waiting", step_run=step_run, message=f"until {step_run.device.name} is online")
        return False
    if StepRun.objects.filter(pk=step_run.pk, status=StepStatus.QUEUED).update(
        status=StepStatus.SUCCEEDED, finished_at=timezone.now(), result={"online": True}
    ):
        step_run.status = StepStatus.SUCCEEDED
        event_record("step.succeeded", step_run=step_run, message=f"{step_run.device.name} is online")
        run_continue(step_run=step_run)
    return True
