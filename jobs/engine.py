"""The step engine: start steps, dispatch commands under the device lock, apply replies.

No function here waits for a device. A step is queued on its device's lock; when granted
it is dispatched (row committed with its command id and fence, then the command
published) and the function returns. The device's `done` comes back through the bridge as
a `step_reply` task, which completes the step, releases the lock (handing it to the next
waiter, who is dispatched at once) and starts the run's next step. The database row is the
truth about where a run stands; every transition is a compare-and-set plus a RunEvent, so
a task that runs twice (redelivery) or a reply that arrives twice changes nothing.

Transitions (step):   queued -> dispatched -> in_progress -> succeeded | failed
Transitions (run):    pending -> running -> succeeded | failed
"""

from __future__ import annotations

import logging
import uuid
from datetime import timedelta
from typing import Any

from django.db import transaction
from django.db.models.functions import Coalesce
from django.utils import timezone

from devices import protocol
from devices.locks import (
    Grant,
    device_lock_acquire,
    device_lock_extend,
    device_lock_handoff,
    device_lock_release,
    grant_handler_register,
    holder_name,
)
from devices.models import Device
from iotqueue.mqtt import PublishError, publisher

from . import templating
from .events import event_record
from .models import STEP_IN_FLIGHT, JobRun, OnFailure, RunStatus, StepRun, StepStatus

log = logging.getLogger(__name__)

HOLDER_KIND = "step"
# The lock lease outlives the step's own timeout by this much, so the timeout (a step
# outcome) always fires before the lease expiry (a crash-recovery path).
LEASE_GRACE_SECONDS = 30.0
# A command whose publish failed is sent again after this many seconds.
RESEND_DELAY_SECONDS = 2.0


def _holder(step_run: StepRun) -> str:
    return holder_name(HOLDER_KIND, step_run.pk)


def _spec(step_run: StepRun) -> dict[str, Any]:
    return step_run.run.plan[step_run.index]


def _lease_seconds(spec: dict[str, Any]) -> float:
    return float(spec["timeout_seconds"]) + LEASE_GRACE_SECONDS


# --- runs -----------------------------------------------------------------------------


def run_advance(*, run_id: str) -> None:
    """Start a pending run, or (re)start the step at a running run's cursor."""
    run = JobRun.objects.get(pk=run_id)
    if run.status == RunStatus.PENDING:
        now = timezone.now()
        if JobRun.objects.filter(pk=run.pk, status=RunStatus.PENDING).update(
            status=RunStatus.RUNNING, started_at=now
        ):
            run.status, run.started_at = RunStatus.RUNNING, now
            event_record("run.started", run=run, message=f"{len(run.plan)} steps")
    if run.status == RunStatus.RUNNING:
        step_start(run=run, index=run.cursor)


def run_finish(*, run: JobRun, status: str, error: str = "") -> bool:
    """Move a run to a terminal status (once); False when it already was terminal."""
    finished = JobRun.objects.filter(pk=run.pk, status__in=(RunStatus.PENDING, RunStatus.RUNNING)).update(
        status=status, error=error, finished_at=timezone.now()
    )
    if finished:
        run.status, run.error = status, error
        event_record(f"run.{status}", run=run, message=error)
    return bool(finished)


def _step_context(run: JobRun) -> dict[str, Any]:
    results = dict(
        StepRun.objects.filter(run=run, status=StepStatus.SUCCEEDED).values_list("index", "result")
    )
    steps: dict[str, Any] = {}
    for index, spec in enumerate(run.plan):
        entry = {"result": results.get(index)}
        steps[str(index)] = entry
        if spec.get("name"):
            steps[spec["name"]] = entry
    return {"params": run.parameters, "steps": steps, "run": {"id": str(run.pk)}}


# --- steps ----------------------------------------------------------------------------


