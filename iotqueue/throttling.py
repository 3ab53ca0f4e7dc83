"""API rate limits (DRF throttles), counted atomically in Redis so that every web process and
replica shares one exact count; and the login lockout's per-address limit.

Scopes and their rates are settings (REST_FRAMEWORK's DEFAULT_THROTTLE_RATES): "write" for
POST, PUT, PATCH and DELETE anywhere in the API, per user; "token" for the token endpoint,
per client address, against password guessing.

DRF's own throttles keep a list of timestamps in the cache and read, check and write it back
in three steps: requests arriving together read the same list, and each adds itself to its
own copy, so under concurrency most of them go uncounted (1,300 concurrent writes left
1,038 entries). Here one Lua script increments the count and starts its window in one step.
"""

from __future__ import annotations

import functools

from axes.handlers.database import AxesDatabaseHandler
from axes.models import AccessAttempt
from django.conf import settings
from django.db.models import Sum
from django.http import HttpRequest
from django.utils import timezone
from redis.commands.core import Script
from rest_framework.permissions import SAFE_METHODS
from rest_framework.throttling import BaseThrottle, SimpleRateThrottle

from .redis_conn import redis_connection, redis_key

# A fixed window that opens with the first request of a key: the first INCR sets the expiry,
# later ones leave it, so a client hammering over the limit cannot push the window's end out.
# A key that lost its expiry (it cannot, but a key without one would throttle for ever) gets
# it back. Answers the count including this request, and the window's milliseconds left.
WINDOW_COUNT_LUA = """
local count = redis.call('INCR', KEYS[1])
local ttl = redis.call('PTTL', KEYS[1])
if count == 1 or ttl < 0 then
    redis.call('PEXPIRE', KEYS[1], ARGV[1])
    ttl = tonumber(ARGV[1])
end
return {count, ttl}
"""


@functools.cache
def _window_count_script() -> Script:
    # Not bound to a client: each call names REDIS_URL's client of the moment.
    return Script(None, WINDOW_COUNT_LUA.encode())


class AtomicRateThrottle(SimpleRateThrottle):
    """DRF's rate throttle (same scopes, rates and cache keys), counted by one Redis script.

    At most `num_requests` requests of one key are allowed per window of `duration`
    seconds, the window opening with the key's first request; Retry-After is the time left
    in the window. How it fails: a Redis that does not answer raises (the request fails
    with a 500 after the client's socket timeout) rather than letting requests through.
    """

    def allow_request(self, request, view) -> bool:
        if self.rate is None:
            return True
        key = self.get_cache_key(request, view)
        if key is None:
            return True
        count, ttl_ms = _window_count_script()(
            keys=[redis_key("api", key)], args=[self.duration * 1000], client=redis_connection()
        )
        self.window_left = max(int(ttl_ms), 0) / 1000
        return int(count) <= self.num_requests

    def wait(self) -> float:
        return getattr(self, "window_left", float(self.duration))


class WriteRateThrottle(AtomicRateThrottle):
    """Writes per user (per address when signed out); reads are not limited."""

    scope = "write"

    def allow_request(self, request, view) -> bool:
        if request.method in SAFE_METHODS:
            return True
        return super().allow_request(request, view)

    def get_cache_key(self, request, view) -> str:
        if request.user and request.user.is_authenticated:
            ident = request.user.pk
        else:
            ident = self.get_ident(request)
        return self.cache_format % {"scope": self.scope, "ident": ident}


class TokenObtainThrottle(AtomicRateThrottle):
    """Token requests per client address, signed in or not."""

    scope = "token"

    def get_cache_key(self, request, view) -> str:
        return self.cache_format % {"scope": self.scope, "ident": self.get_ident(request)}


def client_address(request: HttpRequest) -> str:
    """The client's address as the throttles see it (REMOTE_ADDR, or X-Forwarded-For behind
    NUM_PROXIES trusted proxies); the admin's login lockout uses the same."""
    return BaseThrottle().get_ident(request)


class AddressLimitedLockoutHandler(AxesDatabaseHandler):
    """django-axes' database handler (AXES_HANDLER), also locking a client address out after
    IOTQUEUE_LOGIN_ADDRESS_FAILURE_LIMIT failed logins of any usernames within the cool-off.

    axes counts one limit over its lockout parameters (AXES_LOCKOUT_PARAMETERS), so a
    username-and-address lockout lets one address try a few passwords on every username
    (password spraying), and adding the address alone would lock that address at the same
    low limit. Here the address has its own, higher limit, counted from the attempts axes
    records: the lockout is axes' own (429, its message, its log), and `axes_reset_ip`
    lifts it. Addresses on axes' allow list are never locked (axes checks that first).
    """

    def is_locked(self, request, credentials: dict | None = None) -> bool:
        if super().is_locked(request, credentials):
            return True
        return login_address_failures(request) >= settings.IOTQUEUE_LOGIN_ADDRESS_FAILURE_LIMIT


def login_address_failures(request: HttpRequest) -> int:
    """Failed logins from the request's client address, any username, within the cool-off."""
    since = timezone.now() - settings.AXES_COOLOFF_TIME
    attempts = AccessAttempt.objects.filter(ip_address=client_address(request), attempt_time__gte=since)
    return attempts.aggregate(failures=Sum("failures_since_start"))["failures"] or 0
