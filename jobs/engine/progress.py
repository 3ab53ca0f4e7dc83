"""A device's ack or progress, counted on its step row: what the row keeps of it, and which
progress becomes a timeline event (a device may report as often as it likes).

The planner (jobs/engine/planner.py) decides every reply: to a current attempt, an
unknown, stale or foreign one; this module is what it asks about progress.
"""

from __future__ import annotations

from devices import protocol

from ..models import StepRun

# A device may report progress as often as it likes (10,000 in 6 s from one flood): the
# step's row keeps the latest and the count of its attempt, and only the first this many of
# an attempt are also timeline events — what an operator reads, not a log of the device.
PROGRESS_EVENTS_PER_ATTEMPT = 20
# What an ack or progress writes on the step's row besides its status.
PROGRESS_FIELDS = ["progress", "progress_detail", "progress_messages"]


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
