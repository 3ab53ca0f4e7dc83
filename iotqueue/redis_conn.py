"""The process-wide Redis connection used for device locks and deadlines."""

from __future__ import annotations

import functools

import redis
from django.conf import settings

# redis-py 8 defaults to a 5 s socket timeout; lock scripts answer in microseconds, so a
# call taking this long means Redis is gone and the caller should fail and be retried.
SOCKET_TIMEOUT_SECONDS = 5.0


@functools.cache
def redis_connection() -> redis.Redis:
    """Shared client (its pool is fork-safe: redis-py resets it in a child process)."""
    return redis.Redis.from_url(
        settings.REDIS_URL,
        decode_responses=True,
        socket_timeout=SOCKET_TIMEOUT_SECONDS,
        socket_connect_timeout=SOCKET_TIMEOUT_SECONDS,
        health_check_interval=30,
        retry_on_timeout=True,
    )


def redis_key(*parts: str) -> str:
    """A key under the project's prefix, e.g. iq:lock:lamp-2."""
    return ":".join((settings.IOTQUEUE_REDIS_KEY_PREFIX, *parts))
