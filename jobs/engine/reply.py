"""A device's reply, one at a time: correlate it with the attempt it answers, apply it.

The batched path (jobs/engine/batch.py) applies the common case — replies to current
attempts — for many replies at once; this module is the general path it hands anything
else to (unknown, foreign, stale).
"""

from __future__ import annotations

from django.db import transaction
from django.db.models import F
from django.db.models.functions import Coalesce
from django.utils import timezone

from devices import protocol

from ..deadlines import Deadline, deadlines_clear
from ..events import event_record, event_record_sampled
from ..models import STEP_IN_FLIGHT, StepRun, StepStatus
from .attempts import attempt_extend
from .plan import command_id_step
from .runs import attempt_end_continue


@transaction.atomic
def step_reply(*, device: str, reply: protocol.Reply) -> None:
    """Apply a device's ack/progress/done to the attempt it answers, if that is current."""
    step_run = StepRun.objects.select_related("run", "device").filter(command_id=reply.command_id).first()
    if step_run is None:
        reply_unmatched(device, reply)
        return
    # A task step's outcome comes as a reply from its device's name, or "" without one.
    if step_run.device_name != device:
        event_record_sampled(
            "reply.foreign_device",
            step_run=step_run,
            device=device,
            message=f"{device} answered a command of {step_run.device_name or 'no device'}; ignored",
        )
        return
    if reply.kind == "done":
        attempt_end_continue(
            step_run=step_run,
            command_id=reply.command_id,
            ok=bool(reply.ok),
            result=reply.result,
            error=reply.error,
            retryable=reply.retryable,
            rejected=reply.rejected,
        )
    else:
        step_progress(step_run=step_run, reply=reply)


def reply_unmatched(device: str, reply: protocol.Reply) -> None:
    """A reply whose id is no step's current command: late (an earlier attempt) or unknown."""
    step_run_id = command_id_step(reply.command_id)
    step_run = (
        StepRun.objects.select_related("device").filter(pk=step_run_id).first() if step_run_id else None
    )
    if step_run is not None and step_run.device_name == device:
        event_record_sampled(
            "reply.stale",
            device=device,
            step_run=step_run,
            message=f"{reply.kind} for an earlier attempt ({reply.command_id}); ignored",
            reply_id=reply.command_id,
        )
        return
    event_record_sampled(
        "reply.unknown", device=device, message=f"{reply.kind} for unknown command {reply.command_id}"
    )


# A device may report progress as often as it likes (10,000 in 6 s from one flood): the
# step's row keeps the latest and the count of its attempt, and only the first this many of
# an attempt are also timeline events — what an operator reads, not a log of the device.
PROGRESS_EVENTS_PER_ATTEMPT = 20
# What an ack or progress writes on the step's row besides its status.
PROGRESS_FIELDS = ["progress", "progress_detail", "progress_messages"]


def step_progress(*, step_run: StepRun, reply: protocol.Reply) -> None:
    """ack/progress: the device is working on the current attempt; a progress may carry a
    `detail` (kept on the row, and recorded as `step.progress` while `progress_keep` says
    so) and `extend_seconds` (`attempt_extend`)."""
    was = step_run.status
    event = progress_keep(step_run, reply)
    changes = {"status": StepStatus.IN_PROGRESS, "acked_at": Coalesce("acked_at", timezone.now())}
    if reply.kind == "progress":
        changes.update(
            progress=step_run.progress,
            progress_detail=step_run.progress_detail,
            progress_messages=F("progress_messages") + 1,
        )
    updated = StepRun.objects.filter(
        pk=step_run.pk, command_id=reply.command_id, status__in=STEP_IN_FLIGHT
    ).update(**changes)
    if not updated:
        event_record_sampled(
            "reply.stale",
            device=step_run.device_name,
            step_run=step_run,
            message=f"{reply.kind} after the attempt ended",
        )
        return
    if was == StepStatus.DISPATCHED:
        deadlines_clear([Deadline.of("ack", step_run), Deadline.of("send", step_run)])
        event_record("step.in_progress", step_run=step_run, message=f"{reply.kind} received")
    if event:
        event_record(**event)
    if reply.extend_seconds:
        attempt_extend(
            step_run=step_run, command_id=reply.command_id, seconds=reply.extend_seconds, now=timezone.now()
        )


def progress_keep(step_run: StepRun, reply: protocol.Reply) -> dict | None:
    """Count an ack or progress on the row in memory (the caller writes PROGRESS_FIELDS) and
    say which `step.progress` event to record, if any: one per progress with a detail for
    the first PROGRESS_EVENTS_PER_ATTEMPT of an attempt, then one saying the rest is kept
    on the step only."""
    if reply.kind != "progress":
        return None
    step_run.progress = reply.progress
    step_run.progress_messages += 1
    if reply.detail:
        step_run.progress_detail = reply.detail
    count = step_run.progress_messages
    if count <= PROGRESS_EVENTS_PER_ATTEMPT:
        return progress_event(step_run, reply) if reply.detail else None
    if count == PROGRESS_EVENTS_PER_ATTEMPT + 1:
        return {
            "kind": "step.progress",
            "step_run": step_run,
            "message": f"{reply.progress}%: more progress of this attempt is kept on the step only "
            f"(its latest detail and a count), not in the timeline",
            "progress": reply.progress,
            "coalesced": True,
        }
    return None


def progress_event(step_run: StepRun, reply: protocol.Reply) -> dict:
    """The `step.progress` event of a progress that says what the device is doing."""
    return {
        "kind": "step.progress",
        "step_run": step_run,
        "message": f"{reply.progress}%: {reply.detail}",
        "progress": reply.progress,
        "detail": reply.detail,
    }
