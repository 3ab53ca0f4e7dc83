"""The step engine, return path: replies, attempt outcomes, retries, timeouts, run continuation.

An attempt ends exactly once, by a compare-and-set on its command id while the step is in
flight: the device's `done`, a deadline (no ack / no done in time), the device dropping
offline, or an operator force-releasing the lock. A failed attempt with budget left goes to
`retrying` with an exponential, jittered back-off held in the deadline set (never a Celery
countdown); otherwise the step ends and the run continues or ends per the step's policy.
Whatever ended the attempt, the device lock is released and handed to the next waiter.
"""

from __future__ import annotations

import random
from datetime import timedelta

from django.db import transaction
from django.db.models.functions import Coalesce
from django.utils import timezone

from devices import protocol

from .deadlines import Deadline, deadlines_clear, deadlines_set
from .engine import (
    command_id_step,
    lock_pass_on,
    run_finish,
    step_acquire,
    step_holder,
    step_spec,
    step_start,
)
from .events import event_record
from .models import STEP_IN_FLIGHT, JobRun, OnFailure, Phase, RunStatus, StepKind, StepRun, StepStatus

# Longest back-off between attempts, whatever the step's base and attempt count say.
BACKOFF_MAX_SECONDS = 3600.0
# Statuses a final step outcome maps to on the run when the step's policy aborts it.
RUN_STATUS_FOR_STEP = {StepStatus.TIMED_OUT: RunStatus.TIMED_OUT}


def backoff_seconds(base: float, attempt: int) -> float:
    """Exponential back-off with "equal jitter": between half and all of base * 2^(n-1)."""
    ceiling = min(BACKOFF_MAX_SECONDS, base * 2 ** max(0, attempt - 1))
    return ceiling / 2 + random.uniform(0, ceiling / 2)


# --- replies --------------------------------------------------------------------------


def step_reply(*, device: str, reply: protocol.Reply) -> None:
    """Apply a device's ack/progress/done to the attempt it answers, if that is current."""
    step_run = StepRun.objects.select_related("run", "device").filter(command_id=reply.command_id).first()
    if step_run is None:
        _reply_unmatched(device, reply)
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
        attempt_end(
            step_run=step_run,
            command_id=reply.command_id,
            ok=bool(reply.ok),
            result=reply.result,
            error=reply.error,
            retryable=reply.retryable,
        )
    else:
        step_progress(step_run=step_run, reply=reply)


def _reply_unmatched(device: str, reply: protocol.Reply) -> None:
    """A reply whose id is no step's current command: late (an earlier attempt) or unknown."""
    step_run_id = command_id_step(reply.command_id)
    step_run = (
        StepRun.objects.select_related("device").filter(pk=step_run_id).first() if step_run_id else None
    )
    if step_run is not None and step_run.device.name == device:
        event_record(
            "reply.stale",
            step_run=step_run,
            message=f"{reply.kind} for an earlier attempt ({reply.command_id}); ignored",
            reply_id=reply.command_id,
        )
        return
    event_record(
        "reply.unknown", device=device, message=f"{reply.kind} for unknown command {reply.command_id}"
    )


def step_progress(*, step_run: StepRun, reply: protocol.Reply) -> None:
    """ack/progress: the device is working on the current attempt."""
    changes = {"status": StepStatus.IN_PROGRESS, "acked_at": Coalesce("acked_at", timezone.now())}
    if reply.progress is not None:
        changes["progress"] = reply.progress
    updated = StepRun.objects.filter(
        pk=step_run.pk, command_id=reply.command_id, status__in=STEP_IN_FLIGHT
    ).update(**changes)
    if not updated:
        event_record("reply.stale", step_run=step_run, message=f"{reply.kind} after the attempt ended")
        return
    if step_run.status == StepStatus.DISPATCHED:
        deadlines_clear(
            [Deadline("ack", step_run.pk, step_run.attempt), Deadline("send", step_run.pk, step_run.attempt)]
        )
        event_record("step.in_progress", step_run=step_run, message=f"{reply.kind} received")


