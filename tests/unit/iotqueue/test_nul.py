"""Where a NUL character hides in decoded JSON (iotqueue/nul.py), which PostgreSQL refuses."""

from __future__ import annotations

import pytest

from iotqueue.nul import nul_path


@pytest.mark.parametrize(
    ("value", "path"),
    [
        ("a\x00b", "(the value)"),
        ({"args": {"name": "x\x00"}}, "args.name"),
        ({"ok": "fine", "items": [1, "two", {"k": "\x00"}]}, "items[2].k"),
        ({"bad\x00key": 1}, "bad\x00key"),
        ([["\x00"]], "[0][0]"),
    ],
)
def test_the_path_names_the_first_string_or_key_holding_a_nul(value, path):
    assert nul_path(value) == path


@pytest.mark.parametrize("value", ["plain", {"a": [1, 2.5, None, True, "x"]}, [], 0])
def test_values_without_a_nul_have_no_path(value):
    assert nul_path(value) is None
