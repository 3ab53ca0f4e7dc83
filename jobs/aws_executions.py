"""Step rows as AWS IoT Jobs executions, and what an AWS IoT Jobs device is sent unasked.

An `aws-iot-jobs` device (devices/aws_jobs.py) sees its work as AWS job executions: the
step whose command it holds the lock for is the next execution (QUEUED until the device
starts it, then IN_PROGRESS), its jobId the attempt's command id, its executionNumber the
attempt; the steps waiting in the device's lock queue are QUEUED executions behind it.
Where an iotqueue device is sent its command, an AWS device is sent `notify-next` with the
execution (`notify_next_message`, the profile's command builder); where an iotqueue device
is sent `cancel`, an AWS device is sent `notify` with what is pending now.

How it fails: a queued step has no command id until its attempt is dispatched, so it is
listed under a provisional jobId (`<step run>-queued`); its execution's jobId is the
command id from `notify-next` on.
"""

from __future__ import annotations

import json
from typing import Any

from devices import aws_jobs
from devices.profiles import DeviceProtocol, cancel_builder, command_builder, queued_builder
from iotqueue.mqtt import Message

from .engine.kinds import row_commanded
from .models import STEP_IN_FLIGHT, StepRun, StepStatus

# A queued step's provisional jobId: `<step run id>-queued` (plan.command_id_step reads
# the step run from it, as from a command id).
QUEUED_SUFFIX = "-queued"

# The execution status of a step run's current attempt, by its status. A retrying row's
# command id is the attempt that failed or timed out; FAILED says it ended without success.
EXECUTION_STATUS = {
    StepStatus.QUEUED: aws_jobs.QUEUED,
    StepStatus.DISPATCHED: aws_jobs.QUEUED,
    StepStatus.IN_PROGRESS: aws_jobs.IN_PROGRESS,
    StepStatus.SUCCEEDED: aws_jobs.SUCCEEDED,
    StepStatus.FAILED: aws_jobs.FAILED,
    StepStatus.RETRYING: aws_jobs.FAILED,
    StepStatus.REJECTED: aws_jobs.REJECTED,
    StepStatus.TIMED_OUT: aws_jobs.TIMED_OUT,
    StepStatus.CANCELED: aws_jobs.CANCELED,
    StepStatus.SKIPPED: aws_jobs.REMOVED,
    StepStatus.PENDING: aws_jobs.QUEUED,
}


def job_id(step_run: StepRun) -> str:
    """The execution's jobId: the attempt's command id, or the provisional one while queued."""
    if step_run.status == StepStatus.QUEUED or not step_run.command_id:
        return f"{step_run.pk}{QUEUED_SUFFIX}"
    return step_run.command_id


def execution_version(step_run: StepRun) -> int:
    """versionNumber: aws_jobs.version_number from the row (acked = started; each progress
    is an IN_PROGRESS update)."""
    started = step_run.acked_at is not None or step_run.status == StepStatus.IN_PROGRESS
    return aws_jobs.version_number(
        started=started,
        updates=step_run.progress_messages if started else 0,
        ended=step_run.status not in (*STEP_IN_FLIGHT, StepStatus.QUEUED, StepStatus.PENDING),
    )


def job_document(step_run: StepRun) -> dict[str, Any]:
    """The job document: the command's action and args, with its run, step and deadline."""
    deadline = step_run.deadline.isoformat() if step_run.deadline else None
    return {
        "action": step_run.action,
        "args": step_run.args,
        "run": str(step_run.run_id),
        "step": step_run.index,
        "deadline": deadline,
    }


def status_details(step_run: StepRun) -> dict[str, str] | None:
    """What the device last said about the execution: the statusDetails of its last update
    (kept as the step's progress detail, or as its result once it succeeded)."""
    if step_run.status == StepStatus.SUCCEEDED and isinstance(step_run.result, dict):
        return {str(key): str(value) for key, value in step_run.result.items()}
    try:
        kept = json.loads(step_run.progress_detail) if step_run.progress_detail else None
    except ValueError:
        return {"detail": step_run.progress_detail}
    return kept if isinstance(kept, dict) else None