def step_ack_apply(*, device: str, reply: protocol.Reply) -> bool:
    """ack/progress applied in place (by the bridge, no task): a read and one UPDATE.

    Returns False when the reply matches no current attempt of that device; the caller
    then hands it to `step_reply`, which finds out why and records it.
    """
    step_run = StepRun.objects.select_related("device").filter(command_id=reply.command_id).first()
    if step_run is None or step_run.device.name != device or step_run.status not in STEP_IN_FLIGHT:
        return False
    # Compare-and-set on the row as read: the attempt may have ended since (a done first).
    current = StepRun.objects.filter(pk=step_run.pk, command_id=reply.command_id, status__in=STEP_IN_FLIGHT)
    changes = {"status": StepStatus.IN_PROGRESS, "acked_at": Coalesce("acked_at", timezone.now())}
    if reply.progress is not None:
        changes["progress"] = reply.progress
    dispatched = current.filter(status=StepStatus.DISPATCHED)
    if step_run.status == StepStatus.DISPATCHED and dispatched.update(**changes):
        deadlines_clear(
            [Deadline("ack", step_run.pk, step_run.attempt), Deadline("send", step_run.pk, step_run.attempt)]
        )
        event_record("step.in_progress", step_run=step_run, message=f"{reply.kind} received")
        return True
    if reply.progress is not None:
        return bool(current.update(progress=reply.progress))
    return current.exists()


# --- ending an attempt ----------------------------------------------------------------


def attempt_end(
    *,
    step_run: StepRun,
    command_id: str,
    ok: bool,
    result: dict | None = None,
    error: str = "",
    retryable: bool = False,
    timed_out: bool = False,
) -> bool:
    """End the in-flight attempt `command_id` once; False when it had already ended."""
    spec = step_spec(step_run)
    retry = not ok and retryable and step_run.attempt < spec["max_attempts"]
    now = timezone.now()
    if ok:
        status = StepStatus.SUCCEEDED
    elif retry:
        status = StepStatus.RETRYING
    else:
        status = StepStatus.TIMED_OUT if timed_out else StepStatus.FAILED
    changes = {"status": status, "error": error, "finished_at": None if retry else now}
    if ok:
        changes.update(result=result or {}, progress=100)
    if retry:
        changes["deadline"] = now + timedelta(
            seconds=backoff_seconds(spec["backoff_seconds"], step_run.attempt)
        )
    with transaction.atomic():
        ended = StepRun.objects.filter(
            pk=step_run.pk, command_id=command_id, fence=step_run.fence, status__in=STEP_IN_FLIGHT
        ).update(**changes)
        if not ended:
            event_record(
                "reply.stale", step_run=step_run, message="outcome for an attempt that already ended"
            )
            return False
        for field, value in changes.items():
            setattr(step_run, field, value)
        message = error if not retry else f"{error}; retry {step_run.attempt + 1} of {spec['max_attempts']}"
        event_record(f"step.{status}", step_run=step_run, message=message)
    attempt = step_run.attempt
    deadlines_clear([Deadline(kind, step_run.pk, attempt) for kind in ("ack", "done", "send")])
    if retry:
        deadlines_set({Deadline("retry", step_run.pk, attempt): step_run.deadline})
    lock_pass_on(step_run.device.name, holder=step_holder(step_run), fence=step_run.fence)
    if not retry:
        run_continue(step_run=step_run)
    return True


def run_continue(*, step_run: StepRun) -> None:
    """After a step row ended for good: move its run on (once)."""
    from . import fanout, rollback

    if step_run.status == StepStatus.CANCELED:
        return
    if step_run.phase == Phase.COMPENSATION:
        rollback.compensation_next(run=step_run.run)
        return
    spec = step_spec(step_run)
    if spec.get("group") or spec.get("labels"):
        fanout.fanout_progress(run=step_run.run, index=step_run.index)
        return
    run_step_done(
        run=step_run.run,
        index=step_run.index,
        ok=step_run.status == StepStatus.SUCCEEDED,
        status=step_run.status,
        error=f"step {step_run.index} ({step_run.device_name} {step_run.action}) {step_run.status}: "
        f"{step_run.error}",
    )


def run_step_done(*, run: JobRun, index: int, ok: bool, status: str, error: str = "") -> None:
    """A step's outcome decides the run: next step, roll back, or end (once)."""
    from .rollback import rollback_start

    policy = run.plan[index].get("on_failure", OnFailure.ABORT)
    if ok or policy == OnFailure.CONTINUE:
        if JobRun.objects.filter(pk=run.pk, status=RunStatus.RUNNING, cursor=index).update(cursor=index + 1):
            run.cursor = index + 1
            step_start(run=run, index=run.cursor)
        return
    if policy == OnFailure.ROLLBACK:
        rollback_start(run=run, reason=error)
        return
    run_finish(run=run, status=RUN_STATUS_FOR_STEP.get(status, RunStatus.FAILED), error=error)


