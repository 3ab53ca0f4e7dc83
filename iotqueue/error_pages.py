"""Django's error pages for URLs under /api/ as JSON (`{"detail": ...}`, as DRF answers),
so that a path no route matches, e.g. a device name outside the name alphabet, gets the
404 body the schema documents rather than an HTML page. Elsewhere (admin) Django's own."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils.translation import gettext as _
from django.views import defaults

API_PREFIX = "/api/"


def not_found(request: HttpRequest, exception: Exception) -> HttpResponse:
    if request.path.startswith(API_PREFIX):
        return JsonResponse({"detail": _("Not found.")}, status=404)
    return defaults.page_not_found(request, exception)


def bad_request(request: HttpRequest, exception: Exception) -> HttpResponse:
    if request.path.startswith(API_PREFIX):
        return JsonResponse({"detail": _("Bad request.")}, status=400)
    return defaults.bad_request(request, exception)