def step_start(*, run: JobRun, index: int) -> None:
    """Create the step's row (once) and ask for its device's lock."""
    if index >= len(run.plan):
        run_finish(run=run, status=RunStatus.SUCCEEDED)
        return
    spec = run.plan[index]
    device = Device.objects.filter(name=spec["device"]).first()
    if device is None or not device.enabled:
        reason = f"device {spec['device']} {'is disabled' if device else 'does not exist'}"
        event_record("step.failed", run=run, device=spec["device"], message=reason, index=index)
        run_finish(run=run, status=RunStatus.FAILED, error=f"step {index}: {reason}")
        return
    try:
        args = templating.render(spec["args"], _step_context(run))
    except templating.TemplateError as exc:
        event_record("step.failed", run=run, device=device.name, message=str(exc), index=index)
        run_finish(run=run, status=RunStatus.FAILED, error=f"step {index}: {exc}")
        return
    step_run, created = StepRun.objects.get_or_create(
        run=run,
        index=index,
        device=device,
        defaults={
            "action": spec["action"],
            "args": args,
            "status": StepStatus.QUEUED,
            "queued_at": timezone.now(),
        },
    )
    step_run.run = run
    if created:
        event_record("step.queued", step_run=step_run, message=f"{device.name} {spec['action']}")
    if step_run.status == StepStatus.QUEUED:
        step_acquire(step_run=step_run)


def step_acquire(*, step_run: StepRun) -> None:
    """Take the device lock and dispatch, or wait in the device's queue (no worker waits)."""
    outcome = device_lock_acquire(
        step_run.device.name,
        holder=_holder(step_run),
        priority=step_run.run.priority,
        lease_seconds=_lease_seconds(_spec(step_run)),
    )
    if isinstance(outcome, Grant):
        step_dispatch(step_run_id=step_run.pk, fence=outcome.fence)
    else:
        event_record("step.waiting", step_run=step_run, message=f"device busy, position {outcome.position}")


def step_dispatch(*, step_run_id: int, fence: int) -> None:
    """Commit the attempt (command id, fence, deadline), then publish the command."""
    step_run = StepRun.objects.select_related("run", "device").get(pk=step_run_id)
    if step_run.status not in (StepStatus.QUEUED, StepStatus.RETRYING):
        if step_run.status in STEP_IN_FLIGHT and step_run.fence == fence:
            return  # redelivered: already dispatched under this grant
        _lock_pass_on(step_run.device.name, holder=_holder(step_run), fence=fence)
        return
    if step_run.run.status != RunStatus.RUNNING:
        _lock_pass_on(step_run.device.name, holder=_holder(step_run), fence=fence)
        return
    spec = _spec(step_run)
    now = timezone.now()
    attempt = step_run.attempt + 1
    changes = {
        "status": StepStatus.DISPATCHED,
        "attempt": attempt,
        "command_id": uuid.uuid4().hex,
        "fence": fence,
        "deadline": now + timedelta(seconds=spec["timeout_seconds"]),
        "dispatched_at": now,
    }
    with transaction.atomic():
        claimed = StepRun.objects.filter(
            pk=step_run.pk, status=step_run.status, attempt=step_run.attempt
        ).update(**changes)
        if not claimed:
            return
        for field, value in changes.items():
            setattr(step_run, field, value)
        event_record("step.dispatched", step_run=step_run, message=f"attempt {attempt}, fence {fence}")
    device_lock_extend(
        step_run.device.name, holder=_holder(step_run), fence=fence, lease_seconds=_lease_seconds(spec)
    )
    command_send(step_run=step_run)


def command_send(*, step_run: StepRun) -> bool:
    """Publish the step's current command (QoS 1); on failure schedule a re-send."""
    payload = protocol.command_payload(
        command_id=step_run.command_id,
        run=str(step_run.run_id),
        step=step_run.index,
        attempt=step_run.attempt,
        token=step_run.fence,
        action=step_run.action,
        args=step_run.args,
        deadline=step_run.deadline.isoformat(),
    )
    try:
        publisher.publish(step_run.device.command_topic_for(step_run.action), payload)
    except PublishError as exc:
        event_record("step.publish_failed", step_run=step_run, message=str(exc))
        from .tasks import command_resend_task

        command_resend_task.apply_async((step_run.pk, step_run.command_id), countdown=RESEND_DELAY_SECONDS)
        return False
    return True


