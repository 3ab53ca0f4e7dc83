"""Schedules: keeping each one's beat PeriodicTask in step, and what a fire does.

Beat fires `triggers.schedule_fire` with the schedule's id. The fire is checked against
the previous one (a second fire within half a period is a duplicate: two beats, or beat
firing one slot twice) and against the schedule's overlap policy, then `run_start` is
called with an idempotency key of the schedule and the fire's number, and with the
schedule's pinned template version if it has one (else the template as it is now).
"""

from __future__ import annotations

import json
import logging
from datetime import datetime, timedelta

from celery import current_app
from django.db import transaction
from django.utils import timezone
from django_celery_beat.models import CrontabSchedule, IntervalSchedule, PeriodicTask

from jobs.events import event_record, event_run
from jobs.models import RUN_TERMINAL, JobRun, RunEvent, Trigger
from jobs.services import RunStartError, run_start

from .models import Overlap, Schedule, ScheduledRun, pinned_version_number
from .validation import crontab_fields

log = logging.getLogger(__name__)

FIRE_TASK = "triggers.schedule_fire"
# Named, not imported: triggers/tasks.py imports this module to call the services.
QUEUED_START_TASK = "triggers.schedule_queued_start"
# Beat fires a crontab at most once a minute, so a crontab's shortest period is 60 s.
CRONTAB_MIN_PERIOD_SECONDS = 60
# A fire closer than this fraction of the period to the previous one is a duplicate; half
# leaves room for delivery jitter either way without merging two genuine fires.
DUPLICATE_FRACTION = 0.5


def periodic_task_name(schedule: Schedule) -> str:
    return f"iotqueue schedule {schedule.name}"


def _beat_schedule(schedule: Schedule) -> dict:
    """The interval or crontab row for the PeriodicTask (rows are shared, as beat's admin does)."""
    if schedule.interval_seconds:
        interval = IntervalSchedule.objects.filter(
            every=schedule.interval_seconds, period=IntervalSchedule.SECONDS
        ).first() or IntervalSchedule.objects.create(
            every=schedule.interval_seconds, period=IntervalSchedule.SECONDS
        )
        return {"interval": interval, "crontab": None}
    fields = {**crontab_fields(schedule.crontab), "timezone": schedule.timezone}
    crontab = CrontabSchedule.objects.filter(**fields).first() or CrontabSchedule.objects.create(**fields)
    return {"interval": None, "crontab": crontab}


@transaction.atomic
def schedule_save(*, schedule: Schedule) -> Schedule:
    """Save a (validated) schedule and create or update its PeriodicTask to match.

    PeriodicTask.save() marks beat's schedule as changed, so a running DatabaseScheduler
    picks up a new, edited or disabled schedule on its next tick.
    """
    if not schedule.enabled:
        schedule.queued_fire = None  # a disabled schedule starts nothing, not even a waiting fire
    schedule.save()
    task = schedule.periodic_task or PeriodicTask(task=FIRE_TASK)
    task.name = periodic_task_name(schedule)
    task.task = FIRE_TASK
    task.kwargs = json.dumps({"schedule_id": schedule.pk})
    task.enabled = schedule.enabled
    task.description = f"Starts template {schedule.template.name!r}; managed by triggers.Schedule."
    for field, value in _beat_schedule(schedule).items():
        setattr(task, field, value)
    task.save()
    if schedule.periodic_task_id != task.pk:
        schedule.periodic_task = task
        Schedule.objects.filter(pk=schedule.pk).update(periodic_task=task)
    return schedule


def schedule_periodic_task_delete(*, schedule: Schedule) -> None:
    """Remove the schedule's PeriodicTask (instance delete, so beat notices the change)."""
    task = PeriodicTask.objects.filter(pk=schedule.periodic_task_id).first()
    if task is not None:
        task.delete()


def schedule_active_run(schedule: Schedule) -> JobRun | None:
    """The newest run this schedule started that has not ended."""
    link = (
        ScheduledRun.objects.filter(schedule=schedule)
        .exclude(run__status__in=RUN_TERMINAL)
        .select_related("run")
        .first()
    )
    return link.run if link else None


def schedule_period(schedule: Schedule) -> timedelta:
    return timedelta(seconds=schedule.interval_seconds or CRONTAB_MIN_PERIOD_SECONDS)


def fire_is_duplicate(schedule: Schedule, now: datetime) -> bool:
    """Two beats, or beat firing one slot twice: closer than half a period to the last fire."""
    if schedule.last_fired_at is None:
        return False
    return now - schedule.last_fired_at < schedule_period(schedule) * DUPLICATE_FRACTION


