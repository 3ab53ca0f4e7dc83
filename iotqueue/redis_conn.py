"""The process-wide Redis connections: REDIS_URL for everything, LOCK_REDIS_URL for the locks.

`redis_connection()` is the Redis of REDIS_URL: Celery's broker, the engine's inbox,
metrics, limits. `lock_redis_connection()` is where the device locks and the deadline sets
live (devices/locks.py, jobs/deadlines.py): the same client unless LOCK_REDIS_URL names
another server, and a `redis.RedisCluster` when that URL's scheme is `redis+cluster://`
(or `rediss+cluster://`, TLS): then every key the lock scripts touch carries a shard's hash
tag (devices/locks.py), so that each script call stays in one hash slot.
"""

from __future__ import annotations

import functools

import redis
from django.conf import settings

# redis-py 8 defaults to a 5 s socket timeout; lock scripts answer in microseconds, so a
# call taking this long means Redis is gone and the caller should fail and be retried.
SOCKET_TIMEOUT_SECONDS = 5.0
# LOCK_REDIS_URL schemes that name a Redis Cluster (any node of it), and the plain scheme
# redis-py's RedisCluster reads.
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}

_OPTIONS = {
    "decode_responses": True,
    "socket_timeout": SOCKET_TIMEOUT_SECONDS,
    "socket_connect_timeout": SOCKET_TIMEOUT_SECONDS,
}


@functools.cache
def redis_connection() -> redis.Redis:
    """Shared client (its pool is fork-safe: redis-py resets it in a child process)."""
    return _client(settings.REDIS_URL)


def lock_redis_connection() -> redis.Redis | redis.RedisCluster:
    """The client of the device locks and deadlines: REDIS_URL's unless LOCK_REDIS_URL says.

    Read at every call, so a process (the tests) that points either setting elsewhere is
    followed; the client of each URL is made once.
    """
    url = settings.LOCK_REDIS_URL
    if not url or url == settings.REDIS_URL:
        return redis_connection()
    return _lock_client(url)


def lock_redis_shared() -> bool:
    """True when the locks live on REDIS_URL's client: one pipeline can carry both."""
    return lock_redis_connection() is redis_connection()


@functools.cache
def _lock_client(url: str) -> redis.Redis | redis.RedisCluster:
    scheme, sep, rest = url.partition("://")
    if sep and scheme.lower() in CLUSTER_SCHEMES:
        return redis.RedisCluster.from_url(f"{CLUSTER_SCHEMES[scheme.lower()]}://{rest}", **_OPTIONS)
    return _client(url)


def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, **_OPTIONS, health_check_interval=30, retry_on_timeout=True)


def redis_key(*parts: str) -> str:
    """A key under the project's prefix, e.g. iq:lock:lamp-2."""
    return ":".join((settings.IOTQUEUE_REDIS_KEY_PREFIX, *parts))
