"""REST plumbing shared by every app: the JSON parser and a middleware refusing NUL
characters (iotqueue/nul.py) with a 400 instead of a database error."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, JsonResponse
from rest_framework.exceptions import ParseError
from rest_framework.parsers import FormParser, JSONParser, MultiPartParser

from .nul import NUL, nul_path


def _nul_refuse(data) -> None:
    where = nul_path(dict(data.lists()) if hasattr(data, "lists") else data)  # a QueryDict: every value
    if where:
        raise ParseError(f"NUL characters (\\u0000) are not accepted: found in {where}")


class NulRefusingJSONParser(JSONParser):
    """DRF's JSON parser, refusing bodies with a NUL character in any string or key."""

    def parse(self, stream, media_type=None, parser_context=None):
        data = super().parse(stream, media_type, parser_context)
        _nul_refuse(data)
        return data


class NulRefusingFormParser(FormParser):
    def parse(self, stream, media_type=None, parser_context=None):
        data = super().parse(stream, media_type, parser_context)
        _nul_refuse(data)
        return data


class NulRefusingMultiPartParser(MultiPartParser):
    def parse(self, stream, media_type=None, parser_context=None):
        parsed = super().parse(stream, media_type, parser_context)
        _nul_refuse(parsed.data)
        return parsed


class NulRefusingMiddleware:
    """400 for a URL path or query parameter holding a NUL character."""

    def __init__(self, get_response) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if NUL in request.path or any(
            NUL in key or any(NUL in value for value in values) for key, values in request.GET.lists()
        ):
            return JsonResponse(
                {"detail": "NUL characters are not accepted in the URL or its query parameters"}, status=400
            )
        return self.get_response(request)