# --- deadlines ------------------------------------------------------------------------


def step_deadline(*, deadline: Deadline) -> None:
    """Act on a due deadline if the step is still where the deadline expected it."""
    from .engine import command_resend

    step_run = StepRun.objects.select_related("run", "device").filter(pk=deadline.step_run_id).first()
    if step_run is None or step_run.attempt != deadline.attempt:
        return
    if step_run.device_id is None:  # a delay step: whatever found it due (wake, sweep), it is over
        from .waits import delay_end

        delay_end(step_run=step_run)
        return
    if deadline.kind == "send":
        command_resend(step_run_id=step_run.pk, attempt=deadline.attempt)
    elif deadline.kind in ("ack", "done") and step_run.status in STEP_IN_FLIGHT:
        spec = step_spec(step_run)
        waited = spec["ack_timeout_seconds"] if deadline.kind == "ack" else spec["timeout_seconds"]
        attempt_end(
            step_run=step_run,
            command_id=step_run.command_id,
            ok=False,
            error=f"no {deadline.kind} from {step_run.device.name} within {waited}s",
            retryable=True,
            timed_out=True,
        )
    elif deadline.kind == "retry" and step_run.status == StepStatus.RETRYING:
        step_requeue(step_run=step_run)
    elif deadline.kind == "queue" and step_run.status == StepStatus.QUEUED:
        step_queue_timeout(step_run=step_run)
    elif deadline.kind == "dispatch" and step_run.status == StepStatus.QUEUED:
        _dispatch_if_holding(step_run)
    elif deadline.kind == "pump":
        from .fanout import fanout_pump

        fanout_pump(run=step_run.run, index=step_run.index)


def _dispatch_if_holding(step_run: StepRun) -> bool:
    """Dispatch a queued step that holds its device's lock (spaced, or its hand-off lost)."""
    from devices.locks import device_lock_state

    from .engine import step_dispatch

    state = device_lock_state(step_run.device.name)
    if state.holder == step_holder(step_run) and state.fence is not None:
        step_dispatch(step_run_id=step_run.pk, fence=state.fence)
        return True
    return False


def step_requeue(*, step_run: StepRun) -> None:
    """Back-off over: wait for the device's lock again for the next attempt."""
    spec = step_spec(step_run)
    now = timezone.now()
    deadline = now + timedelta(seconds=spec["queue_timeout_seconds"])
    if not StepRun.objects.filter(
        pk=step_run.pk, status=StepStatus.RETRYING, attempt=step_run.attempt
    ).update(status=StepStatus.QUEUED, queued_at=now, deadline=deadline):
        return
    step_run.status, step_run.queued_at, step_run.deadline = StepStatus.QUEUED, now, deadline
    event_record("step.queued", step_run=step_run, message=f"for attempt {step_run.attempt + 1}")
    step_acquire(step_run=step_run)


def step_queue_timeout(*, step_run: StepRun) -> None:
    """Waited too long for a busy or offline device: the step times out.

    Unless the step holds the device's lock already (its hand-off was lost with a killed
    worker): then it is dispatched now instead.
    """
    from devices.locks import device_lock_dequeue

    if step_run.device_id and _dispatch_if_holding(step_run):
        return
    spec = step_spec(step_run)
    why = "offline" if not step_run.device.reachable else "busy"
    error = f"waited {spec['queue_timeout_seconds']}s for device {step_run.device.name} ({why})"
    if spec.get("kind") == StepKind.WAIT_ONLINE:
        error = f"device {step_run.device.name} did not come online within {spec['queue_timeout_seconds']}s"
    if not StepRun.objects.filter(pk=step_run.pk, status=StepStatus.QUEUED, attempt=step_run.attempt).update(
        status=StepStatus.TIMED_OUT, error=error, finished_at=timezone.now()
    ):
        return
    device_lock_dequeue(step_run.device.name, holder=step_holder(step_run))
    step_run.status, step_run.error = StepStatus.TIMED_OUT, error
    event_record("step.timed_out", step_run=step_run, message=error)
    run_continue(step_run=step_run)
