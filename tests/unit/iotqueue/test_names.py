"""Names that are one segment of an API URL (iotqueue/names.py)."""

from __future__ import annotations

import re

import pytest
from django.core.exceptions import ValidationError

from iotqueue.names import URL_NAME_LOOKUP_REGEX, url_name_validator

VALID = ["pump check", "firmware-2.1", ".hidden", "..a", "a.", "Ünïcødé", "a" * 500, "%2F"]
INVALID = ["", ".", "..", "...", "a/b", "a\\b", "tab\there", "new\nline", "nul\x00", "del\x7f"]


@pytest.mark.parametrize("name", VALID)
def test_a_name_that_survives_as_one_path_segment_is_valid(name):
    # given a name a client can percent-encode into one segment, then it validates
    url_name_validator(name)
    # and the routes' lookup pattern takes it whole
    assert re.fullmatch(URL_NAME_LOOKUP_REGEX, name)


@pytest.mark.parametrize("name", INVALID)
def test_slashes_control_characters_and_dots_only_are_refused(name):
    with pytest.raises(ValidationError) as error:
        url_name_validator(name)
    assert error.value.code == "invalid"


def test_a_long_hostile_name_is_checked_in_linear_time():
    # given a name built to make a backtracking pattern quadratic (dots then a bad character)
    hostile = "." * 200_000 + "/"

    # then it is refused (pytest-timeout would stop a pattern that backtracks)
    with pytest.raises(ValidationError):
        url_name_validator(hostile)
