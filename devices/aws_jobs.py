"""The AWS IoT Jobs MQTT API as a device profile: its topics, its requests and its answers.

A device whose `protocol` is `aws-iot-jobs` speaks the API AWS documents for its jobs
service (`$aws/things/<thing>/jobs/...`), so firmware written with an AWS IoT Device SDK
moves over unchanged; docs/protocol.md maps it onto iotqueue's concepts. This module is
its code form, as devices/protocol.py is protocol v1.1's: topic names, the validation of
what a device sends (`request_parse`, raising RequestInvalid for what AWS answers with
`InvalidRequest`), and the shapes of what is sent back. Nothing here touches the database
or the network: jobs/aws_executions.py turns step rows into executions, jobs/aws_requests.py
answers the requests.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from . import protocol

THINGS = "$aws/things"
# The requests a device publishes, by the operation AWS names them for.
GET = "get"  # GetPendingJobExecutions: $aws/things/T/jobs/get
START_NEXT = "start-next"  # StartNextPendingJobExecution: $aws/things/T/jobs/start-next
DESCRIBE = "describe"  # DescribeJobExecution: $aws/things/T/jobs/<jobId>/get
UPDATE = "update"  # UpdateJobExecution: $aws/things/T/jobs/<jobId>/update
OPERATIONS = (GET, START_NEXT, DESCRIBE, UPDATE)
# DescribeJobExecution's jobId for "the next pending execution".
NEXT_JOB = "$next"

# The statuses of an execution (AWS's JobExecutionStatus) and those a device may set.
QUEUED, IN_PROGRESS = "QUEUED", "IN_PROGRESS"
SUCCEEDED, FAILED, REJECTED = "SUCCEEDED", "FAILED", "REJECTED"
TIMED_OUT, CANCELED, REMOVED = "TIMED_OUT", "CANCELED", "REMOVED"
UPDATE_STATUSES = (IN_PROGRESS, SUCCEEDED, FAILED, REJECTED)

# The error codes of a `.../rejected` answer (AWS's RejectedErrorCode) that iotqueue sends.
INVALID_REQUEST = "InvalidRequest"
RESOURCE_NOT_FOUND = "ResourceNotFound"
VERSION_MISMATCH = "VersionMismatch"
INVALID_STATE_TRANSITION = "InvalidStateTransition"
TERMINAL_STATE_REACHED = "TerminalStateReached"

# AWS's own limits, so that firmware tested against AWS meets the same ones here: a
# clientToken has at most 64 characters, a jobId 64 of [A-Za-z0-9_-], a statusDetails
# map at most 10 keys of [A-Za-z0-9:_-] with values of at most 1,024 characters.
CLIENT_TOKEN_MAX_CHARS = 64
JOB_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
STATUS_DETAILS_MAX_KEYS = 10
STATUS_DETAIL_KEY_RE = re.compile(r"^[A-Za-z0-9:_-]{1,128}$")
STATUS_DETAIL_VALUE_MAX_CHARS = 1024
# stepTimeoutInMinutes: 1 minute to 7 days, AWS's range; the same week as
# protocol.EXTEND_SECONDS_LIMIT bounds a v1.1 device's `extend_seconds`.
STEP_TIMEOUT_MINUTES_MAX = protocol.EXTEND_SECONDS_LIMIT // 60
# At most this many executions in a notification's list, as AWS's ListNotification.
LIST_MAX = 15


class RequestInvalid(protocol.ProtocolError):
    """A request AWS would answer with `InvalidRequest`; carries its clientToken when it had one."""

    def __init__(self, message: str, client_token: str | None = None) -> None:
        super().__init__(message)
        self.client_token = client_token


@dataclass(frozen=True)
class Request:
    """A validated request of a device: the operation, its job (DESCRIBE, UPDATE) and fields."""

    device: str
    operation: str
    job_id: str = ""
    client_token: str | None = None
    status: str = ""
    status_details: dict[str, str] = field(default_factory=dict)
    expected_version: int | None = None
    execution_number: int | None = None
    include_job_document: bool = False
    include_execution_state: bool = False
    step_timeout_minutes: int | None = None

    def as_task_payload(self) -> dict[str, Any]:
        return asdict(self)


def jobs_topic(device: str, *levels: str) -> str:
    """$aws/things/<device>/jobs/<levels...>."""
    return "/".join((THINGS, device, "jobs", *levels))


def request_filters() -> list[str]:
    """The filters the bridge subscribes to: every device's four requests."""
    return [
        jobs_topic("+", GET),
        jobs_topic("+", START_NEXT),
        jobs_topic("+", "+", "get"),
        jobs_topic("+", "+", "update"),
    ]


