"""A trigger rule may not listen to device commands or broker topics: it would loop."""

import pytest
from django.contrib.auth.models import User
from django.test import Client

from devices import protocol
from tests.factories import DeviceFactory, template_with_steps
from triggers.models import TriggerRule
from triggers.rules import rule_topics

pytestmark = pytest.mark.django_db


@pytest.fixture
def template():
    return template_with_steps((DeviceFactory(), "snapshot", {}))


def rule(template, topic_filter: str) -> dict:
    return {"name": "listener", "topic_filter": topic_filter, "template": template.name}


@pytest.mark.parametrize(
    "topic_filter",
    [
        "#",
        "+/+/cmd/#",
        "{P}/#",
        "{P}/+/cmd/x",
        "{P}/lamp-2/cmd/on/#",
        "+/lamp-2/+/on",
        "$SYS/#",
        "$SYS/broker/load",
        "$CONTROL/dynamic-security/v1",
        # What the workers publish besides commands: run events and jobs/get answers.
        "{P}/events/runs/+",
        "{P}/+/jobs/current",
        "+/+/jobs/#",
    ],
)
def test_a_filter_overlapping_commands_or_broker_topics_is_400(admin_api, template, topic_filter):
    topic_filter = topic_filter.replace("{P}", protocol.topic_prefix())

    response = admin_api.post("/api/trigger-rules/", rule(template, topic_filter), format="json")

    assert response.status_code == 400
    assert list(response.json()) == ["topic_filter"], response.json()
    assert not TriggerRule.objects.exists()


def test_a_filter_matching_a_legacy_command_topic_is_400(admin_api, template):
    DeviceFactory(command_topic="plant/press-4/in")

    matching = admin_api.post("/api/trigger-rules/", rule(template, "plant/+/in"), format="json")
    beside = admin_api.post("/api/trigger-rules/", rule(template, "plant/+/out"), format="json")

    assert matching.status_code == 400 and "plant/press-4/in" in matching.json()["topic_filter"][0]
    assert beside.status_code == 201, beside.content


def test_a_patch_onto_the_command_topics_is_400(admin_api, template):
    admin_api.post("/api/trigger-rules/", rule(template, "site/+/door/#"), format="json")

    response = admin_api.patch("/api/trigger-rules/listener/", {"topic_filter": "#"}, format="json")

    assert response.status_code == 400 and list(response.json()) == ["topic_filter"]
    assert TriggerRule.objects.get().topic_filter == "site/+/door/#"


def test_the_admin_form_refuses_the_same_filters(template):
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

    for topic_filter in ("#", f"{protocol.topic_prefix()}/+/cmd/#", "$SYS/#"):
        page = browser.post("/admin/triggers/triggerrule/add/", {**form, "topic_filter": topic_filter})
        assert set(page.context["adminform"].form.errors) == {"topic_filter"}, topic_filter

    assert not TriggerRule.objects.exists()


def test_the_bridge_does_not_subscribe_a_rule_that_came_to_overlap(template):
    # given a rule saved before the check existed, and one a device's legacy topic came to match
    TriggerRule.objects.create(name="everything", topic_filter="#", template=template)
    TriggerRule.objects.create(name="plant", topic_filter="plant/#", template=template)
    TriggerRule.objects.create(name="doors", topic_filter="site/+/door/#", template=template)
    assert set(rule_topics()) == {"plant/#", "site/+/door/#"}

    DeviceFactory(command_topic="plant/press-4/in")

    # then only the rule that cannot see a command is subscribed
    assert set(rule_topics()) == {"site/+/door/#"}
