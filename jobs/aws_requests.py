"""The AWS IoT Jobs requests of a device, answered: get, start-next, <jobId>/get, <jobId>/update.

The bridge validates each request (`aws_request_handle`: topic, size, JSON, field types) and
hands it to a worker as one `jobs.aws_jobs_request` task; a malformed one too, so that the
device hears `InvalidRequest` as AWS would answer. The worker reads the device's rows and
answers on the request's `.../accepted` or `.../rejected` topic. What changes a step goes
through the engine as the protocol v1 reply it means (`transition_apply` with a
devices.protocol.Reply): start-next is an `ack` (its stepTimeoutInMinutes an
`extend_seconds`), an IN_PROGRESS update a `progress`, SUCCEEDED / FAILED / REJECTED a
`done` (ok / error / rejected) — so the fencing and stale-reply rules, and their sampled
timeline events, are protocol v1's own. An update is accepted only when its jobId is the
device's current command id, its executionNumber that attempt and its expectedVersion
the execution's version; otherwise it is refused with AWS's code.

One device cannot crowd out the others: its messages pass the bridge's per-device budget
first, then AWS_REQUEST_RATE of them a second become tasks; the rest are dropped and counted
(AWS would answer RequestThrottled; iotqueue stays silent rather than spend a task on it).

How it fails: a worker that cannot publish leaves the request unanswered (logged); an SDK
request times out and the firmware asks again. A step that moved between the check and the
engine's compare-and-set (its deadline passed) is answered from the row as it ends up.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable

from celery import current_app
from django.conf import settings

from devices import aws_jobs, protocol
from devices.aws_jobs import Request
from devices.models import Device
from devices.profiles import DeviceProtocol
from iotqueue.bridge import BRIDGE_MESSAGES, message_again
from iotqueue.budget import MessageBudget
from iotqueue.metrics import counter_buffer
from iotqueue.mqtt import PublishError, publisher
from iotqueue.redis_conn import redis_connection, redis_key

from .aws_executions import (
    QUEUED_SUFFIX,
    device_executions,
    execution_data,
    execution_state,
    execution_version,
    job_document,
    pending_lists,
)
from .engine.batch import transition_apply
from .engine.plan import command_id_step
from .events import event_record_sampled
from .models import STEP_IN_FLIGHT, StepRun, StepStatus
from .replies import message_dropped

log = logging.getLogger(__name__)

# The task the bridge sends for each request (jobs/tasks.py), by name.
AWS_REQUEST_TASK = "jobs.aws_jobs_request"
# How many of one device's requests a second become tasks (each reads rows and may apply a
# transition): a device polls get, starts one execution and updates it a few times, so five
# a second with bursts of twenty covers firmware reporting progress every second; a device
# sending thousands cannot fill the workers' queue ahead of other devices' work.
AWS_REQUEST_RATE = 5.0
AWS_REQUEST_BURST = 20
# How long a request's copies from other bridge replicas are recognised (request_first_copy):
# they arrive within milliseconds of each other; an SDK's own retry comes after seconds.
DUPLICATE_SECONDS = 2
# Text the device itself may show: what a rejected answer's message keeps of a reason.
MESSAGE_MAX_CHARS = 200

aws_request_budget = MessageBudget(rate=AWS_REQUEST_RATE, burst=AWS_REQUEST_BURST)


class Refused(Exception):
    """A request answered on `.../rejected` with AWS's `code`."""

    def __init__(self, code: str, message: str, state: dict | None = None) -> None:
        super().__init__(message)
        self.code, self.state = code, state


# --- bridge side ---------------------------------------------------------------------------


def aws_request_handle(topic: str, payload: bytes) -> None:
    """Handler for $aws/things/<device>/jobs/{get,start-next,<jobId>/get,<jobId>/update}."""
    parsed = aws_jobs.request_topic_parse(topic)
    if parsed is None:
        return
    device, operation, job_id = parsed
    if not message_again() and not aws_request_budget.admit(device):
        message_dropped(device, topic, payload, f"AWS IoT Jobs requests over {AWS_REQUEST_RATE:g} a second")
        return
    try:
        request = aws_jobs.request_parse(device, operation, job_id, payload).as_task_payload()
        counter_buffer.add(BRIDGE_MESSAGES, "accepted")
    except aws_jobs.RequestInvalid as exc:
        message_dropped(device, topic, payload, str(exc))
        # Answered all the same (InvalidRequest): the SDK waits for an answer to each request.
        request = {**Request(device, operation, job_id).as_task_payload(), "client_token": exc.client_token}
        request["invalid"] = str(exc)[:MESSAGE_MAX_CHARS]
    current_app.signature(AWS_REQUEST_TASK, args=(request,)).apply_async(
        argsrepr=f"devices=[{device}], {operation}"
    )


