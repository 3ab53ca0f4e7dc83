"""API pagination's query parameters (iotqueue/pagination.py): integers in range, or a 400."""

from __future__ import annotations

import pytest
from django.core.paginator import Paginator
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.test import APIRequestFactory

from iotqueue.pagination import Pagination


def request(query: str = "") -> Request:
    return Request(APIRequestFactory().get(f"/api/runs/{query}"))


def test_without_a_page_size_the_default_applies():
    assert Pagination().get_page_size(request()) == Pagination.page_size


@pytest.mark.parametrize(("given", "size"), [("1", 1), ("25", 25), ("500", 500)])
def test_a_page_size_from_one_to_the_maximum_is_taken(given, size):
    assert Pagination().get_page_size(request(f"?page_size={given}")) == size


@pytest.mark.parametrize("given", ["0", "501", "-1", "abc", "2.5", "", "1e2"])
def test_any_other_page_size_is_a_400_naming_the_parameter(given):
    # when the page size is not a whole number from 1 to 500 (DRF would quietly use the default)
    with pytest.raises(ValidationError) as error:
        Pagination().get_page_size(request(f"?page_size={given}"))

    # then the error names the parameter and the range
    assert error.value.detail == {"page_size": [f"use a whole number from 1 to 500, not {given!r}"]}


@pytest.mark.parametrize(("given", "number"), [(None, 1), ("1", 1), ("7", 7)])
def test_the_page_number_is_a_positive_integer(given, number):
    query = "" if given is None else f"?page={given}"
    assert Pagination().get_page_number(request(query), Paginator([], 10)) == number


@pytest.mark.parametrize("given", ["0", "last", "-3"])
def test_any_other_page_number_is_a_400(given):
    with pytest.raises(ValidationError) as error:
        Pagination().get_page_number(request(f"?page={given}"), Paginator([], 10))
    assert error.value.detail == {"page": [f"use a whole number of at least 1, not {given!r}"]}


def test_the_schema_states_the_bounds():
    # when the schema's query parameters are described
    parameters = {p["name"]: p["schema"] for p in Pagination().get_schema_operation_parameters(view=None)}

    # then both are integers from 1, the page size up to its maximum
    assert parameters["page"]["minimum"] == 1
    assert (parameters["page_size"]["minimum"], parameters["page_size"]["maximum"]) == (1, 500)
