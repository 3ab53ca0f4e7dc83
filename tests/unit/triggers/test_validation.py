"""Schedule and trigger rule checks (triggers/validation.py), shared by the API and the admin."""

from __future__ import annotations

import re

import pytest

from devices.models import Device
from triggers.validation import (
    command_overlap_error,
    crontab_fields,
    published_overlap_error,
    rule_errors,
    rule_reference_error,
    schedule_errors,
    timezone_error,
    topic_filter_error,
)


def test_a_crontab_splits_into_its_five_named_fields():
    assert crontab_fields("*/5  2 * * mon-fri") == {
        "minute": "*/5",
        "hour": "2",
        "day_of_month": "*",
        "month_of_year": "*",
        "day_of_week": "mon-fri",
    }


@pytest.mark.parametrize(
    ("expression", "problem"),
    [
        ("* * * *", "a crontab has 5 fields"),
        ("* * * * * *", "a crontab has 5 fields"),
        ("61 * * * *", "invalid crontab '61 * * * *'"),
        ("* 25 * * *", "invalid crontab"),
        ("* * * * funday", "invalid crontab"),
    ],
)
def test_a_crontab_beat_could_not_evaluate_is_refused_with_the_reason(expression, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        crontab_fields(expression)


def test_a_timezone_is_an_iana_name():
    assert timezone_error("Europe/Berlin") is None
    assert timezone_error("UTC") is None
    assert "unknown timezone 'CEST'" in timezone_error("CEST")


@pytest.mark.parametrize(
    ("fields", "errors"),
    [
        ({"interval_seconds": 60, "crontab": ""}, set()),
        ({"interval_seconds": None, "crontab": "0 3 * * *"}, set()),
        ({"interval_seconds": 60, "crontab": "0 3 * * *"}, {"interval_seconds", "crontab"}),
        ({"interval_seconds": None, "crontab": ""}, {"interval_seconds", "crontab"}),
        ({"interval_seconds": None, "crontab": "0 3 * *"}, {"crontab"}),
    ],
)
def test_a_schedule_has_either_an_interval_or_a_crontab(fields, errors):
    assert set(schedule_errors(timezone="UTC", **fields)) == errors


def test_a_schedule_with_an_unknown_timezone_says_so():
    assert set(schedule_errors(interval_seconds=60, crontab="", timezone="Mars/Olympus")) == {"timezone"}


@pytest.mark.parametrize("topic_filter", ["site/+/door/+/opened", "site/#", "#", "a//b", "legacy/door/in"])
def test_a_well_formed_filter_is_accepted(topic_filter):
    assert topic_filter_error(topic_filter) is None


@pytest.mark.parametrize(
    ("topic_filter", "problem"),
    [
        ("", "cannot be empty"),
        ("site/door+/opened", "wildcards must fill a whole level, not 'door+'"),
        ("site/#/opened", "# may only be the last level"),
        ("$share/g/site/#", "the bridge adds $share/<group>/ itself"),
        ("$SYS/#", "are the broker's own"),
        ("a\x00b", "(U+0000) is a control character"),
        ("ctl/\x01/x", "(U+0001) is a control character"),
        ("a/\x85", "(U+0085) is a control character"),
        ("a/\ufffe", "a Unicode noncharacter"),
        ("a/\ud800", "lone surrogate"),
        ("a" * 65536, "MQTT allows at most 65535"),
    ],
)
def test_a_malformed_filter_is_refused_with_mqtts_rule(topic_filter, problem):
    assert problem in topic_filter_error(topic_filter)


def test_a_rule_may_not_listen_to_the_workers_own_commands():
    # given the command space and a legacy device's command topic
    commands = ["P/+/cmd/#", "dev/face/123"]

    # then a filter matching either would start a run per command: a loop
    assert "matches device command topics (P/+/cmd/#)" in command_overlap_error("P/#", commands)
    assert "(dev/face/123)" in command_overlap_error("dev/+/+", commands)
    assert command_overlap_error("P/+/done", commands) is None


@pytest.mark.parametrize(
    ("value", "topic_filter", "problem"),
    [
        ({"door": "{{ topic.2 }}", "badge": "{{ message.badge }}"}, "site/+/door/+/opened", None),
        ({"x": "{{ topic.9 }}"}, "site/#", None),  # # can have any number of levels
        ({"x": "{{ params.door }}"}, "site/+", "references start with topic or message"),
        ({"x": "{{ topic.door }}"}, "site/+", "a topic level is a number from 0"),
        ({"x": "{{ topic.2 }}"}, "site/+", "the filter 'site/+' has only 2 levels"),
        ({"x": "{{ message.badge"}, "site/+", "malformed reference"),
    ],
)
def test_rule_references_read_topic_levels_the_filter_has_or_the_message(value, topic_filter, problem):
    error = rule_reference_error(value, topic_filter)

    if problem is None:
        assert error is None
    else:
        assert problem in error


@pytest.mark.django_db
def test_a_rule_is_checked_field_by_field(settings):
    # given a legacy device whose commands arrive on a fixed topic (its broker identity is
    # not ours to write: there is no broker in this tier)
    settings.IOTQUEUE_MQTT_AUTH = "none"
    Device.objects.create(name="face-1", command_topic="legacy/face/1")

    # when rules are checked, then each problem is reported on its field
    assert (
        rule_errors(topic_filter="site/+/opened", parameters={"door": "{{ topic.1 }}"}, idempotency_key="")
        == {}
    )
    assert set(rule_errors(topic_filter="legacy/#", parameters={}, idempotency_key="")) == {"topic_filter"}
    assert rule_errors(topic_filter="site/+", parameters=["x"], idempotency_key="") == {
        "parameters": "parameters must be a JSON object"
    }


@pytest.mark.django_db
def test_a_dedupe_key_must_reference_the_message_or_topic():
    # a constant key would let only the rule's first message ever start a run
    errors = rule_errors(topic_filter="site/+", parameters={}, idempotency_key="always-the-same")
    assert errors == {
        "idempotency_key": "a dedupe key must reference the message or topic, e.g. {{ message.event_id }}"
    }
    assert rule_errors(topic_filter="site/+", parameters={}, idempotency_key="{{ message.event_id }}") == {}


def test_a_rule_may_not_listen_to_run_events_or_jobs_answers(settings):
    settings.IOTQUEUE_TOPIC_PREFIX = "P"
    # Each run a rule on them starts would publish more of them: a loop.
    assert "(P/events/runs/#)" in published_overlap_error("P/events/runs/+")
    assert "(P/+/jobs/current)" in published_overlap_error("P/+/jobs/+")
    # A device's replies, and a device named "events", are no such topics.
    assert published_overlap_error("P/+/done") is None
    assert published_overlap_error("P/events/done") is None
