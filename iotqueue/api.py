"""REST plumbing shared by every app: parsers that bound what they accept (text that cannot
be stored — NUL characters and lone surrogates, iotqueue/text.py —, nesting depth, body
size) with a 4xx instead of a database error or a 500, a JSON field for stored JSON, and a
middleware refusing such text in URLs.

The exception handler lives in iotqueue/api_errors.py: it imports DRF's views, which import
the parsers named in the settings, i.e. this module.
"""

from __future__ import annotations

import json
from typing import Any

from django.conf import settings
from django.db import models
from django.http import HttpRequest, HttpResponse, JsonResponse, QueryDict
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy
from rest_framework import serializers, status
from rest_framework.exceptions import APIException, ParseError
from rest_framework.parsers import FormParser, JSONParser, MultiPartParser
from rest_framework.utils.json import strict_constant

from .jsondepth import json_max_depth, json_too_deep
from .text import text_problem, text_unstorable


class RequestTooLarge(APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_code = "request_too_large"

    def __init__(self) -> None:
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        super().__init__(
            _("The request body is larger than %(limit)d bytes (DATA_UPLOAD_MAX_MEMORY_SIZE).")
            % {"limit": limit}
        )


def _too_deep_message() -> str:
    return _("JSON nested more than %(limit)d levels deep is not accepted.") % {"limit": json_max_depth()}


def _body_size_check(parser_context: dict | None) -> None:
    """413 up front when the declared length is over the limit (before reading any of it)."""
    request = (parser_context or {}).get("request")
    try:
        declared = int(request.META.get("CONTENT_LENGTH") or 0) if request is not None else 0
    except ValueError:
        declared = 0
    if declared > settings.DATA_UPLOAD_MAX_MEMORY_SIZE:
        raise RequestTooLarge()


def _body_read(stream, parser_context: dict | None) -> bytes:
    """The whole body, refused with a 413 past DATA_UPLOAD_MAX_MEMORY_SIZE.

    DRF's parsers read the request stream themselves, so Django's own check of that limit
    (on `request.body` and `request.POST`) never runs for them.
    """
    _body_size_check(parser_context)
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    body = stream.read(limit + 1) if stream is not None else b""
    if len(body) > limit:
        raise RequestTooLarge()
    return body


def _text_refuse(data) -> None:
    problem = text_problem(dict(data.lists()) if hasattr(data, "lists") else data)  # a QueryDict: every value
    if problem:
        raise ParseError(_("Text that cannot be stored is not accepted: %(problem)s") % {"problem": problem})


class NulRefusingJSONParser(JSONParser):
    """DRF's JSON parser, refusing (400) a NUL or a lone surrogate in any string or key and nesting
    beyond IOTQUEUE_JSON_MAX_DEPTH, and (413) a body over DATA_UPLOAD_MAX_MEMORY_SIZE."""

    def parse(self, stream, media_type=None, parser_context=None):
        body = _body_read(stream, parser_context)
        encoding = (parser_context or {}).get("encoding") or settings.DEFAULT_CHARSET
        parse_constant = strict_constant if self.strict else None
        try:
            data = json.loads(body.decode(encoding), parse_constant=parse_constant)
        except RecursionError:
            raise ParseError(_too_deep_message()) from None
        except ValueError as exc:  # UnicodeDecodeError included
            raise ParseError(_("JSON parse error - %(error)s") % {"error": exc}) from None
        if json_too_deep(data):
            raise ParseError(_too_deep_message())
        _text_refuse(data)
        return data


class NulRefusingFormParser(FormParser):
    def parse(self, stream, media_type=None, parser_context=None):
        encoding = (parser_context or {}).get("encoding") or settings.DEFAULT_CHARSET
        data = QueryDict(_body_read(stream, parser_context), encoding=encoding)
        _text_refuse(data)
        return data


class NulRefusingMultiPartParser(MultiPartParser):
    def parse(self, stream, media_type=None, parser_context=None):
        _body_size_check(parser_context)  # Django's parser bounds the fields, not the files
        parsed = super().parse(stream, media_type, parser_context)
        _text_refuse(parsed.data)
        return parsed


class BoundedJSONField(serializers.JSONField):
    """A stored JSON value: at most IOTQUEUE_JSON_MAX_DEPTH deep, and `null` only where allowed.

    Form and multipart bodies carry JSON fields as strings that DRF decodes here, after the
    parser's checks: without these, `config=null` reached the database (a NOT NULL error)
    and a deeply nested string a RecursionError.
    """

    default_error_messages = {
        "too_deep": gettext_lazy("JSON nested more than {limit} levels deep is not accepted."),
        "text": gettext_lazy("Text that cannot be stored is not accepted: {problem}"),
    }

    def to_internal_value(self, data: Any) -> Any:
        try:
            value = super().to_internal_value(data)
        except RecursionError:
            self.fail("too_deep", limit=json_max_depth())
        if value is None and not self.allow_null:
            self.fail("null")
        if json_too_deep(value):
            self.fail("too_deep", limit=json_max_depth())
        problem = text_problem(value)
        if problem:
            self.fail("text", problem=problem)
        return value


class BoundedModelSerializer(serializers.ModelSerializer):
    """A ModelSerializer whose JSON model fields are BoundedJSONFields."""

    serializer_field_mapping = {
        **serializers.ModelSerializer.serializer_field_mapping,
        models.JSONField: BoundedJSONField,
    }


class NulRefusingMiddleware:
    """400 for a URL path or query parameter holding text that cannot be stored."""

    def __init__(self, get_response) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        problem = text_unstorable(request.path) or text_problem(dict(request.GET.lists()))
        if problem:
            return JsonResponse(
                {
                    "detail": _("Text that cannot be stored is not accepted in the URL: %(problem)s")
                    % {"problem": problem}
                },
                status=400,
            )
        return self.get_response(request)