# --- worker side ---------------------------------------------------------------------------


def aws_request_answer(payload: dict) -> None:
    """Answer one request (its task payload) on its accepted or rejected topic."""
    if not request_first_copy(payload):
        return
    invalid = payload.pop("invalid", None)
    request = Request(**payload)
    if not Device.objects.filter(name=request.device, protocol=DeviceProtocol.AWS_IOT_JOBS).exists():
        # No such device here (another deployment's, on a shared broker), or one of the
        # iotqueue protocol: the jobs of no thing are iotqueue's to describe.
        log.debug(
            "AWS IoT Jobs %s of %s: not an aws-iot-jobs device; not answered",
            request.operation,
            request.device,
        )
        return
    try:
        if invalid:
            raise Refused(aws_jobs.INVALID_REQUEST, invalid)
        body, accepted = ANSWERS[request.operation](request), True
    except Refused as refused:
        body = aws_jobs.rejection(refused.code, str(refused), request.client_token, refused.state)
        accepted = False
    topic = aws_jobs.answer_topic(request, accepted)
    try:
        publisher.publish(topic, json.dumps(body, separators=(",", ":")).encode())
    except PublishError as exc:
        log.warning("AWS IoT Jobs %s of %s not answered: %s", request.operation, request.device, exc)


def request_first_copy(payload: dict) -> bool:
    """False for a copy of a request another bridge replica handed on already.

    The request filters are subscribed outside the shared group (Mosquitto delivers no
    $-topic to a $share/ subscription), so with MQTT_SHARED_GROUP set every replica hands
    on every request: the first task for a request within DUPLICATE_SECONDS answers it.
    How it fails: a device that sends the very same request twice within that time is
    answered once (an SDK waits on the topic, so both waits end); without a shared group
    there is one bridge and nothing to check.
    """
    if not settings.MQTT_SHARED_GROUP:
        return True
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
    key = redis_key("aws-request", digest)
    return bool(redis_connection().set(key, "1", nx=True, ex=DUPLICATE_SECONDS))


def pending_get(request: Request) -> dict:
    """GetPendingJobExecutions: the started execution, and the queued ones."""
    in_progress, queued = pending_lists(*device_executions(request.device))
    return aws_jobs.answer({"inProgressJobs": in_progress, "queuedJobs": queued}, request.client_token)


def next_start(request: Request) -> dict:
    """StartNextPendingJobExecution: the device's current execution, started (an `ack`,
    with stepTimeoutInMinutes as `extend_seconds`); no `execution` when there is none."""
    current, _ = device_executions(request.device)
    if current is None:
        return aws_jobs.answer({}, request.client_token)
    if current.status != StepStatus.IN_PROGRESS or request.step_timeout_minutes:
        reply = protocol.Reply(
            kind="ack", command_id=current.command_id, extend_seconds=_extend_seconds(request)
        )
        transition_apply(replies=[(request.device, reply)])
        current = _row(current.command_id) or current
    execution = execution_data(current)
    if request.status_details:
        execution["statusDetails"] = request.status_details
    return aws_jobs.answer({"execution": execution}, request.client_token)


def execution_describe(request: Request) -> dict:
    """DescribeJobExecution of a jobId (a command id, a provisional queued one, or $next)."""
    if request.job_id == aws_jobs.NEXT_JOB:
        row, queued = device_executions(request.device)
        row = row or (queued[0] if queued else None)
    else:
        row = _device_row(request)
    if row is None or (request.execution_number and request.execution_number != row.attempt):
        raise Refused(aws_jobs.RESOURCE_NOT_FOUND, f"no execution {request.job_id} on this thing")
    execution = execution_data(row, document=request.include_job_document)
    return aws_jobs.answer({"execution": execution}, request.client_token)


def execution_update(request: Request) -> dict:
    """UpdateJobExecution: checked against the device's current execution, then applied by
    the engine as the v1 reply it means; refused with AWS's code when it answers nothing
    current (the engine records it as stale, unknown or foreign, as a v1 reply)."""
    reply = update_reply(request)
    if request.job_id.endswith(QUEUED_SUFFIX):
        raise Refused(
            aws_jobs.INVALID_STATE_TRANSITION,
            "this execution waits for the thing's current one; it starts with start-next once it is next",
        )
    row = _row(request.job_id)
    if row is None or row.device.name != request.device or row.status not in STEP_IN_FLIGHT:
        transition_apply(replies=[(request.device, reply)])  # recorded as stale, unknown or foreign
        raise _not_current(request)
    _update_check(request, row)
    transition_apply(replies=[(request.device, reply)])
    # By the step, not the command id: a retried step may have its next attempt already.
    after = StepRun.objects.select_related("run", "device").get(pk=row.pk)
    still = after.command_id == request.job_id and after.status in STEP_IN_FLIGHT
    if still == (reply.kind == "done"):
        raise Refused(aws_jobs.TERMINAL_STATE_REACHED, "the execution ended meanwhile")
    state = execution_state(after) if still else _end_state(request, row)
    fields = {"executionState": state if request.include_execution_state else None}
    if request.include_job_document:
        fields["jobDocument"] = job_document(row)
    return aws_jobs.answer(fields, request.client_token)


