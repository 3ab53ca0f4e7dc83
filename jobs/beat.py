"""The jobs app's periodic tasks: the beat entries the engine needs to keep time.

Registered on the Celery app when the app loads (jobs/apps.py), as `beat_schedule`
entries: beat's DatabaseScheduler copies them into its PeriodicTask table when it starts
(a file-based scheduler keeps them in its file), and `manage.py monitors_install` writes
the same rows explicitly; both are idempotent. Operators tune the monitor's period in
settings (IOTQUEUE_MONITOR_INTERVAL); the entries and task names belong here.
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from django.conf import settings

# The tasks beat sends, by name (jobs/tasks.py defines them under these names).
MONITOR_TASK = "jobs.monitor_tick"
RETENTION_TASK = "jobs.runs_prune"
# Retention is counted in days, so a pass an hour late deletes nothing that matters late,
# and an hour of finished runs fits in one pass (runs_prune stops after 100 batches of 500).
RETENTION_INTERVAL_SECONDS = 3600.0

# Periodic task names, as beat's table and log show them (docs/operations.md).
MONITOR_ENTRY = "iotqueue-monitor"
RETENTION_ENTRY = "iotqueue-retention"


def beat_entries() -> dict[str, dict[str, Any]]:
    """Beat's entries for the jobs app: {periodic task name: {"task", "schedule" (seconds)}}."""
    return {
        MONITOR_ENTRY: {"task": MONITOR_TASK, "schedule": float(settings.IOTQUEUE_MONITOR_INTERVAL)},
        RETENTION_ENTRY: {"task": RETENTION_TASK, "schedule": RETENTION_INTERVAL_SECONDS},
    }


def beat_entries_register(app: Celery) -> None:
    """Add the entries to `app`'s beat schedule (Celery applies them once it is configured).

    Registering again replaces the entries, so it is safe from every process that loads
    the app; only beat reads them.
    """
    for name, entry in beat_entries().items():
        app.add_periodic_task(entry["schedule"], app.signature(entry["task"]), name=name)
