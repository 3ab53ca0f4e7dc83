"""The raw-Celery baseline's tasks: a no-op chain link that counts finished chains in Redis,
and a link that stamps when it started, for the hop latency."""

from __future__ import annotations

import json
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


@shared_task(name="bench.hop")
def hop(stamps: list[float] | None = None, key: str = "") -> list[float]:
    """Append the time this link started to the stamps the link before returned (a chain
    hands each link's return value to the next); the last link (given `key`) pushes them to
    that Redis list."""
    stamps = [*(stamps or []), time.time()]
    if key:
        redis_connection().rpush(key, json.dumps(stamps))
    return stamps
