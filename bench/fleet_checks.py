"""What a fleet run left behind, read from the database and Redis once it ended: rows by
status, anything still open or held, latencies, and the rows it created (bench.fleet)."""

from __future__ import annotations

import time
from typing import Any

from .report import spread_ms

# Devices whose lock state is read per call.
LOCK_STATES_CHUNK = 1000
# How long leftovers may take to drain once the run ended.
SETTLE_TIMEOUT_SECONDS = 30.0


def status_counts(run) -> dict[str, int]:
    from django.db.models import Count

    from jobs.models import StepRun

    rows = StepRun.objects.filter(run=run).values("status").annotate(n=Count("id"))
    return {row["status"]: row["n"] for row in rows}


def leftovers(run, names: list[str]) -> dict[str, int]:
    """What is left behind: open rows, device locks held, waiters, inbox entries, Celery queue."""
    from django.conf import settings

    from devices.locks import device_lock_states
    from iotqueue.redis_conn import redis_connection
    from jobs import inbox
    from jobs.models import STEP_TERMINAL, StepRun

    held = waiting = 0
    for start in range(0, len(names), LOCK_STATES_CHUNK):
        for state in device_lock_states(names[start : start + LOCK_STATES_CHUNK]).values():
            held += state.holder is not None
            waiting += len(state.queue)
    conn = redis_connection()
    stream = inbox.INBOX.key()
    return {
        "open_rows": StepRun.objects.filter(run=run).exclude(status__in=STEP_TERMINAL).count(),
        "locks_held": held,
        "waiters": waiting,
        "inbox_entries": conn.xlen(stream) if conn.exists(stream) else 0,
        "celery_queue": conn.llen(settings.CELERY_TASK_DEFAULT_QUEUE),
    }


def leftovers_settle(run, names: list[str]) -> dict[str, int]:
    """leftovers(), polled until all are zero or SETTLE_TIMEOUT_SECONDS passed."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_SECONDS
    while True:
        left = leftovers(run, names)
        if not any(left.values()) or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def latencies(run, arrived: dict[str, float]) -> dict[str, Any]:
    """From a command's arrival at its device to its row's finished_at, per succeeded device."""
    from jobs.models import StepRun, StepStatus

    rows = StepRun.objects.filter(run=run, status=StepStatus.SUCCEEDED).values_list(
        "command_id", "finished_at"
    )
    samples = [f.timestamp() - arrived[c] for c, f in rows if c in arrived and f is not None]
    return spread_ms(samples)


def rows_created(run) -> dict[str, int]:
    """Database rows one fleet run leaves: the run, its step rows, its events (by kind)."""
    from django.db.models import Count

    from jobs.models import RunEvent, StepRun

    events = RunEvent.objects.filter(run=run).values("kind").annotate(n=Count("id"))
    by_kind = {row["kind"]: row["n"] for row in events}
    return {
        "runs": 1,
        "step_runs": StepRun.objects.filter(run=run).count(),
        "events": sum(by_kind.values()),
        "events_by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
    }
