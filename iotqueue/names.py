"""Names that appear in API URLs (`/api/templates/<name>/`): what they may contain.

A name is one path segment, so the validator refuses what cannot survive as one: `/`
(Django decodes `%2F` before routing, so even an encoded slash splits the segment), `\\`
(browsers and the WHATWG URL parser turn it into `/`), control characters (the same parser
drops tabs and newlines) and names of dots only (`.` and `..` are removed from a path as
dot segments). Everything else, spaces included, reaches its object when the client
percent-encodes it; the routes' lookup pattern below takes every name the validator takes.
"""

from django.core.validators import RegexValidator
from django.utils.translation import gettext_lazy as _

# The viewsets' lookup_value_regex: one path segment. Groups need it in particular, DRF's
# default ([^/.]+) leaves dots to format suffixes.
URL_NAME_LOOKUP_REGEX = r"[^/]+"

# Leading dots, then one character that is not a dot, then anything allowed. Written so that
# no character can match two ways: checking a long name costs linear time, not quadratic.
# A RegexValidator (not a function) so that the OpenAPI schema shows it as the field's pattern.
url_name_validator = RegexValidator(
    regex=r"\A\.*[^./\\\x00-\x1f\x7f][^/\\\x00-\x1f\x7f]*\Z",
    message=_(
        "A name may not contain / or \\ or control characters, nor be dots only (it is a segment of its URL)."
    ),
    code="invalid",
)
