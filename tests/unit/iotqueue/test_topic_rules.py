"""Which topic names and filters a broker accepts (pure logic, no services)."""

import pytest

from iotqueue.topics import TOPIC_MAX_BYTES, topic_filter_error, topic_name_error

# Refused in both a topic name and a filter: Mosquitto drops the connection that sends them.
BAD_TEXT = [
    "",
    "ctl/\x00/x",
    "ctl/\x01/x",
    "ctl/\x1f",
    "tab\there",
    "line\nbreak",
    "ctl/\x7f",  # DEL
    "ctl/\x80",  # C1
    "ctl/\x9f",
    "lone/\ud800",
    "lone/\udfff/x",
    "nonchar/\ufdd0",
    "nonchar/\ufdef",
    "nonchar/\ufffe",
    "nonchar/\uffff",
    "nonchar/\U0001fffe",
    "nonchar/\U0010ffff",
    "a" * (TOPIC_MAX_BYTES + 1),
    "é" * (TOPIC_MAX_BYTES // 2 + 1),  # few characters, too many bytes
    "a/" * 200 + "b",  # 201 levels: Mosquitto's TOPIC_HIERARCHY_LIMIT is 200
]

GOOD_NAMES = [
    "a",
    "dev/face/123/Ack",
    "a//b",  # an empty level is a level
    "/leading",
    "trailing/",
    "$SYS/x",
    "ünïcödé/温度/\U0001f600",
    "nbsp\xa0ok",  # U+00A0 is the first code point after C1
    "\ufdcf\ufdf0",  # either side of the noncharacter block
    "a" * TOPIC_MAX_BYTES,
    "a/" * 199 + "b",  # 200 levels
]

GOOD_FILTERS = [
    *GOOD_NAMES,
    "#",
    "+",
    "a/+/b",
    "a/#",
    "+/+/done",
    "a//+",
    "$share/bridges/iotqueue/+/done",
    "$share/g/#",
]

BAD_FILTERS = [
    "a/b#",
    "a/#/b",
    "a+/b",
    "a/+b",
    "##",
    "$share/",
    "$share/g",
    "$share/g/",
    "$share/g+/a",
    "$share/g/a/#/b",
]


@pytest.mark.parametrize("text", BAD_TEXT)
def test_text_a_broker_refuses_is_refused_as_name_and_filter(text):
    assert topic_name_error(text)
    assert topic_filter_error(text)


@pytest.mark.parametrize("text", GOOD_NAMES)
def test_valid_topic_names_pass(text):
    assert topic_name_error(text) is None


@pytest.mark.parametrize("text", GOOD_FILTERS)
def test_valid_filters_pass(text):
    assert topic_filter_error(text) is None


@pytest.mark.parametrize("text", BAD_FILTERS)
def test_misplaced_wildcards_are_refused_in_a_filter(text):
    assert topic_filter_error(text)


@pytest.mark.parametrize("text", ["a/+", "#", "a/#", "a+b"])
def test_a_topic_name_holds_no_wildcard(text):
    assert "wildcard" in topic_name_error(text)


def test_the_answer_names_the_character():
    given = "ctl/\x01/x"
    when = topic_filter_error(given)
    then = "U+0001"
    assert then in when
