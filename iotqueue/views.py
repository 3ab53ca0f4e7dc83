"""/metrics: the Prometheus scrape endpoint, for a bearer token or a staff session.

Scrapers cannot log in, so IOTQUEUE_METRICS_TOKEN, when set, lets a request carrying
`Authorization: Bearer <token>` in. Without a token only staff users (the admin's
session) see the metrics: device names and failure counts are not for everyone.
"""

from __future__ import annotations

import hmac
import logging

import redis
from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_GET

from .metrics import metrics_render

log = logging.getLogger(__name__)


def _bearer_token_valid(request: HttpRequest) -> bool:
    expected = settings.IOTQUEUE_METRICS_TOKEN
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if not expected or scheme.lower() != "bearer":
        return False
    # Constant time: a scraper-facing endpoint must not leak the token byte by byte.
    return hmac.compare_digest(given.strip().encode(), expected.encode())


def _denied(request: HttpRequest) -> HttpResponse | None:
    """401 without valid credentials, 403 for a signed-in user who is not staff."""
    if _bearer_token_valid(request) or (request.user.is_authenticated and request.user.is_staff):
        return None
    if request.user.is_authenticated:
        return HttpResponse("metrics are for staff users\n", status=403, content_type="text/plain")
    response = HttpResponse(
        "send Authorization: Bearer <IOTQUEUE_METRICS_TOKEN>, or sign in as a staff user\n",
        status=401,
        content_type="text/plain",
    )
    response["WWW-Authenticate"] = 'Bearer realm="iotqueue metrics"'
    return response


@require_GET
def metrics_view(request: HttpRequest) -> HttpResponse:
    """Prometheus text exposition of every process's counters (kept in Redis)."""
    denied = _denied(request)
    if denied is not None:
        return denied
    try:
        body, content_type = metrics_render(request.headers.get("Accept", ""))
    except redis.RedisError as exc:
        # A failed scrape (up == 0) is the honest answer: partial numbers would look like resets.
        log.error("metrics: Redis unreachable: %s", exc)
        return HttpResponse(f"metrics store unreachable: {exc}\n", status=503, content_type="text/plain")
    return HttpResponse(body, content_type=content_type)
