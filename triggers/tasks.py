"""Celery tasks of the triggers app: thin entry points that take ids and call a service."""

from celery import shared_task

from .schedules import FIRE_TASK, QUEUED_START_TASK, schedule_fire, schedule_queued_start


@shared_task(name=FIRE_TASK)
def schedule_fire_task(schedule_id: int) -> str | None:
    """What a schedule's PeriodicTask sends on every beat fire."""
    run = schedule_fire(schedule_id=schedule_id)
    return str(run.pk) if run else None


@shared_task(name=QUEUED_START_TASK)
def schedule_queued_start_task(schedule_id: int) -> str | None:
    """A scheduled run ended; start the fire that was waiting for it (overlap=queue)."""
    run = schedule_queued_start(schedule_id=schedule_id)
    return str(run.pk) if run else None
