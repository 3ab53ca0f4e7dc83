"""A trigger rule's limits: messages per minute (Redis window) and runs not yet ended."""

import pytest

from iotqueue.redis_conn import redis_connection, redis_key
from jobs.models import JobRun, RunEvent, RunStatus
from tests.factories import DeviceFactory, template_with_steps
from triggers.limits import RateVerdict, rule_rate_admit
from triggers.models import TriggerRule
from triggers.rules import trigger_message_handle

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _fresh_windows():
    """Rolled-back tests reuse rule ids on SQLite: start each test with no rule's window."""
    keys = list(redis_connection().scan_iter(redis_key("trigger", "*")))
    if keys:
        redis_connection().delete(*keys)


def rule_with(**limits) -> TriggerRule:
    template = template_with_steps((DeviceFactory(), "snapshot", {}))
    return TriggerRule.objects.create(
        name="door",
        topic_filter="site/+/door",
        template=template,
        parameters={"n": "{{ message.n }}"},
        **limits,
    )


def drops() -> list[RunEvent]:
    return list(RunEvent.objects.filter(kind="message.dropped").order_by("id"))


def test_messages_over_the_rate_are_dropped_and_reported_once():
    rule = rule_with(max_runs_per_minute=2)

    for n in range(5):
        trigger_message_handle("site/berlin/door", f'{{"n": {n}}}'.encode(), rules=[rule])

    assert sorted(JobRun.objects.values_list("parameters__n", flat=True)) == [0, 1]
    [dropped] = drops()
    assert dropped.data == {"topic": "site/berlin/door", "rule": "door", "limit": "max_runs_per_minute"}
    assert "max_runs_per_minute 2" in dropped.message


def test_the_window_slides_and_is_shared_by_every_caller():
    # given a rule allowing 2 messages a minute, admitted at t=0 and t=30 (by two bridges)
    rule = rule_with(max_runs_per_minute=2)
    assert rule_rate_admit(rule, now=1000.0) == RateVerdict.ADMITTED
    assert rule_rate_admit(rule, now=1030.0) == RateVerdict.ADMITTED

    # then a third within the minute is dropped, reported once
    assert rule_rate_admit(rule, now=1031.0) == RateVerdict.DROPPED_FIRST
    assert rule_rate_admit(rule, now=1032.0) == RateVerdict.DROPPED

    # and once the first is a minute old, there is room for one again
    assert rule_rate_admit(rule, now=1060.5) == RateVerdict.ADMITTED
    assert rule_rate_admit(rule, now=1061.0) in (RateVerdict.DROPPED, RateVerdict.DROPPED_FIRST)


def test_a_message_over_the_active_run_cap_is_dropped_until_a_run_ends():
    rule = rule_with(max_active_runs=1)

    trigger_message_handle("site/berlin/door", b'{"n": 1}', rules=[rule])
    trigger_message_handle("site/berlin/door", b'{"n": 2}', rules=[rule])

    [first] = JobRun.objects.all()
    [dropped] = drops()
    assert dropped.data == {"topic": "site/berlin/door", "rule": "door", "limit": "max_active_runs"}
    assert "1 of its runs have not ended (max_active_runs 1)" in dropped.message

    # when the active run ends, the next message starts a run again
    JobRun.objects.filter(pk=first.pk).update(status=RunStatus.SUCCEEDED)
    trigger_message_handle("site/berlin/door", b'{"n": 3}', rules=[rule])

    assert sorted(JobRun.objects.values_list("parameters__n", flat=True)) == [1, 3]
    assert rule.triggered_runs.count() == 2


def test_limits_default_to_bounded_values_and_must_be_positive(admin_api):
    template = template_with_steps((DeviceFactory(), "snapshot", {}))
    body = {"name": "door", "topic_filter": "site/+/door", "template": template.name}

    created = admin_api.post("/api/trigger-rules/", body, format="json")
    zero = admin_api.post(
        "/api/trigger-rules/",
        {**body, "name": "x", "max_runs_per_minute": 0, "max_active_runs": 0},
        format="json",
    )

    assert created.status_code == 201
    assert (created.json()["max_runs_per_minute"], created.json()["max_active_runs"]) == (60, 10)
    assert zero.status_code == 400 and set(zero.json()) == {"max_runs_per_minute", "max_active_runs"}
