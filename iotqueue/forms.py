"""Form fields shared by the admin: JSON text that cannot nest past the project's limit and
holds only text that can be stored (iotqueue/text.py: `"\\ud800"` is valid JSON).

Django's forms.JSONField turns a decoding error into a form error, but not a RecursionError
(JSON nested about a thousand levels deep), which became an HTTP 500 on the admin pages.
Every JSON field of the project's models uses `BoundedJSONFormField` in the admin
(`JSON_FORMFIELD_OVERRIDES`), and the free-text JSON inputs call `json_text_parse`.
"""

from __future__ import annotations

import json
from typing import Any

from django import forms
from django.core.exceptions import ValidationError
from django.db import models
from django.utils.translation import gettext as _

from .jsondepth import json_max_depth, json_too_deep
from .text import text_problem


def _depth_error() -> ValidationError:
    return ValidationError(
        _("Nested more than %(depth)d levels deep (IOTQUEUE_JSON_MAX_DEPTH).") % {"depth": json_max_depth()}
    )


def _text_check(value: Any) -> None:
    problem = text_problem(value)
    if problem:
        raise ValidationError(
            _("Text that cannot be stored is not accepted: %(problem)s") % {"problem": problem}
        )


def json_text_parse(text: str) -> Any:
    """Decode JSON text typed into a form; ValidationError for bad or too-deep JSON."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        message = _("Not valid JSON: %(problem)s (line %(line)d, column %(column)d).")
        raise ValidationError(
            message % {"problem": exc.msg, "line": exc.lineno, "column": exc.colno}
        ) from None
    except RecursionError:
        raise _depth_error() from None
    if json_too_deep(value):
        raise _depth_error()
    _text_check(value)
    return value


class BoundedJSONFormField(forms.JSONField):
    def to_python(self, value: Any) -> Any:
        try:
            converted = super().to_python(value)
        except RecursionError:
            raise _depth_error() from None
        if json_too_deep(converted):
            raise _depth_error()
        _text_check(converted)
        return converted

    def bound_data(self, data: Any, initial: Any) -> Any:
        try:
            value = super().bound_data(data, initial)
        except RecursionError:  # redisplaying what was typed: as typed
            return forms.fields.InvalidJSONInput(data)
        if not isinstance(value, forms.fields.InvalidJSONInput) and text_problem(value):
            # Re-encoded, a lone surrogate would make the page itself unencodable (a 500).
            return forms.fields.InvalidJSONInput(data)
        return value

    def prepare_value(self, value: Any) -> Any:
        try:
            return super().prepare_value(value)
        except RecursionError:  # stored before the limit existed: shown, not re-encoded
            return _("(nested too deeply to show)")


# For a ModelAdmin's or an inline's `formfield_overrides`.
JSON_FORMFIELD_OVERRIDES = {models.JSONField: {"form_class": BoundedJSONFormField}}