def _end_state(request: Request, row: StepRun) -> dict:
    """The JobExecutionState an accepted final update left: its status and details, one
    version on (the row may already hold the step's next attempt)."""
    return aws_jobs.fields_present(
        {
            "status": request.status,
            "statusDetails": request.status_details or None,
            "versionNumber": execution_version(row) + 1,
        }
    )


ANSWERS: dict[str, Callable[[Request], dict]] = {
    aws_jobs.GET: pending_get,
    aws_jobs.START_NEXT: next_start,
    aws_jobs.DESCRIBE: execution_describe,
    aws_jobs.UPDATE: execution_update,
}


def _update_check(request: Request, row: StepRun) -> None:
    """Refuse (and record, sampled) an update to the current execution whose executionNumber
    or expectedVersion is not the execution's."""
    version = execution_version(row)
    problem = None
    if request.execution_number is not None and request.execution_number != row.attempt:
        problem = Refused(aws_jobs.RESOURCE_NOT_FOUND, f"no execution number {request.execution_number}")
    elif request.expected_version is not None and request.expected_version != version:
        message = f"expected version {request.expected_version}, the execution is at {version}"
        problem = Refused(aws_jobs.VERSION_MISMATCH, message, execution_state(row))
    if problem is not None:
        message = f"AWS IoT Jobs update refused: {problem}"
        event_record_sampled("reply.stale", device=request.device, step_run=row, message=message)
        raise problem


def _not_current(request: Request) -> Refused:
    """Why an update to no current execution is refused: an execution of this thing that
    ended (or an earlier attempt of its step) is terminal; anything else is not found."""
    step = command_id_step(request.job_id)
    mine = step is not None and StepRun.objects.filter(pk=step, device__name=request.device).exists()
    if mine:
        return Refused(aws_jobs.TERMINAL_STATE_REACHED, f"execution {request.job_id} has ended")
    return Refused(aws_jobs.RESOURCE_NOT_FOUND, f"no execution {request.job_id} on this thing")


def update_reply(request: Request) -> protocol.Reply:
    """The protocol v1 reply an update means (statusDetails: progress detail or result)."""
    details, command_id = request.status_details, request.job_id
    if request.status == aws_jobs.IN_PROGRESS:
        return protocol.Reply(
            kind="progress",
            command_id=command_id,
            progress=_progress(details),
            detail=json.dumps(details, separators=(",", ":"))[: protocol.DETAIL_MAX_CHARS] if details else "",
            extend_seconds=_extend_seconds(request),
        )
    if request.status == aws_jobs.SUCCEEDED:
        return protocol.Reply(kind="done", command_id=command_id, ok=True, result=dict(details))
    error = json.dumps(details, separators=(",", ":")) if details else ""
    if request.status == aws_jobs.REJECTED:
        return protocol.Reply(
            kind="done", command_id=command_id, ok=False, rejected=True, error=error or "device rejected"
        )
    # FAILED may be retried, as AWS retries FAILED executions under a retry configuration.
    return protocol.Reply(
        kind="done", command_id=command_id, ok=False, retryable=True, error=error or "device reported FAILED"
    )


def _progress(details: dict[str, str]) -> int:
    """A percentage from statusDetails' `progress` ("40" or "40%"), else 0."""
    text = details.get("progress", "").strip().rstrip("%")
    try:
        return min(100, max(0, int(float(text))))
    except ValueError:
        return 0


def _extend_seconds(request: Request) -> float | None:
    return request.step_timeout_minutes * 60.0 if request.step_timeout_minutes else None


def _row(command_id: str) -> StepRun | None:
    return StepRun.objects.select_related("run", "device").filter(command_id=command_id).first()


def _device_row(request: Request) -> StepRun | None:
    """The device's step a jobId names: by command id, or a queued one by its provisional id."""
    if request.job_id.endswith(QUEUED_SUFFIX):
        step = command_id_step(request.job_id)
        rows = StepRun.objects.select_related("run", "device").filter(pk=step, device__name=request.device)
        return rows.first() if step is not None else None
    row = _row(request.job_id)
    return row if row is not None and row.device.name == request.device else None
