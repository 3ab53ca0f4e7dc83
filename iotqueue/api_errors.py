"""The API's exception handler: DRF's, answering in JSON with a 4xx what it would let
through as a 500 (a delete refused by a protected reference, a unique name lost to a
concurrent request, an oversized or malformed body as Django reports it)."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import RequestDataTooBig, SuspiciousOperation
from django.db import IntegrityError
from django.db.models import ProtectedError, RestrictedError
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy
from rest_framework import status
from rest_framework.exceptions import APIException, ParseError
from rest_framework.response import Response
from rest_framework.views import exception_handler, set_rollback

from .api import RequestTooLarge

# A 409 for deleting something still referenced names at most this many of the referrers:
# enough to find them, without one answer listing thousands of runs.
REFERRERS_SHOWN = 10
# SQLSTATE (PostgreSQL) and extended result code (SQLite) of a unique-constraint violation.
UNIQUE_VIOLATION_SQLSTATE = "23505"
UNIQUE_VIOLATION_SQLITE = ("SQLITE_CONSTRAINT_UNIQUE", "SQLITE_CONSTRAINT_PRIMARYKEY")


class UniqueConflict(APIException):
    status_code = status.HTTP_409_CONFLICT
    default_code = "conflict"
    default_detail = gettext_lazy(
        "Another request stored the same unique value (such as the same name) at the same time; "
        "nothing was changed by this one."
    )


def _deleted_label(view: Any) -> str:
    """`device 'lamp-2'`: what the view's DELETE names, from its model and URL."""
    model = getattr(getattr(view, "queryset", None), "model", None)
    lookup = getattr(view, "lookup_url_kwarg", None) or getattr(view, "lookup_field", None)
    key = getattr(view, "kwargs", {}).get(lookup) if lookup else None
    if model is None or key is None:
        return _("this object")
    return f"{model._meta.verbose_name} {key!r}"


def _referrers_conflict(exc: ProtectedError | RestrictedError, context: dict) -> Response:
    """409 naming what still refers to the object a DELETE wanted gone."""
    referrers = list(exc.protected_objects if isinstance(exc, ProtectedError) else exc.restricted_objects)
    what = _deleted_label(context.get("view"))
    shown = [
        {"type": str(obj._meta.verbose_name), "id": str(obj.pk), "name": str(obj)}
        for obj in referrers[:REFERRERS_SHOWN]
    ]
    kinds = sorted({str(obj._meta.verbose_name_plural) for obj in referrers})
    detail = _(
        "Cannot delete %(what)s: %(count)d object(s) still refer to it (%(kinds)s). "
        "Delete or change those first."
    ) % {"what": what, "count": len(referrers), "kinds": ", ".join(kinds)}
    set_rollback()
    return Response(
        {"detail": detail, "referenced_by": shown, "referenced_by_count": len(referrers)},
        status=status.HTTP_409_CONFLICT,
    )


def _unique_violation(exc: IntegrityError) -> bool:
    cause = exc.__cause__
    return (
        getattr(cause, "sqlstate", None) == UNIQUE_VIOLATION_SQLSTATE
        or getattr(cause, "sqlite_errorname", None) in UNIQUE_VIOLATION_SQLITE
    )


def api_exception_handler(exc: Exception, context: dict) -> Response | None:
    """DRF's exception handler, with answers for what it would let through as a 500.

    - deleting an object still referenced (on_delete=PROTECT): 409 naming the referrers;
    - a unique constraint lost to a concurrent request (two creates of one name both pass
      the serializer's uniqueness check): 409;
    - a body over DATA_UPLOAD_MAX_MEMORY_SIZE as Django reports it: 413, and the body's
      other refusals (too many form fields or files, a malformed multipart body): 400.
    Everything else, rolling back included, is DRF's.
    """
    if isinstance(exc, (ProtectedError, RestrictedError)):
        return _referrers_conflict(exc, context)
    if isinstance(exc, IntegrityError) and _unique_violation(exc):
        exc = UniqueConflict()
    elif isinstance(exc, RequestDataTooBig):
        exc = RequestTooLarge()
    elif isinstance(exc, SuspiciousOperation):
        exc = ParseError(str(exc))
    return exception_handler(exc, context)