def command_resend(*, step_run_id: int, command_id: str) -> None:
    """Re-send a command whose publish failed, if it is still the step's current one."""
    step_run = (
        StepRun.objects.select_related("run", "device")
        .filter(pk=step_run_id, command_id=command_id, status__in=STEP_IN_FLIGHT)
        .first()
    )
    if step_run is not None:
        command_send(step_run=step_run)


def _lock_pass_on(device: str, *, holder: str, fence: int) -> None:
    """Release a lock this holder no longer needs and start whoever gets it next."""
    grant = device_lock_release(device, holder=holder, fence=fence)
    if grant is not None:
        device_lock_handoff(device, grant)


def _step_handoff(device: str, grant: Grant) -> None:
    step_dispatch(step_run_id=int(grant.holder.partition(":")[2]), fence=grant.fence)


grant_handler_register(HOLDER_KIND, _step_handoff)


# --- replies --------------------------------------------------------------------------


def step_reply(*, device: str, reply: protocol.Reply) -> None:
    """Apply a device's ack/progress/done to the step it answers, if it is current."""
    step_run = StepRun.objects.select_related("run", "device").filter(command_id=reply.command_id).first()
    if step_run is None:
        event_record(
            "reply.unknown", device=device, message=f"{reply.kind} for unknown command {reply.command_id}"
        )
        return
    if step_run.device.name != device:
        event_record(
            "reply.foreign_device",
            step_run=step_run,
            device=device,
            message=f"{device} answered a command of {step_run.device.name}; ignored",
        )
        return
    if reply.kind == "done":
        step_complete(step_run=step_run, reply=reply)
    else:
        step_progress(step_run=step_run, reply=reply)


def step_progress(*, step_run: StepRun, reply: protocol.Reply) -> None:
    """ack/progress: the device is working on the current attempt."""
    changes: dict[str, Any] = {
        "status": StepStatus.IN_PROGRESS,
        "acked_at": Coalesce("acked_at", timezone.now()),
    }
    if reply.progress is not None:
        changes["progress"] = reply.progress
    updated = StepRun.objects.filter(
        pk=step_run.pk, command_id=reply.command_id, status__in=STEP_IN_FLIGHT
    ).update(**changes)
    if not updated:
        event_record("reply.stale", step_run=step_run, message=f"{reply.kind} after the step ended")
    elif step_run.status == StepStatus.DISPATCHED:
        event_record("step.in_progress", step_run=step_run, message=f"{reply.kind} received")


def step_complete(*, step_run: StepRun, reply: protocol.Reply) -> None:
    """done: end the attempt (once), hand the device on, continue the run."""
    status = StepStatus.SUCCEEDED if reply.ok else StepStatus.FAILED
    with transaction.atomic():
        completed = StepRun.objects.filter(
            pk=step_run.pk, command_id=reply.command_id, status__in=STEP_IN_FLIGHT
        ).update(
            status=status,
            result=reply.result if reply.ok else None,
            error=reply.error,
            progress=100 if reply.ok else step_run.progress,
            finished_at=timezone.now(),
        )
        if completed:
            step_run.status, step_run.error, step_run.result = status, reply.error, reply.result
            event_record(f"step.{status}", step_run=step_run, message=reply.error)
        else:
            event_record("reply.stale", step_run=step_run, message="done for an attempt that already ended")
    if completed:
        step_finalize(step_run=step_run)


def step_finalize(*, step_run: StepRun) -> None:
    """After a step ended: release its device lock (hand-off) and move the run on."""
    if step_run.fence is not None:
        _lock_pass_on(step_run.device.name, holder=_holder(step_run), fence=step_run.fence)
    run = step_run.run
    spec = _spec(step_run)
    if step_run.status == StepStatus.SUCCEEDED or spec.get("on_failure") == OnFailure.CONTINUE:
        moved = JobRun.objects.filter(pk=run.pk, status=RunStatus.RUNNING, cursor=step_run.index).update(
            cursor=step_run.index + 1
        )
        if moved:
            run.cursor = step_run.index + 1
            step_start(run=run, index=run.cursor)
        return
    run_finish(
        run=run,
        status=RunStatus.FAILED,
        error=f"step {step_run.index} ({step_run.device.name} {step_run.action}) {step_run.status}: "
        f"{step_run.error}",
    )
