"""The jobs app's periodic tasks reach beat's table: by DatabaseScheduler and monitors_install."""

from __future__ import annotations

import io

import pytest
from django.core.management import call_command
from django_celery_beat.models import PeriodicTask
from django_celery_beat.schedulers import DatabaseScheduler

from iotqueue import celery_app
from jobs.beat import MONITOR_ENTRY, RETENTION_ENTRY


def installed() -> dict[str, tuple[str, int, bool]]:
    """{periodic task name: (task, interval in seconds, enabled)} of the jobs app's entries."""
    rows = PeriodicTask.objects.select_related("interval").filter(name__in=[MONITOR_ENTRY, RETENTION_ENTRY])
    return {row.name: (row.task, row.interval.every, row.enabled) for row in rows}


# Transactional: the scheduler closes the database connection as it does between ticks.
@pytest.mark.django_db(transaction=True)
def test_beat_with_the_database_scheduler_installs_the_entries():
    # given no periodic task in beat's table
    PeriodicTask.objects.filter(name__in=[MONITOR_ENTRY, RETENTION_ENTRY]).delete()

    # when beat's configured scheduler starts
    DatabaseScheduler(app=celery_app)

    # then the monitor tick and retention are in its table
    assert installed() == {
        MONITOR_ENTRY: ("jobs.monitor_tick", 1, True),
        RETENTION_ENTRY: ("jobs.runs_prune", 3600, True),
    }


@pytest.mark.django_db
def test_monitors_install_writes_the_entries_once():
    # given a monitor entry an operator disabled
    call_command("monitors_install", stdout=io.StringIO())
    PeriodicTask.objects.filter(name=MONITOR_ENTRY).update(enabled=False)

    # when the command runs twice
    first, second = io.StringIO(), io.StringIO()
    call_command("monitors_install", stdout=first)
    call_command("monitors_install", stdout=second)

    # then the first run enables it again and the second changes nothing
    assert f"{MONITOR_ENTRY}: jobs.monitor_tick every 1s installed" in first.getvalue()
    assert second.getvalue().splitlines() == [
        f"{MONITOR_ENTRY}: up to date",
        f"{RETENTION_ENTRY}: up to date",
    ]
    assert installed()[MONITOR_ENTRY] == ("jobs.monitor_tick", 1, True)
