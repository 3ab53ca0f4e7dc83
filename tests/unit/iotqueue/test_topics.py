"""Whether two MQTT filters can match a common topic (pure logic, no services)."""

import paho.mqtt.client as mqtt
import pytest

from iotqueue.topics import filters_overlap

OVERLAPPING = [
    ("#", "P/lamp/cmd/on"),
    ("P/#", "P/+/cmd/#"),
    ("+/+/cmd/#", "P/+/cmd/#"),
    ("P/+/cmd/x", "P/+/cmd/#"),
    ("P/lamp/#", "P/+/cmd/#"),
    ("P/+/+/on", "P/+/cmd/#"),
    ("P/#", "P"),  # # matches its parent level too
    ("P/+/cmd", "P/+/cmd/#"),
    ("legacy/door/in", "legacy/door/in"),
    ("legacy/+/in", "legacy/door/in"),
    ("+", "a"),
    ("a//b", "a/+/b"),  # an empty level is a level
    ("$SYS/#", "$SYS/broker/load"),
    ("$SYS/+", "$SYS/x"),
]

DISJOINT = [
    ("P/+/done", "P/+/cmd/#"),
    ("P/lamp", "P/+/cmd/#"),  # one level short, no #
    ("Q/#", "P/+/cmd/#"),
    ("site/+/door/+/opened", "P/+/cmd/#"),
    ("P/lamp/cmd/on/more", "P/+/cmd/on"),
    ("a/b", "a/c"),
    ("#", "$SYS/broker/load"),  # a leading wildcard never matches a $ topic
    ("+/broker/load", "$SYS/broker/load"),
    ("$SYS/#", "+/+"),
    ("a", "a/b"),
]


@pytest.mark.parametrize(("first", "second"), OVERLAPPING)
def test_overlapping_filters(first, second):
    assert filters_overlap(first, second)
    assert filters_overlap(second, first)


@pytest.mark.parametrize(("first", "second"), DISJOINT)
def test_disjoint_filters(first, second):
    assert not filters_overlap(first, second)
    assert not filters_overlap(second, first)


@pytest.mark.parametrize(
    ("topic_filter", "topic"),
    [("#", "P/x/cmd/on"), ("P/+/cmd/#", "P/x/cmd/a/b"), ("+/x", "$SYS/x"), ("a/#", "a"), ("a/+", "a/b/c")],
)
def test_a_plain_topic_overlaps_exactly_when_paho_matches_it(topic_filter, topic):
    assert filters_overlap(topic_filter, topic) == mqtt.topic_matches_sub(topic_filter, topic)
