"""The raw-Celery baseline's task: a no-op chain link that counts finished chains in Redis."""

from __future__ import annotations

import time

from celery import shared_task

from iotqueue.redis_conn import redis_connection


def finished_key(counter_key: str) -> str:
    """Where the last chain to finish leaves its completion time (seconds since the epoch)."""
    return f"{counter_key}:finished_at"


@shared_task(name="bench.noop")
def noop(counter_key: str = "", expected: int = 0) -> None:
    """Do nothing; as a chain's last link, count the chain and stamp the time when all are done.

    Only last links touch Redis, so the baseline costs what a plain chain costs plus one INCR
    per chain, not per link.
    """
    if not counter_key:
        return
    conn = redis_connection()
    if conn.incr(counter_key) == expected:
        conn.set(finished_key(counter_key), repr(time.time()))
