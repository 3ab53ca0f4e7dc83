"""Text that cannot be stored (iotqueue/text.py): a NUL (PostgreSQL refuses it) or a lone
surrogate (UTF-8 cannot encode it), found with the place it hides in decoded JSON."""

from __future__ import annotations

import json

import pytest

from iotqueue.text import text_problem, text_unstorable


@pytest.mark.parametrize(
    ("value", "where"),
    [
        ("a\x00b", "(the value): a NUL character"),
        ({"args": {"name": "x\x00"}}, "args.name: a NUL"),
        ({"ok": "fine", "items": [1, "two", {"k": "\x00"}]}, "items[2].k: a NUL"),
        ({"bad\x00key": 1}, "bad\\u0000key (a key): a NUL"),
        ([["\x00"]], "[0][0]: a NUL"),
        ({"id": "poison-\ud800"}, "id: a lone surrogate (\\ud800)"),
        ({"labels": {"a": "\udfff"}}, "labels.a: a lone surrogate (\\udfff)"),
        ({"\udc80": "x"}, "\\udc80 (a key): a lone surrogate (\\udc80)"),
        ({"result": {"list": ["ok", "x\ud83d"]}}, "result.list[1]: a lone surrogate (\\ud83d)"),
    ],
)
def test_the_problem_names_the_first_string_or_key_and_what_is_wrong(value, where):
    problem = text_problem(value)
    assert problem is not None and problem.startswith(where)
    problem.encode()  # the message itself can be stored and logged


def test_a_surrogate_from_a_json_escape_is_found():
    # given JSON whose \u escape decodes to half of a pair
    value = json.loads('{"id": "poison-\\ud800", "ok": true}')
    # then it is refused like a NUL
    assert text_problem(value) == "id: a lone surrogate (\\ud800), which is not valid Unicode text"


@pytest.mark.parametrize(
    "value",
    ["plain", {"a": [1, 2.5, None, True, "x"]}, [], 0, {"name": "晨间例程 😀 é"}, "\U0001f600"],
)
def test_storable_values_have_no_problem(value):
    assert text_problem(value) is None


def test_a_surrogate_pair_escape_is_one_storable_character():
    assert text_unstorable(json.loads('"\\ud83d\\ude00"')) is None