def device_acl_topics(device: str) -> tuple[list[str], list[str]]:
    """(publish, subscribe) filters of an AWS IoT Jobs device: its requests, and its
    notifications and answers (every topic under its own jobs/)."""
    publish = [
        jobs_topic(device, GET),
        jobs_topic(device, START_NEXT),
        jobs_topic(device, "+", "get"),
        jobs_topic(device, "+", "update"),
    ]
    return publish, [jobs_topic(device, "#")]


def request_topic_parse(topic: str) -> tuple[str, str, str] | None:
    """(device, operation, jobId) of a request topic ("" as jobId for GET and START_NEXT);
    None when the topic is not one (or names no valid device)."""
    levels = topic.split("/")
    if len(levels) not in (5, 6) or "/".join(levels[:2]) != THINGS or levels[3] != "jobs":
        return None
    device = levels[2]
    if not protocol.DEVICE_NAME_RE.match(device):
        return None
    if len(levels) == 5 and levels[4] in (GET, START_NEXT):
        return device, levels[4], ""
    if len(levels) == 6 and levels[5] in ("get", "update"):
        return device, DESCRIBE if levels[5] == "get" else UPDATE, levels[4]
    return None


def answer_topic(request: Request, accepted: bool) -> str:
    """Where the answer to `request` goes: .../accepted or .../rejected under its topic."""
    outcome = "accepted" if accepted else "rejected"
    if request.operation in (GET, START_NEXT):
        return jobs_topic(request.device, request.operation, outcome)
    verb = "get" if request.operation == DESCRIBE else "update"
    return jobs_topic(request.device, request.job_id, verb, outcome)


def request_parse(device: str, operation: str, job_id: str, raw: bytes) -> Request:
    """Validate a request's body (an empty body is an empty object); raise RequestInvalid
    naming the field, with the clientToken when one could be read."""
    try:
        body = protocol.payload_json(raw) if raw.strip() else {}
    except protocol.ProtocolError as exc:  # oversized, not JSON, too deep, text not storable
        raise RequestInvalid(str(exc)) from None
    if not isinstance(body, dict):
        raise RequestInvalid("the payload must be a JSON object")
    token = body.get("clientToken")
    if token is not None and (not isinstance(token, str) or len(token) > CLIENT_TOKEN_MAX_CHARS):
        raise RequestInvalid(f"clientToken must be a string of at most {CLIENT_TOKEN_MAX_CHARS} characters")
    try:
        return _request(device, operation, job_id, body, token)
    except RequestInvalid as exc:
        raise RequestInvalid(str(exc), token) from None


def _request(device: str, operation: str, job_id: str, body: dict, token: str | None) -> Request:
    if operation in (DESCRIBE, UPDATE) and not (
        JOB_ID_RE.match(job_id) or (operation == DESCRIBE and job_id == NEXT_JOB)
    ):
        raise RequestInvalid("the jobId in the topic is not a job id")
    fields: dict[str, Any] = {"device": device, "operation": operation, "job_id": job_id}
    fields["client_token"] = token
    if operation in (START_NEXT, UPDATE):
        fields["status_details"] = _status_details(body)
        fields["step_timeout_minutes"] = _step_timeout(body)
    if operation in (DESCRIBE, UPDATE):
        fields["execution_number"] = _integer(body, "executionNumber", minimum=1)
        fields["include_job_document"] = _boolean(body, "includeJobDocument", default=operation == DESCRIBE)
    if operation == UPDATE:
        status = body.get("status")
        if status not in UPDATE_STATUSES:
            raise RequestInvalid(f"status must be one of {', '.join(UPDATE_STATUSES)}")
        fields["status"] = status
        fields["expected_version"] = _integer(body, "expectedVersion", minimum=0)
        fields["include_execution_state"] = _boolean(body, "includeJobExecutionState", default=False)
    return Request(**fields)


