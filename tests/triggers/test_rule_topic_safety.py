"""A rule's filter is one the broker accepts and never a device's reply topics (issue 31, findings 3, 4)."""

import json

import pytest
from django.contrib.auth.models import User
from django.test import Client

from devices import protocol
from tests.factories import DeviceFactory, template_with_steps
from triggers.models import TriggerRule
from triggers.rules import rule_topics

pytestmark = pytest.mark.django_db

# Filters the broker refuses as malformed (it would drop the bridge on every resubscribe).
MALFORMED = [
    "ctl/\x01/x",
    "ctl/\x1f/x",  # mid-level: DRF strips trailing whitespace-like controls
    "ctl/\x7f",
    "ctl/\x85/x",
    "non/\ufdd0",
    "non/\uffff",
    "lone/\ud800",
    "site/door+",
    "site/#/x",
    "x" * 65536,
]

# Filters matching a device's replies, presence or jobs/get: the rule would take them over.
ON_DEVICE_TOPICS = [
    "{P}/victim-1/done",
    "+/victim-1/done",
    "{P}/+/done",
    "{P}/victim-1/ack",
    "{P}/victim-1/progress",
    "{P}/victim-1/status",
    "{P}/+/heartbeat",
    "{P}/victim-1/jobs/get",
    "{P}/+/jobs/+",
    "{P}/victim-1/#",
    "{P}/#",
    "+/+/+",
]


@pytest.fixture
def template():
    return template_with_steps((DeviceFactory(name="victim-1"), "snapshot", {}))


def rule(template, topic_filter: str) -> dict:
    return {"name": "listener", "topic_filter": topic_filter, "template": template.name}


@pytest.mark.parametrize("topic_filter", MALFORMED)
def test_a_filter_the_broker_would_refuse_is_400_naming_the_field(admin_api, template, topic_filter):
    # as JSON escapes, the only way a lone surrogate travels in a body
    body = json.dumps(rule(template, topic_filter))
    response = admin_api.post("/api/trigger-rules/", body, content_type="application/json")

    # named as the field's error, or (a lone surrogate) by the body parser's refusal
    assert response.status_code == 400, response.content
    named = list(response.json()) == ["topic_filter"] or "topic_filter:" in response.json()["detail"]
    assert named, response.json()
    assert not TriggerRule.objects.exists()


@pytest.mark.parametrize("topic_filter", ON_DEVICE_TOPICS)
def test_a_filter_on_device_reply_topics_is_400(admin_api, template, topic_filter):
    topic_filter = topic_filter.replace("{P}", protocol.topic_prefix())

    response = admin_api.post("/api/trigger-rules/", rule(template, topic_filter), format="json")

    assert response.status_code == 400, response.content
    assert list(response.json()) == ["topic_filter"], response.json()
    assert not TriggerRule.objects.exists()


def test_a_filter_on_a_legacy_reply_topic_is_400_and_its_neighbour_is_fine(admin_api, template):
    DeviceFactory(reply_topic="plant/press-4/out")

    matching = admin_api.post("/api/trigger-rules/", rule(template, "plant/+/out"), format="json")
    beside = admin_api.post("/api/trigger-rules/", rule(template, "plant/+/sensor"), format="json")

    assert matching.status_code == 400 and "plant/press-4/out" in matching.json()["topic_filter"][0]
    assert beside.status_code == 201, beside.content


def test_the_admin_form_refuses_them_too(template):
    browser = Client()
    browser.force_login(User.objects.create_superuser("admin", "a@example.com", "pw"))
    form = {
        "name": "listener",
        "template": template.pk,
        "parameters": "{}",
        "idempotency_key": "",
        "priority": "",
        "enabled": "on",
        "max_runs_per_minute": "60",
        "max_active_runs": "10",
    }

    for topic_filter in ("ctl/\x01/x", f"{protocol.topic_prefix()}/victim-1/done", "+/victim-1/status"):
        page = browser.post("/admin/triggers/triggerrule/add/", {**form, "topic_filter": topic_filter})
        assert set(page.context["adminform"].form.errors) == {"topic_filter"}, topic_filter

    assert not TriggerRule.objects.exists()


def test_a_rule_stored_on_a_legacy_reply_topic_is_not_listened_to():
    # given a rule saved before the check (no validation) on a topic a legacy device
    # answers on, and a rule on a sensor topic
    DeviceFactory(reply_topic="legacy/face/7/Ack")
    template = template_with_steps((DeviceFactory(), "a", {}))
    TriggerRule.objects.create(name="takes-acks", topic_filter="legacy/#", template=template)
    TriggerRule.objects.create(name="door", topic_filter="site/+/door", template=template)

    # when the bridge reads the rules' topics, then only the sensor rule is subscribed
    assert set(rule_topics()) == {"site/+/door"}