def execution_summary(step_run: StepRun) -> dict[str, Any]:
    """A JobExecutionSummary of the row."""
    return aws_jobs.fields_present(
        {
            "jobId": job_id(step_run),
            "queuedAt": aws_jobs.epoch(step_run.queued_at),
            "startedAt": aws_jobs.epoch(step_run.acked_at),
            "lastUpdatedAt": aws_jobs.epoch(_last_updated(step_run)),
            "versionNumber": execution_version(step_run),
            "executionNumber": step_run.attempt or None,
        }
    )


def execution_data(step_run: StepRun, *, document: bool = True) -> dict[str, Any]:
    """A JobExecutionData of the row; with its job document unless `document` is False."""
    return aws_jobs.fields_present(
        {
            **execution_summary(step_run),
            "thingName": step_run.device.name,
            "status": EXECUTION_STATUS.get(step_run.status, aws_jobs.QUEUED),
            "statusDetails": status_details(step_run),
            "jobDocument": job_document(step_run) if document else None,
        }
    )


def execution_state(step_run: StepRun) -> dict[str, Any]:
    """A JobExecutionState of the row: status, statusDetails, versionNumber."""
    return aws_jobs.fields_present(
        {
            "status": EXECUTION_STATUS.get(step_run.status, aws_jobs.QUEUED),
            "statusDetails": status_details(step_run),
            "versionNumber": execution_version(step_run),
        }
    )


def _last_updated(step_run: StepRun):
    return step_run.finished_at or step_run.acked_at or step_run.dispatched_at or step_run.queued_at


def device_executions(device: str) -> tuple[StepRun | None, list[StepRun]]:
    """The device's current execution (the step in flight on it, if a command) and the
    steps queued behind it, oldest first, at most aws_jobs.LIST_MAX (the lock queue's own
    order puts priority first; the list is AWS's, by time queued)."""
    rows = StepRun.objects.select_related("run", "device").filter(device__name=device)
    # The device lock allows one in flight; a task step holds it without being a command.
    in_flight = rows.filter(status__in=STEP_IN_FLIGHT).order_by("-dispatched_at")[:1]
    current = next((row for row in in_flight if row_commanded(row)), None)
    queued = list(rows.filter(status=StepStatus.QUEUED).order_by("queued_at", "pk")[: aws_jobs.LIST_MAX])
    return current, queued


def pending_lists(current: StepRun | None, queued: list[StepRun]) -> tuple[list[dict], list[dict]]:
    """(inProgressJobs, queuedJobs) summaries: a current execution not started yet is QUEUED,
    first in line."""
    in_progress, waiting = [], [execution_summary(row) for row in queued]
    if current is not None and current.status == StepStatus.IN_PROGRESS:
        in_progress.append(execution_summary(current))
    elif current is not None:
        waiting.insert(0, execution_summary(current))
    return in_progress, waiting


def _json(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()


@command_builder(DeviceProtocol.AWS_IOT_JOBS)
def notify_next_message(step_run: StepRun) -> Message:
    """What dispatches a step to an AWS IoT Jobs device: `notify-next` with its execution
    (QUEUED, version 1, its job document); it expires with the attempt, as a command does."""
    payload = aws_jobs.notify_next(execution_data(step_run))
    topic = aws_jobs.jobs_topic(step_run.device.name, "notify-next")
    return Message(topic, _json(payload), step_run.deadline.timestamp() if step_run.deadline else None)


@cancel_builder(DeviceProtocol.AWS_IOT_JOBS)
@queued_builder(DeviceProtocol.AWS_IOT_JOBS)
def notify_message(step_run: StepRun) -> Message:
    """`notify` with the executions pending now, for an AWS IoT Jobs device: when its
    execution was canceled (no longer among them; its next update of it is refused,
    TerminalStateReached), and when a step joined its queue (a new queued execution)."""
    device = step_run.device.name
    payload = aws_jobs.notify_list(*pending_lists(*device_executions(device)))
    return Message(aws_jobs.jobs_topic(device, "notify"), _json(payload))
