"""Dispatching: take a step's device lock, commit the attempt, publish its command.

No function here waits for a device. A queued step asks for its device's lock; when it is
granted the attempt is committed (command id, fence, deadlines) and only then is the
command published (the row is the outbox entry: a fast reply always finds it). A step
for a busy device waits in the device's FIFO queue and is dispatched by whoever hands the
lock on (devices/locks.py grant handlers; jobs/apps.py registers batch.py's
`step_handoff`).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from django.db import transaction
from django.utils import timezone

from devices import protocol
from devices.flow import device_flow_record, device_flow_wait
from devices.lock_recovery import locks_rebuild
from devices.locks import (
    Grant,
    NotReady,
    device_lock_acquire,
    device_lock_extend,
    device_lock_pass_on,
    device_lock_state,
)
from iotqueue.mqtt import Message, PublishError, publisher
from iotqueue.redis_conn import redis_connection

from ..deadlines import Deadline, deadlines_clear, deadlines_set
from ..events import event_record
from ..models import STEP_IN_FLIGHT, StepRun, StepStatus
from .kinds import REGISTRY
from .plan import RUN_ACTIVE, command_id_new, lease_seconds, spec_kind, step_holder, step_spec

log = logging.getLogger(__name__)

# A command committed but not confirmed published by then is sent again (outbox): covers
# a worker that died between commit and publish, and a broker that refused the publish.
SEND_CHECK_SECONDS = 5.0
# A step handed its device's lock before its row was committed is looked at again after
# this long (the creating transaction takes milliseconds).
UNCOMMITTED_ROW_RETRY_SECONDS = 0.5


@dataclass(frozen=True)
class Attempt:
    """A new attempt of a step: the row's new fields and the deadlines that guard it."""

    changes: dict[str, Any]
    deadlines: dict[Deadline, datetime]


def attempt_new(step_run: StepRun, *, fence: int | None, now: datetime) -> Attempt:
    """The next attempt of a queued step under `fence`: what to write and what to watch."""
    spec = step_spec(step_run)
    attempt = step_run.attempt + 1
    deadline = now + timedelta(seconds=spec["timeout_seconds"])
    changes = {
        "status": StepStatus.DISPATCHED,
        "attempt": attempt,
        "command_id": command_id_new(step_run.pk, attempt),
        "fence": fence,
        "deadline": deadline,
        "dispatched_at": now,
        "acked_at": None,
        "progress": None,
        "progress_detail": "",
        "progress_messages": 0,
    }
    # `done` times the attempt out; `send` re-sends a command whose publish never
    # confirmed (cleared once it did); `ack` only when the step asks for an early ack.
    deadlines = {
        Deadline.of("done", step_run, attempt): deadline,
        Deadline.of("send", step_run, attempt): now + timedelta(seconds=SEND_CHECK_SECONDS),
    }
    if spec.get("ack_timeout_seconds"):
        deadlines[Deadline.of("ack", step_run, attempt)] = now + timedelta(
            seconds=spec["ack_timeout_seconds"]
        )
    return Attempt(changes, deadlines)


def step_acquire(*, step_run: StepRun, quiet: bool = False) -> None:
    """Take the device lock and dispatch, or wait (device busy or offline; no worker waits).

    A step for an offline device stays queued outside the lock queue; the device's return
    online (jobs/presence.py) acquires for it. Its queue deadline bounds the wait. A step
    without a device (a task step) has no lock to take and is dispatched at once.
    """
    if step_run.device_id is None:
        step_dispatch(step_run_id=step_run.pk, fence=None, step_run=step_run, lease_fresh=True)
        return
    if not step_run.device.reachable:
        queue_deadline_set(step_run)
        if not quiet:
            event_record(
                "step.waiting", step_run=step_run, message=f"device {step_run.device.name} is offline"
            )
        return
    outcome = device_lock_acquire(
        step_run.device.name,
        holder=step_holder(step_run),
        priority=step_run.run.priority,
        lease_seconds=lease_seconds(step_spec(step_run)),
    )
    if isinstance(outcome, Grant):
        # The grant's lease already covers this step's timeout: no extend needed.
        step_dispatch(step_run_id=step_run.pk, fence=outcome.fence, step_run=step_run, lease_fresh=True)
        return
    queue_deadline_set(step_run)
    if isinstance(outcome, NotReady):
        # Redis lost the locks; rebuilding them re-acquires every queued step, this one too.
        locks_rebuild()
    elif not quiet:
        event_record("step.waiting", step_run=step_run, message=f"device busy, position {outcome.position}")


def queue_deadline_set(step_run: StepRun) -> None:
    if step_run.deadline is not None:
        deadlines_set({Deadline.of("queue", step_run): step_run.deadline})


