"""A device's reply, one at a time: correlate it with the attempt it answers, apply it.

The batched path (jobs/engine/batch.py) applies the common case — replies to current
attempts — for many replies at once; this module is the general path it hands anything
else to (unknown, foreign, stale), and the one an old `jobs.step_reply` task takes.
"""

from __future__ import annotations

from django.db import transaction
from django.db.models.functions import Coalesce
from django.utils import timezone

from devices import protocol

from ..deadlines import Deadline, deadlines_clear
from ..events import event_record
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
        event_record(
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
    """ack/progress: the device is working on the current attempt; a progress may carry a
    `detail` (recorded as `step.progress`) and `extend_seconds` (`attempt_extend`)."""
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
        deadlines_clear([Deadline.of("ack", step_run), Deadline.of("send", step_run)])
        event_record("step.in_progress", step_run=step_run, message=f"{reply.kind} received")
    if reply.detail:
        event_record(**progress_event(step_run, reply))
    if reply.extend_seconds:
        attempt_extend(
            step_run=step_run, command_id=reply.command_id, seconds=reply.extend_seconds, now=timezone.now()
        )


def progress_event(step_run: StepRun, reply: protocol.Reply) -> dict:
    """The `step.progress` event of a progress that says what the device is doing."""
    return {
        "kind": "step.progress",
        "step_run": step_run,
        "message": f"{reply.progress}%: {reply.detail}",
        "progress": reply.progress,
        "detail": reply.detail,
    }
