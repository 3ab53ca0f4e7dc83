"""Monitor tick micro-benchmark: 100,000 pending deadlines, 100 due, one tick timed.

Runs in this process against the stack's Redis under its own key prefix, with the tasks the
tick enqueues sent to a scratch queue that nobody consumes and that is purged afterwards.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from django.conf import settings

from devices.locks import lock_epoch_start
from iotqueue import celery_app
from iotqueue.redis_conn import redis_connection
from jobs.deadlines import Deadline, deadlines_pending, deadlines_set
from jobs.monitor import monitor_tick

# Deadlines written per ZADD: big enough to load 100k in a few round trips, small enough
# not to stall Redis for other clients.
CHUNK = 10_000
# Pending deadlines lie this far ahead: none falls due during the measurement.
FUTURE_SECONDS = 3600.0
# Step run ids of the synthetic deadlines start here, clear of any real step's id.
SYNTHETIC_ID_BASE = 10**9


def _due_add(due: int, round_: int) -> None:
    base = SYNTHETIC_ID_BASE + (round_ + 1) * 10**6
    deadlines_set({Deadline("done", base + i, 1): time.time() - 1.0 for i in range(due)})


def _tick_timed(due: int) -> tuple[float, dict[str, int]]:
    started = time.perf_counter()
    counts = monitor_tick()
    elapsed = time.perf_counter() - started
    if counts["deadlines"] != due:
        raise RuntimeError(f"monitor tick claimed {counts['deadlines']} deadlines, expected {due}")
    return elapsed, counts


def monitor_tick_measure(*, namespace: str, pending: int, due: int, repeats: int) -> dict[str, Any]:
    """Time monitor_tick() with `pending` future and `due` due deadlines.

    The first tick also runs the database reconcile (its key is not set yet) and is reported
    apart; the result is the median of `repeats` steady ticks, each with `due` fresh ones.
    """
    prefix, queue = f"{namespace}-monitor", f"{namespace}-monitor-scratch"
    saved = settings.IOTQUEUE_REDIS_KEY_PREFIX, celery_app.conf.task_default_queue
    settings.IOTQUEUE_REDIS_KEY_PREFIX, celery_app.conf.task_default_queue = prefix, queue
    redis_connection.cache_clear()
    try:
        future = time.time() + FUTURE_SECONDS
        for start in range(0, pending, CHUNK):
            deadlines_set(
                {Deadline("done", i, 1): future + i / 1000 for i in range(start, min(pending, start + CHUNK))}
            )
        lock_epoch_start()
        _due_add(due, 0)
        first, _ = _tick_timed(due)
        steady = []
        for round_ in range(1, repeats + 1):
            _due_add(due, round_)
            elapsed, _ = _tick_timed(due)
            steady.append(elapsed)
        left = deadlines_pending()
    finally:
        purged = _scratch_clear(prefix, queue)
        settings.IOTQUEUE_REDIS_KEY_PREFIX, celery_app.conf.task_default_queue = saved
        redis_connection.cache_clear()
    return {
        "pending": pending,
        "due": due,
        "repeats": repeats,
        "left_pending": left,
        # Every claimed deadline became a task on the scratch queue: (1 + repeats) * due.
        "tasks_purged": purged,
        "first_tick_ms": round(first * 1000, 2),
        "tick_ms": round(statistics.median(steady) * 1000, 2),
        "tick_max_ms": round(max(steady) * 1000, 2),
    }


def _scratch_clear(prefix: str, queue: str) -> int:
    """Delete the scratch keys and the scratch queue (only names this module made).

    Returns how many tasks the queue held.
    """
    conn = redis_connection()
    keys = list(conn.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        conn.unlink(*keys)
    with celery_app.connection_for_write() as connection:
        purged = connection.default_channel.queue_purge(queue) or 0
        connection.default_channel.queue_delete(queue)
    return purged
