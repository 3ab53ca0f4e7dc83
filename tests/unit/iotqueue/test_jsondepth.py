"""How deeply JSON nests (iotqueue/jsondepth.py), measured without recursion."""

from __future__ import annotations

import pytest

from iotqueue.jsondepth import json_max_depth, json_too_deep


def nested(depth: int) -> list:
    """An array nested `depth` levels deep: [[[]]] is 3."""
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("value", "depth"),
    [
        ("scalar", 0),
        (None, 0),
        ({}, 1),
        ([], 1),
        ({"a": [1]}, 2),
        ([1, {"b": {"c": []}}], 4),
        ((1, (2,)), 2),  # tuples count as arrays
    ],
)
def test_depth_is_counted_per_object_or_array_level(value, depth):
    # a value is too deep for every limit below its depth, and for none from its depth on
    assert json_too_deep(value, limit=depth) is False
    if depth:
        assert json_too_deep(value, limit=depth - 1) is True


def test_the_deepest_branch_decides_not_the_first():
    assert json_too_deep({"flat": 1, "deep": {"a": {"b": {}}}}, limit=3) is True


def test_depths_python_cannot_recurse_through_are_measured():
    # given nesting far deeper than the interpreter's recursion limit
    value = nested(100_000)

    # then it is measured all the same
    assert json_too_deep(value, limit=99_999) is True
    assert json_too_deep(value, limit=100_000) is False


def test_the_default_limit_is_the_setting(settings):
    settings.IOTQUEUE_JSON_MAX_DEPTH = 3

    assert json_max_depth() == 3
    assert json_too_deep(nested(3)) is False
    assert json_too_deep(nested(4)) is True
