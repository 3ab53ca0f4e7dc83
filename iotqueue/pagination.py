"""API pagination: 50 per page by default, `?page_size=` up to 500.

DRF's page number pagination quietly falls back to the default page size on a page size
it cannot read (`?page_size=abc`, `?page_size=0`) and cuts one over the maximum down to
it; here both are a 400 naming the parameter, as the schema says (an integer in range),
and so is a page number that is not a positive integer. A page past the end stays DRF's
404.
"""

from django.utils.translation import gettext as _
from rest_framework.exceptions import ValidationError
from rest_framework.pagination import PageNumberPagination


class Pagination(PageNumberPagination):
    page_size = 50
    page_size_query_param = "page_size"
    max_page_size = 500
    # Only numbers: `?page=last` would be a second type for one parameter.
    last_page_strings = ()

    def get_page_size(self, request) -> int:
        given = request.query_params.get(self.page_size_query_param)
        if given is None:
            return self.page_size
        return _int_param(self.page_size_query_param, given, maximum=self.max_page_size)

    def get_page_number(self, request, paginator) -> int:
        given = request.query_params.get(self.page_query_param)
        return 1 if given is None else _int_param(self.page_query_param, given)

    def get_schema_operation_parameters(self, view) -> list[dict]:
        parameters = super().get_schema_operation_parameters(view)
        for parameter in parameters:
            parameter["schema"]["minimum"] = 1
            if parameter["name"] == self.page_size_query_param:
                parameter["schema"]["maximum"] = self.max_page_size
        return parameters


def _int_param(name: str, given: str, maximum: int | None = None) -> int:
    """`given` as an integer from 1 to `maximum`, or a 400 naming the query parameter."""
    problem = (
        _("use a whole number from 1 to %(maximum)d, not %(given)r") % {"maximum": maximum, "given": given}
        if maximum
        else _("use a whole number of at least 1, not %(given)r") % {"given": given}
    )
    try:
        value = int(given)
    except ValueError:
        value = 0
    if not given.strip().isdigit() or value < 1 or (maximum and value > maximum):
        raise ValidationError({name: [problem]})
    return value
