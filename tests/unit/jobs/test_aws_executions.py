"""Step rows as AWS IoT Jobs executions (jobs/aws_executions.py): jobId, status, version and
document, and the notify-next a dispatch sends; decided from the row alone, no server."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

from devices.aws_jobs import UPDATE, Request
from devices.models import Device
from devices.profiles import DeviceProtocol, command_builders
from jobs import aws_executions
from jobs.aws_requests import update_reply
from jobs.models import StepRun, StepStatus

NOW = datetime(2026, 11, 27, 12, 0, tzinfo=UTC)


def row(status: str, **fields) -> StepRun:
    device = Device(name="gw-1", protocol=DeviceProtocol.AWS_IOT_JOBS)
    values = {
        "pk": 12,
        "run_id": "7e57",
        "index": 0,
        "action": "firmware/update",
        "args": {"version": "2"},
        "attempt": 1,
        "command_id": "12-1-abc",
        "queued_at": NOW,
        "dispatched_at": NOW,
        "deadline": NOW + timedelta(minutes=5),
        **fields,
    }
    return StepRun(device=device, status=status, **values)


def test_a_queued_step_has_a_provisional_job_id_and_a_dispatched_one_its_command_id():
    assert aws_executions.job_id(row(StepStatus.QUEUED, command_id=None)) == "12-queued"
    assert aws_executions.job_id(row(StepStatus.DISPATCHED)) == "12-1-abc"


def test_the_version_counts_the_start_the_updates_and_the_end():
    assert aws_executions.execution_version(row(StepStatus.DISPATCHED)) == 1
    started = row(StepStatus.IN_PROGRESS, acked_at=NOW, progress_messages=0)
    assert aws_executions.execution_version(started) == 2
    assert (
        aws_executions.execution_version(row(StepStatus.IN_PROGRESS, acked_at=NOW, progress_messages=3)) == 5
    )
    assert aws_executions.execution_version(row(StepStatus.SUCCEEDED, acked_at=NOW, progress_messages=3)) == 6


def test_statuses_map_onto_aws_execution_statuses():
    expected = {
        StepStatus.DISPATCHED: "QUEUED",
        StepStatus.IN_PROGRESS: "IN_PROGRESS",
        StepStatus.SUCCEEDED: "SUCCEEDED",
        StepStatus.REJECTED: "REJECTED",
        StepStatus.TIMED_OUT: "TIMED_OUT",
        StepStatus.CANCELED: "CANCELED",
    }
    for status, aws in expected.items():
        assert aws_executions.execution_data(row(status))["status"] == aws


def test_a_dispatch_to_an_aws_device_is_notify_next_with_the_execution_and_its_document():
    message = command_builders[DeviceProtocol.AWS_IOT_JOBS](row(StepStatus.DISPATCHED))
    assert message.topic == "$aws/things/gw-1/jobs/notify-next"
    execution = json.loads(message.payload)["execution"]
    assert execution["jobId"] == "12-1-abc" and execution["status"] == "QUEUED"
    assert execution["executionNumber"] == 1 and execution["versionNumber"] == 1
    assert execution["jobDocument"]["action"] == "firmware/update"
    assert execution["jobDocument"]["args"] == {"version": "2"}
    assert execution["queuedAt"] == int(NOW.timestamp())
    assert message.expires_at == (NOW + timedelta(minutes=5)).timestamp()


def test_a_succeeded_executions_details_are_its_result_and_in_progress_ones_its_last_detail():
    done = row(StepStatus.SUCCEEDED, result={"firmware": "2"})
    assert aws_executions.status_details(done) == {"firmware": "2"}
    working = row(StepStatus.IN_PROGRESS, progress_detail='{"progress":"40"}')
    assert aws_executions.status_details(working) == {"progress": "40"}
    assert aws_executions.status_details(row(StepStatus.IN_PROGRESS, progress_detail="flashing")) == {
        "detail": "flashing"
    }


def update(status: str, **fields) -> Request:
    return Request(device="gw-1", operation=UPDATE, job_id="12-1-abc", status=status, **fields)


def test_updates_mean_the_v1_replies_of_the_same_outcome():
    progress = update_reply(update("IN_PROGRESS", status_details={"progress": "40%"}, step_timeout_minutes=3))
    assert (progress.kind, progress.progress, progress.extend_seconds) == ("progress", 40, 180.0)
    assert json.loads(progress.detail) == {"progress": "40%"}
    succeeded = update_reply(update("SUCCEEDED", status_details={"firmware": "2"}))
    assert succeeded.kind == "done" and succeeded.ok and succeeded.result == {"firmware": "2"}
    failed = update_reply(update("FAILED"))
    assert failed.ok is False and failed.retryable and not failed.rejected
    rejected = update_reply(update("REJECTED", status_details={"reason": "battery"}))
    assert rejected.ok is False and rejected.rejected and not rejected.retryable
    assert "battery" in rejected.error