def _integer(body: dict, name: str, *, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise RequestInvalid(f"{name} must be an integer of at least {minimum}")
    return value


def _boolean(body: dict, name: str, *, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise RequestInvalid(f"{name} must be true or false")
    return value


def _status_details(body: dict) -> dict[str, str]:
    details = body.get("statusDetails")
    if details is None:
        return {}
    if not isinstance(details, dict) or len(details) > STATUS_DETAILS_MAX_KEYS:
        raise RequestInvalid(f"statusDetails must be an object of at most {STATUS_DETAILS_MAX_KEYS} strings")
    for key, value in details.items():
        if not STATUS_DETAIL_KEY_RE.match(key):
            raise RequestInvalid("a statusDetails key may hold only letters, digits and : _ -")
        if not isinstance(value, str) or len(value) > STATUS_DETAIL_VALUE_MAX_CHARS:
            most = STATUS_DETAIL_VALUE_MAX_CHARS
            raise RequestInvalid(f"a statusDetails value must be a string of at most {most} characters")
    return details


def _step_timeout(body: dict) -> int | None:
    """stepTimeoutInMinutes; AWS's -1 (no step timer) is taken as none given."""
    value = body.get("stepTimeoutInMinutes")
    if value is None or value == -1:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= STEP_TIMEOUT_MINUTES_MAX:
        raise RequestInvalid(f"stepTimeoutInMinutes must be an integer from 1 to {STEP_TIMEOUT_MINUTES_MAX}")
    return value


def version_number(*, started: bool, updates: int, ended: bool) -> int:
    """An execution's versionNumber, derived from what the step's row keeps: 1 when it is
    queued for the device, 2 once started, one more for each IN_PROGRESS update and one
    for its end, as AWS counts the updates of an execution."""
    return 1 + (1 + updates if started else 0) + (1 if ended else 0)


def epoch(moment: Any) -> int | None:
    """A datetime as the epoch seconds AWS sends; None stays None."""
    return int(moment.timestamp()) if moment is not None else None


def now_epoch() -> int:
    return int(time.time())


def fields_present(payload: dict[str, Any]) -> dict[str, Any]:
    """The payload without the fields that have no value (AWS leaves them out)."""
    return {key: value for key, value in payload.items() if value is not None}


def answer(payload: dict[str, Any], client_token: str | None) -> dict[str, Any]:
    """An accepted answer: `payload`, the time, and the request's clientToken echoed."""
    return fields_present({**payload, "timestamp": now_epoch(), "clientToken": client_token})


def rejection(
    code: str, message: str, client_token: str | None, execution_state: dict | None = None
) -> dict[str, Any]:
    """A `.../rejected` answer (AWS's ErrorResponse)."""
    return fields_present(
        {
            "code": code,
            "message": message,
            "timestamp": now_epoch(),
            "clientToken": client_token,
            "executionState": execution_state,
        }
    )


def notify_next(execution: dict[str, Any] | None) -> dict[str, Any]:
    """A NextJobExecutionChanged event: the next execution, or none left."""
    return fields_present({"timestamp": now_epoch(), "execution": execution})


def notify_list(in_progress: list[dict], queued: list[dict]) -> dict[str, Any]:
    """A JobExecutionsChanged event: the pending executions' summaries by status."""
    jobs = {IN_PROGRESS: in_progress[:LIST_MAX], QUEUED: queued[: max(0, LIST_MAX - len(in_progress))]}
    return {"timestamp": now_epoch(), "jobs": {status: items for status, items in jobs.items() if items}}
