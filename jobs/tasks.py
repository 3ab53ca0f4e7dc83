"""Celery tasks: thin entry points that take ids and JSON values and call the engine.

Every task is safe to run twice (acks_late redelivery): the engine's transitions are
compare-and-sets on (step, attempt, command id, fence).
"""

import logging

from celery import shared_task

from devices.protocol import Reply

from . import cancel, engine, monitor, outcomes, presence, retention
from .deadlines import Deadline
from .models import JobRun

log = logging.getLogger(__name__)


@shared_task(name="jobs.run_advance")
def run_advance_task(run_id: str) -> None:
    engine.run_advance(run_id=run_id)


@shared_task(name="jobs.step_reply")
def step_reply_task(device: str, reply: dict) -> None:
    outcomes.step_reply(device=device, reply=Reply(**reply))


@shared_task(name="jobs.step_deadlines")
def step_deadlines_task(members: list[str]) -> None:
    """A chunk of due deadlines; one failing does not stop the others."""
    for member in members:
        try:
            outcomes.step_deadline(deadline=Deadline.parse(member))
        except Exception:
            log.exception("deadline %s failed; the database sweep will find its step again", member)


@shared_task(name="jobs.lease_reclaim")
def lease_reclaim_task(device: str, holder: str, fence: int) -> None:
    monitor.lease_reclaim(device=device, holder=holder, fence=fence)


@shared_task(name="jobs.monitor_tick")
def monitor_tick_task() -> dict:
    return monitor.monitor_tick()


@shared_task(name="jobs.device_presence")
def device_presence_task(name: str, online: bool) -> None:
    if online:
        presence.device_online(name=name)
    else:
        presence.device_offline(name=name)


@shared_task(name="jobs.run_cancel")
def run_cancel_task(run_id: str, by: str) -> None:
    run = JobRun.objects.filter(pk=run_id).first()
    if run is not None:
        cancel.run_cancel(run=run, by=by)


@shared_task(name="jobs.runs_prune")
def runs_prune_task() -> int:
    return retention.runs_prune()
