"""`/healthz` and `/readyz`, answered by a middleware first in MIDDLEWARE (iotqueue/health.py checks).

First, so a probe is answered before SecurityMiddleware's HTTPS redirect (SECURE_SSL_REDIRECT)
and before anything reads the Host header (ALLOWED_HOSTS): a load balancer or kubelet probes
the pod's own address over plain HTTP. No session, no authentication, no database row read;
only `/readyz` touches the dependencies, each within health.CHECK_TIMEOUT_SECONDS.
"""

from __future__ import annotations

from collections.abc import Callable

from django.http import HttpRequest, HttpResponse, JsonResponse

from .health import readiness_checks, readiness_report

LIVENESS_PATH = "/healthz"
READINESS_PATH = "/readyz"
# Probes are polled every few seconds: an answer must never come from a cache.
NO_STORE = "no-store"


def liveness_response() -> JsonResponse:
    """The process serves requests: nothing else is checked (a dependency's outage must not
    make a supervisor restart every web replica)."""
    return JsonResponse({"status": "ok"})


def readiness_response() -> JsonResponse:
    """200 when the database, Redis and the MQTT broker answer, else 503; each check named."""
    status, body = readiness_report(readiness_checks())
    return JsonResponse(body, status=status)


PROBES: dict[str, Callable[[], JsonResponse]] = {
    LIVENESS_PATH: liveness_response,
    READINESS_PATH: readiness_response,
}


class ProbeMiddleware:
    """Answers GET/HEAD of the probe paths itself; passes every other request on."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        probe = PROBES.get(request.path_info.rstrip("/") or "/")
        if probe is None or request.method not in ("GET", "HEAD"):
            return self.get_response(request)
        response = probe()
        response["Cache-Control"] = NO_STORE
        return response
