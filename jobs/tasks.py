"""Celery tasks: thin entry points that take ids and JSON values and call the engine.

Every task is safe to run twice (acks_late redelivery): the engine's transitions are
compare-and-sets on (step, attempt, command id, fence). Every task is an `EngineTask`: the
commands it publishes are confirmed before it returns.
"""

import logging
from functools import partial

from celery import Task, shared_task
from celery.exceptions import Ignore
from django.conf import settings
from django.db import DatabaseError
from redis.exceptions import RedisError

from . import aws_requests, beat, cancel, canvas, current, inbox, monitor, presence, retention, services
from .deadlines import Deadline
from .engine import batch, continuous, due, fanout, taskstep
from .engine.publish import Publications
from .models import JobRun

log = logging.getLogger(__name__)

# How long a drain whose database or Redis is away keeps retrying (every 0.2 s).
DRAIN_RETRY_SECONDS = 30.0


class EngineTask(Task):
    """A task whose body runs inside its own `Publications` (jobs/engine/publish.py): before
    it returns, raises or retries, the commands it published without waiting are confirmed
    (their `send` deadlines cleared), or left to those deadlines if the broker is silent."""

    def __call__(self, *args, **kwargs):
        # `run`, not `super().__call__`: the worker has pushed the task's request already
        # (Task.__call__ would push a bare one over it, without id or retries).
        with Publications():
            return self.run(*args, **kwargs)


@shared_task(base=EngineTask, name=services.RUN_ADVANCE_TASK)
def run_advance_task(run_id: str) -> None:
    batch.run_begin(run_id=run_id)


@shared_task(
    base=EngineTask,
    bind=True,
    name=inbox.DRAIN_TASK,
    autoretry_for=(DatabaseError, RedisError, batch.BatchRetry),
    default_retry_delay=0.2,
    # Retried for about DRAIN_RETRY_SECONDS: longer than a database restart (CI's drill
    # restarts PostgreSQL for 4 s), so a reply taken just before one is applied when the
    # database is back, not left pending until this worker's next wake-up (10 retries, 2 s,
    # once let a step time out while its done waited).
    max_retries=int(DRAIN_RETRY_SECONDS / 0.2),
)
def inbox_drain_task(self, helper: bool = False) -> int:
    """Apply what waits in the engine's inbox (jobs/inbox.py)."""
    return inbox.inbox_drain(
        batch.inbox_apply,
        batch_max=settings.IOTQUEUE_REPLY_BATCH_MAX,
        linger_ms=settings.IOTQUEUE_INBOX_LINGER_MS,
        retried=self.request.retries > 0,
        helper=helper,
        on_batch=partial(_batch_event, self) if self.app.conf.worker_send_task_events else None,
    )


# The drain's custom Celery event, one per batch it takes (task events on only): what it
# applies is decided after the task started, which `celery inspect active` cannot show.
BATCH_EVENT = "task-batch"


def _batch_event(task, work: inbox.Work) -> None:
    """Send `task-batch` (size, runs, steps, devices) for this drain's task id; an event that
    cannot be sent is logged, never the batch's failure."""
    try:
        task.send_event(BATCH_EVENT, retry=False, **inbox.work_summary(work))
    except Exception as exc:
        log.warning("inbox: the drain's batch event was not sent (%r)", exc)


@shared_task(
    base=EngineTask,
    bind=True,
    name=canvas.PARK_TASK,
    ignore_result=False,
    # The park is idempotent (the run's idempotency key is the task id): a database or
    # Redis outage while parking retries it instead of stopping the canvas.
    autoretry_for=(DatabaseError, RedisError),
    default_retry_delay=0.5,
    max_retries=20,
)
def device_command_task(self, previous=None, *, device: str, action: str, args: dict, options: dict) -> None:
    """A device command link of a Celery canvas (jobs/canvas.py): parks the canvas in a run.

    Ends with Ignore: Celery then stores no result and sends nothing on for this task id
    now; the run's end does (jobs.canvas_resume). Its results are not ignored (the project
    default, CELERY_TASK_IGNORE_RESULT), or the caller's AsyncResult.get() would return None
    at once instead of waiting for the device's result.
    """
    canvas.canvas_park(
        self.request, previous=previous, device=device, action=action, args=args, options=options
    )
    raise Ignore()


@shared_task(
    base=EngineTask,
    name=canvas.RESUME_TASK,
    autoretry_for=(DatabaseError, RedisError),
    default_retry_delay=0.5,
    max_retries=20,
)
def canvas_resume_task(run_id: str) -> None:
    canvas.canvas_resume(run_id)


@shared_task(base=EngineTask, name=taskstep.TASK_STEP_RUN_TASK)
def task_step_run_task(step_run_id: int, command_id: str) -> None:
    """One attempt of a template's task step: the registered task's body, its outcome as `done`."""
    taskstep.task_step_execute(step_run_id=step_run_id, command_id=command_id)


@shared_task(base=EngineTask, name=monitor.DEADLINES_TASK)
def step_deadlines_task(members: list[str]) -> None:
    """A chunk of due deadlines, applied together (jobs/engine/due.py `step_deadlines`)."""
    due.step_deadlines([Deadline.parse(member) for member in members])


@shared_task(base=EngineTask, name=beat.MONITOR_TASK)
def monitor_tick_task() -> dict:
    return monitor.monitor_tick()


@shared_task(base=EngineTask, name=current.JOBS_GET_TASK)  # sent by the bridge's jobs/get handler
def device_jobs_get_task(device: str) -> None:
    current.device_jobs_answer(device=device)


@shared_task(base=EngineTask, name=aws_requests.AWS_REQUEST_TASK)  # sent by the bridge's AWS IoT Jobs handler
def aws_jobs_request_task(request: dict) -> None:
    aws_requests.aws_request_answer(request)


@shared_task(base=EngineTask, name="jobs.devices_presence")  # sent by jobs/apps.py, one per presence group
def devices_presence_task(changes: list[list]) -> None:
    presence.devices_presence(changes)


@shared_task(base=EngineTask, name=continuous.JOIN_TASK)  # sent on commit when devices changed
def fanout_join_task(device_ids: list[int]) -> int:
    return continuous.fanouts_join(device_ids)


@shared_task(
    base=EngineTask,
    name=fanout.FANOUT_START_TASK,
    soft_time_limit=fanout.FANOUT_START_SOFT_SECONDS,
    time_limit=fanout.FANOUT_START_HARD_SECONDS,
)
def fanout_start_task(run_id: str, index: int) -> None:
    fanout.fanout_expand(run_id=run_id, index=index)


@shared_task(base=EngineTask, name="jobs.run_cancel")
def run_cancel_task(run_id: str, by: str) -> None:
    run = JobRun.objects.filter(pk=run_id).first()
    if run is not None:
        cancel.run_cancel(run=run, by=by)


@shared_task(base=EngineTask, name=beat.RETENTION_TASK)
def runs_prune_task() -> int:
    return retention.runs_prune()
