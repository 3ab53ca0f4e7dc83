"""An attempt and its command: a new attempt's fields and deadlines, the command's message,
and the `cancel` command. Sending attempts is jobs/engine/publish.py's; re-sending one
whose publish was never confirmed, the `send` deadline's (jobs/engine/due.py).

The planner (jobs/engine/planner.py) decides when a queued step is dispatched (its lock
granted, or handed on to it) and writes the attempt with `attempt_new`; the executor
publishes after the commit (the row is the outbox entry: a fast reply always finds it).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.utils import timezone

from devices import profiles, protocol
from iotqueue.mqtt import Message, PublishError, publisher

from ..deadlines import Deadline
from ..events import event_record
from ..models import StepRun, StepStatus
from .plan import command_id_new, step_spec

log = logging.getLogger(__name__)

# A command committed but not confirmed published by then is sent again (outbox): covers
# a worker that died between commit and publish, and a broker that refused the publish.
SEND_CHECK_SECONDS = 5.0


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


def command_message(step_run: StepRun) -> Message:
    """The topic and payload of the step's current command; it expires with its attempt's
    deadline (not sent after it: the attempt times out, and a late copy could reach the
    device after the next holder's command). A device of another protocol than iotqueue's
    gets its profile's message instead (devices/profiles.py: AWS IoT Jobs' `notify-next`)."""
    profile_build = profiles.command_builders.get(step_run.device.protocol)
    if profile_build is not None:
        return profile_build(step_run)
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


# A cancel command's id: no step's, so the device's answer to it is recorded as unknown.
CANCEL_ID_PREFIX = "cancel-"


def cancel_command_send(step_run: StepRun) -> None:
    """Tell the device to stop the row's current command (its run was canceled or timed out)."""
    message = cancel_message(step_run)
    try:
        publisher.publish(message.topic, message.payload)
    except PublishError as exc:
        event_record("step.publish_failed", step_run=step_run, message=f"cancel command: {exc}")


def queued_notice_send(step_run: StepRun) -> None:
    """Tell the row's device that a step joined its queue, if its protocol says anything
    then (devices/profiles.py: AWS IoT Jobs' `notify` with the executions pending)."""
    build = profiles.queued_builders.get(step_run.device.protocol)
    if build is None:
        return
    message = build(step_run)
    try:
        publisher.publish(message.topic, message.payload)
    except PublishError as exc:
        event_record("step.publish_failed", step_run=step_run, message=f"queue notice: {exc}")


def cancel_message(step_run: StepRun) -> Message:
    """The `cancel` command for the row's current command; a device of another protocol gets
    its profile's message instead (devices/profiles.py: AWS IoT Jobs' `notify`)."""
    profile_build = profiles.cancel_builders.get(step_run.device.protocol)
    if profile_build is not None:
        return profile_build(step_run)
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
    return Message(step_run.device.command_topic_for(protocol.CANCEL_ACTION), payload)
