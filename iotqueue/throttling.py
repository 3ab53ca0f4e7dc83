"""API rate limits (DRF throttles), counted in Django's cache, which is Redis, so that every
web process and replica shares one count.

Scopes and their rates are settings (REST_FRAMEWORK's DEFAULT_THROTTLE_RATES): "write" for
POST, PUT, PATCH and DELETE anywhere in the API, per user; "token" for the token endpoint,
per client address, against password guessing.
"""

from __future__ import annotations

from django.http import HttpRequest
from rest_framework.permissions import SAFE_METHODS
from rest_framework.throttling import BaseThrottle, SimpleRateThrottle, UserRateThrottle


class WriteRateThrottle(UserRateThrottle):
    """Writes per user (per address when signed out); reads are not limited."""

    scope = "write"

    def allow_request(self, request, view) -> bool:
        if request.method in SAFE_METHODS:
            return True
        return super().allow_request(request, view)


class TokenObtainThrottle(SimpleRateThrottle):
    """Token requests per client address, signed in or not."""

    scope = "token"

    def get_cache_key(self, request, view) -> str:
        return self.cache_format % {"scope": self.scope, "ident": self.get_ident(request)}


def client_address(request: HttpRequest) -> str:
    """The client's address as the throttles see it (REMOTE_ADDR, or X-Forwarded-For behind
    NUM_PROXIES trusted proxies); the admin's login lockout uses the same."""
    return BaseThrottle().get_ident(request)
