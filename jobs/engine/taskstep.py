"""The step kind `task`: a registered Celery task (jobs/tasksteps.py) run as a step.

A task step is a command step whose "device side" is a Celery task: its row is queued,
takes its device's lock when it has a target (none without one), and each attempt gets a
command id and deadlines as a command does. Instead of publishing, the attempt sends
`jobs.task_step_run`; the worker that runs it calls the registered task with the step's
rendered args and hands the outcome to the engine's inbox as the `done` of that command id
— the path a device's reply takes. So the step's timeout, attempts and back-off, cancel and
stale outcomes are the engine's own, and a later step reads the task's return value as
`{{ steps.<name>.result.… }}`.

How it fails: the body runs at least once per attempt (a worker killed mid-body runs it
again, acks_late); an outcome that arrives after its attempt ended (timed out, canceled) is
recorded as stale. A timed-out body is not interrupted before its Celery time limit
(`timeout_seconds` soft, plus TIME_LIMIT_GRACE_SECONDS hard); the lock has moved on by then.
"""

from __future__ import annotations

import logging

from celery import current_app
from kombu.exceptions import OperationalError
from redis.exceptions import RedisError

from devices import protocol

from ..events import event_record
from ..inbox import replies_enqueue
from ..models import STEP_IN_FLIGHT, JobRun, StepKind, StepRun
from ..tasksteps import step_task_call
from .batch import step_row_queue
from .kinds import attempt_sender, step_kind
from .plan import step_spec

log = logging.getLogger(__name__)

# The Celery task that runs one attempt of a task step (jobs/tasks.py), by name.
TASK_STEP_RUN_TASK = "jobs.task_step_run"
# The hard time limit leaves the body this long after its soft one (SoftTimeLimitExceeded,
# which fails the attempt) to clean up before the worker kills it.
TIME_LIMIT_GRACE_SECONDS = 10


@step_kind(StepKind.TASK, batched_dispatch=True, extend_refused="a task step's time limit is fixed")
def task_start(run: JobRun, index: int) -> None:
    """A task step: its queued row (with a device when it has a target) asking for the
    device's lock, or dispatched at once without one: one plan."""
    step_row_queue(run, index)


@attempt_sender(StepKind.TASK)
def task_send(*, step_run: StepRun) -> bool:
    """Send the current attempt to a worker; False (and an event) when the broker refused.

    The attempt's `send` deadline sends it again until this succeeded.
    """
    timeout = step_spec(step_run)["timeout_seconds"]
    try:
        current_app.signature(
            TASK_STEP_RUN_TASK, kwargs={"step_run_id": step_run.pk, "command_id": step_run.command_id}
        ).apply_async(
            soft_time_limit=timeout,
            time_limit=timeout + TIME_LIMIT_GRACE_SECONDS,
            # What Celery's tools (events, Flower) show instead of the ids: the run it belongs to.
            kwargsrepr=f"runs=[{step_run.run_id}], step={step_run.index}, task={step_run.action}",
        )
    except (OperationalError, RedisError) as exc:
        event_record("step.publish_failed", step_run=step_run, message=f"task {step_run.action}: {exc}")
        return False
    return True


def task_step_execute(*, step_run_id: int, command_id: str) -> None:
    """Worker side: run the attempt `command_id` of a task step, hand its outcome on as `done`.

    Does nothing when that attempt is no longer in flight (it timed out or was canceled
    before the task got a worker). An `ack` first marks the attempt in progress.
    """
    step_run = (
        StepRun.objects.select_related("device")
        .filter(pk=step_run_id, command_id=command_id, status__in=STEP_IN_FLIGHT)
        .first()
    )
    if step_run is None:
        log.info("task step %s: attempt %s is no longer in flight; not run", step_run_id, command_id)
        return
    device = step_run.device_name
    replies_enqueue([[device, protocol.Reply(kind="ack", command_id=command_id).as_task_payload()]])
    outcome = step_task_call(step_run.action, step_run.args)
    done = protocol.Reply(
        kind="done",
        command_id=command_id,
        ok=outcome.ok,
        result=outcome.result,
        error=outcome.error,
        retryable=outcome.retryable,
    )
    replies_enqueue([[device, done.as_task_payload()]])
