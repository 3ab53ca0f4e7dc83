"""Retention: finished runs and their steps and events are deleted after a while, in batches."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from .models import RUN_TERMINAL, JobRun, RunEvent

# Rows deleted per statement: small enough that a delete never holds the database for long.
BATCH = 500


def runs_prune(
    *,
    older_than_days: float | None = None,
    orphans_older_than_days: float | None = None,
    max_batches: int = 100,
) -> int:
    """Delete finished runs older than the retention age, and events of no run older than
    their own, shorter one (IOTQUEUE_ORPHAN_EVENT_RETENTION_DAYS); returns runs deleted."""
    days = settings.IOTQUEUE_RETENTION_DAYS if older_than_days is None else older_than_days
    orphan_days = (
        settings.IOTQUEUE_ORPHAN_EVENT_RETENTION_DAYS
        if orphans_older_than_days is None
        else orphans_older_than_days
    )
    cutoff = timezone.now() - timedelta(days=days)
    orphan_cutoff = timezone.now() - timedelta(days=orphan_days)
    deleted = 0
    for _ in range(max_batches):
        ids = list(
            JobRun.objects.filter(status__in=RUN_TERMINAL, finished_at__lt=cutoff).values_list(
                "pk", flat=True
            )[:BATCH]
        )
        if not ids:
            break
        JobRun.objects.filter(pk__in=ids).delete()
        deleted += len(ids)
    for _ in range(max_batches):
        ids = list(
            RunEvent.objects.filter(run__isnull=True, created_at__lt=orphan_cutoff).values_list(
                "pk", flat=True
            )[:BATCH]
        )
        if not ids:
            break
        RunEvent.objects.filter(pk__in=ids).delete()
    return deleted