def step_dispatch(
    *, step_run_id: int, fence: int | None, step_run: StepRun | None = None, lease_fresh: bool = False
) -> None:
    """Commit the attempt (command id, fence, deadlines), then send it (`attempt_send`).

    `step_run` may be passed when the caller has just loaded it; the compare-and-set on
    (status, attempt) keeps a stale copy harmless. `fence` is None for a step without a
    device (no lock).
    """
    if step_run is None:
        step_run = StepRun.objects.select_related("run", "device").filter(pk=step_run_id).first()
        if step_run is None:
            # Handed the lock before the transaction that created the row committed (two
            # batches at once): look again shortly. A row that never commits (rolled back)
            # keeps the lock until its lease runs out and the monitor passes it on.
            retry_at = timezone.now() + timedelta(seconds=UNCOMMITTED_ROW_RETRY_SECONDS)
            deadlines_set({Deadline("dispatch", step_run_id, 0): retry_at})
            return
    if step_run.status != StepStatus.QUEUED or step_run.run.status not in RUN_ACTIVE:
        if step_run.status in STEP_IN_FLIGHT and step_run.fence == fence:
            return  # redelivered task: already dispatched under this grant
        if step_run.device_id:
            device_lock_pass_on(step_run.device.name, holder=step_holder(step_run), fence=fence)
        return
    spec = step_spec(step_run)
    now = timezone.now()
    spacing = device_flow_wait(step_run.device) if step_run.device_id else 0
    if spacing > 0:
        # Flow control: keep the lock, publish when the device may take the next command.
        deadlines_set({Deadline.of("dispatch", step_run): now + timedelta(seconds=spacing)})
        device_lock_extend(
            step_run.device.name,
            holder=step_holder(step_run),
            fence=fence,
            lease_seconds=lease_seconds(spec) + spacing,
        )
        event_record("step.spaced", step_run=step_run, message=f"flow control: sending in {spacing:.1f}s")
        return
    attempt = attempt_new(step_run, fence=fence, now=now)
    # Deadlines go in before the commit: if this process dies after committing, the
    # `send` deadline re-sends the command and `done` times the attempt out.
    with redis_connection().pipeline(transaction=False) as pipe:
        deadlines_set(attempt.deadlines, pipe=pipe)
        deadlines_clear([Deadline.of("queue", step_run)], pipe=pipe)
        pipe.execute()
    with transaction.atomic():
        claimed = StepRun.objects.filter(
            pk=step_run.pk, status=StepStatus.QUEUED, attempt=step_run.attempt
        ).update(**attempt.changes)
        if not claimed:
            return
        for field, value in attempt.changes.items():
            setattr(step_run, field, value)
        event_record(
            "step.dispatched", step_run=step_run, message=f"attempt {step_run.attempt}, fence {fence}"
        )
    if step_run.device_id:
        if not lease_fresh:
            device_lock_extend(
                step_run.device.name,
                holder=step_holder(step_run),
                fence=fence,
                lease_seconds=lease_seconds(spec),
            )
        device_flow_record(step_run.device)
    # Sent once the transition commits (at once outside a transaction): a caller that
    # dispatches as part of a larger transition keeps commit-before-publish.
    transaction.on_commit(partial(command_send_checked, step_run=step_run))


def command_send_checked(*, step_run: StepRun) -> None:
    """Send the attempt; its `send` check is cleared once the broker confirmed it."""
    if attempt_send(step_run=step_run):
        deadlines_clear([Deadline.of("send", step_run)])


def attempt_send(*, step_run: StepRun) -> bool:
    """Send the step's current attempt the way its kind does: a command by default, else
    what the kind declared with `@kinds.attempt_sender` (a task step sends a Celery task);
    False (and an event) when it failed, which the `send` deadline retries."""
    sender = REGISTRY.attempt_senders.get(spec_kind(step_spec(step_run)), command_send)
    return sender(step_run=step_run)


def command_message(step_run: StepRun) -> Message:
    """The topic and payload of the step's current command; it expires with its attempt's
    deadline (not sent after it: the attempt times out, and a late copy could reach the
    device after the next holder's command)."""
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
    return Message(step_run.device.command_topic_for(step_run.action), payload, step_run.deadline.timestamp())


def command_send(*, step_run: StepRun) -> bool:
    """Publish the step's current command (QoS 1); False (and an event) when it failed.

    A failed publish is retried by the `send` deadline; the device deduplicates by id.
    """
    message = command_message(step_run)
    try:
        publisher.publish(message.topic, message.payload, expires_at=message.expires_at)
    except PublishError as exc:
        event_record("step.publish_failed", step_run=step_run, message=str(exc))
        return False
    return True


def command_resend(*, step_run: StepRun, attempt: int) -> None:
    """The `send` deadline: re-send a command whose publish was never confirmed, while its
    attempt is current and its deadline ahead (past it, the `done` deadline times it out)."""
    if step_run.attempt != attempt or step_run.status != StepStatus.DISPATCHED:
        return
    if step_run.deadline is not None and step_run.deadline <= timezone.now():
        return
    event_record("step.resent", step_run=step_run, message="publish was not confirmed; sending again")
    if not attempt_send(step_run=step_run):
        deadlines_set(
            {Deadline.of("send", step_run, attempt): timezone.now() + timedelta(seconds=SEND_CHECK_SECONDS)}
        )
    else:
        deadlines_clear([Deadline.of("send", step_run, attempt)])


def dispatch_if_holding(step_run: StepRun) -> bool:
    """Dispatch a queued step that holds its device's lock (spaced, or its hand-off lost)."""
    state = device_lock_state(step_run.device.name)
    if state.holder == step_holder(step_run) and state.fence is not None:
        step_dispatch(step_run_id=step_run.pk, fence=state.fence)
        return True
    return False


# A cancel command's id: no step's, so the device's answer to it is recorded as unknown.
CANCEL_ID_PREFIX = "cancel-"


def cancel_command_send(step_run: StepRun) -> None:
    """Tell the device to stop the row's current command (its run was canceled or timed out)."""
    payload = protocol.command_payload(
        command_id=f"{CANCEL_ID_PREFIX}{step_run.pk}-{uuid.uuid4().hex[:8]}",
        run=str(step_run.run_id),
        step=step_run.index,
        attempt=step_run.attempt,
        token=step_run.fence,
        action=protocol.CANCEL_ACTION,
        args={"id": step_run.command_id},
        deadline=timezone.now().isoformat(),
    )
    try:
        publisher.publish(step_run.device.command_topic_for(protocol.CANCEL_ACTION), payload)
    except PublishError as exc:
        event_record("step.publish_failed", step_run=step_run, message=f"cancel command: {exc}")
