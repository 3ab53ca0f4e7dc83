"""The jobs app registers its periodic tasks with Celery's beat schedule (jobs/beat.py).

That beat's DatabaseScheduler turns them into rows, and `monitors_install` too, is in
tests/jobs/test_beat.py (stack tier: it needs the database).
"""

from __future__ import annotations

from django.conf import settings

from iotqueue import celery_app
from jobs import tasks
from jobs.beat import MONITOR_ENTRY, RETENTION_ENTRY, beat_entries, beat_entries_register


def test_loading_the_app_put_its_entries_in_the_beat_schedule():
    # given the apps loaded (as in beat, which loads Django before it reads its schedule)
    schedule = celery_app.conf.beat_schedule

    # then the monitor tick and retention are there, every tick as often as settings say
    assert schedule[MONITOR_ENTRY]["task"] == tasks.monitor_tick_task.name == "jobs.monitor_tick"
    assert schedule[MONITOR_ENTRY]["schedule"] == settings.IOTQUEUE_MONITOR_INTERVAL
    assert schedule[RETENTION_ENTRY]["task"] == tasks.runs_prune_task.name == "jobs.runs_prune"
    assert schedule[RETENTION_ENTRY]["schedule"] == 3600.0


def test_settings_name_no_periodic_task():
    # the app owns its entries; settings keep only the intervals operators tune
    assert getattr(settings, "CELERY_BEAT_SCHEDULE", {}) == {}


def test_registering_again_replaces_the_entries(settings, monkeypatch):
    # given an operator's other monitor interval (the schedule as it was comes back after)
    schedule = celery_app.conf.beat_schedule
    monkeypatch.setitem(schedule, MONITOR_ENTRY, schedule[MONITOR_ENTRY])
    settings.IOTQUEUE_MONITOR_INTERVAL = 0.25

    # when the entries are registered again
    beat_entries_register(celery_app)

    # then the monitor's entry has the new interval, for the same task
    assert schedule[MONITOR_ENTRY]["schedule"] == 0.25
    assert schedule[MONITOR_ENTRY]["task"] == beat_entries()[MONITOR_ENTRY]["task"]
