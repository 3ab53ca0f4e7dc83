"""Django's cache on the project's Redis, under its key prefix.

Django's own RedisCache, except that the server and the key prefix are REDIS_URL and
IOTQUEUE_REDIS_KEY_PREFIX as they are when the cache is used, not when it was built:
Django builds cache objects early (the test database's creation does), and a process that
points REDIS_URL elsewhere after start (the test session) must be followed, as
`redis_conn.redis_connection()` follows it. Every web process and replica so counts in the
same Redis as the device locks.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.cache.backends.redis import RedisCache
from django.utils.functional import cached_property

from .redis_conn import SOCKET_TIMEOUT_SECONDS


class ProjectRedisCache(RedisCache):
    def __init__(self, server: str, params: dict[str, Any]) -> None:
        options = {
            # A Redis that stopped answering fails the request instead of hanging it.
            "socket_timeout": SOCKET_TIMEOUT_SECONDS,
            "socket_connect_timeout": SOCKET_TIMEOUT_SECONDS,
            **params.get("OPTIONS", {}),
        }
        super().__init__(server, {**params, "OPTIONS": options})

    @cached_property
    def _cache(self):
        return self._class([settings.REDIS_URL], **self._options)

    def make_key(self, key: str, version: int | None = None) -> str:
        return self.key_func(
            key, settings.IOTQUEUE_REDIS_KEY_PREFIX, self.version if version is None else version
        )