def schedule_fire(*, schedule_id: int) -> JobRun | None:
    """One beat fire: start a run unless it is a duplicate or the overlap policy says no.

    Returns the run started, or None. The schedule row is locked for the decision, so
    two fires racing (two beats) decide one after the other. A disabled or deleted
    schedule starts nothing: beat may fire once more before it notices.
    """
    with transaction.atomic():
        schedule = _schedule_locked(schedule_id)
        if schedule is None or not schedule.enabled:
            log.info("schedule %s: fired while disabled or deleted; nothing started", schedule_id)
            return None
        now = timezone.now()
        if fire_is_duplicate(schedule, now):
            log.info("schedule %s: duplicate fire within half a period; ignored", schedule.name)
            return None
        fire = schedule.fire_count + 1
        Schedule.objects.filter(pk=schedule.pk).update(fire_count=fire, last_fired_at=now)
        active = schedule_active_run(schedule) if schedule.overlap != Overlap.ALLOW else None
        if active is None:
            # A fire still waiting here means its hand-off was lost: this fire replaces it.
            Schedule.objects.filter(pk=schedule.pk).update(queued_fire=None)
            return _scheduled_run_start(schedule, fire)
        _fire_hold(schedule, fire, active)
        return None


def _fire_hold(schedule: Schedule, fire: int, active: JobRun) -> None:
    """A fire meeting an active run: the first one waits (overlap=queue), others are skipped."""
    if schedule.overlap == Overlap.QUEUE and schedule.queued_fire is None:
        Schedule.objects.filter(pk=schedule.pk).update(queued_fire=fire)
        message = f"schedule {schedule.name}: fire {fire} waits for this run to end"
        event_record("schedule.queued", run=active, message=message, schedule=schedule.name, fire=fire)
        return
    reason = f"this run is still {active.status}"
    if schedule.queued_fire:
        reason += f"; fire {schedule.queued_fire} is already waiting"
    message = f"schedule {schedule.name}: fire {fire} skipped, {reason}"
    event_record("schedule.skipped", run=active, message=message, schedule=schedule.name, fire=fire)


def schedule_queued_start(*, schedule_id: int) -> JobRun | None:
    """Start the fire that waited for the previous run (overlap=queue), if nothing runs now."""
    with transaction.atomic():
        schedule = _schedule_locked(schedule_id)
        if schedule is None or not schedule.enabled or schedule.queued_fire is None:
            return None
        if schedule_active_run(schedule) is not None:
            return None  # that run's end hands on again
        Schedule.objects.filter(pk=schedule.pk).update(queued_fire=None)
        return _scheduled_run_start(schedule, schedule.queued_fire)


def _schedule_locked(schedule_id: int) -> Schedule | None:
    return (
        # Only the schedule's row is locked: PostgreSQL cannot lock the nullable side of the
        # outer join a pinned version (template_version, NULL when unpinned) reads through.
        Schedule.objects.select_for_update(of=("self",))
        .select_related("template", "template_version")
        .filter(pk=schedule_id)
        .first()
    )


def _scheduled_run_start(schedule: Schedule, fire: int) -> JobRun | None:
    try:
        run, created = run_start(
            template=schedule.template,
            version=pinned_version_number(schedule),
            parameters=schedule.parameters,
            trigger=Trigger.SCHEDULE,
            triggered_by=f"schedule {schedule.name}",
            priority=schedule.priority,
            idempotency_key=f"schedule:{schedule.pk}:{fire}",
        )
    except RunStartError as exc:
        event_record(
            "schedule.failed",
            message=f"schedule {schedule.name}: {exc.field}: {exc}",
            schedule=schedule.name,
            fire=fire,
        )
        return None
    if created:
        ScheduledRun.objects.create(schedule=schedule, run=run, fire=fire)
    return run


def run_ended(sender, event: RunEvent, **kwargs) -> None:
    """jobs.events.run_ended: when a scheduled run ends, start its schedule's waiting fire.

    The start is a task after commit, so the engine's transaction stays short. If this
    hand-off is lost, the schedule's next fire starts the run instead.
    """
    if event.run_id is None:
        return
    run = event_run(event)
    if run is not None and run.trigger != Trigger.SCHEDULE:
        return  # only scheduled runs have a ScheduledRun: no query inside the engine's batch
    waiting = ScheduledRun.objects.filter(run_id=event.run_id, schedule__queued_fire__isnull=False)
    for schedule_id in waiting.values_list("schedule_id", flat=True):
        transaction.on_commit(lambda schedule_id=schedule_id: _queued_start_enqueue(schedule_id))


def _queued_start_enqueue(schedule_id: int) -> None:
    current_app.signature(QUEUED_START_TASK, args=(schedule_id,)).delay()


def schedule_deleted(sender, instance: Schedule, **kwargs) -> None:
    """post_delete of Schedule (also admin bulk deletes): its PeriodicTask goes with it."""
    schedule_periodic_task_delete(schedule=instance)
