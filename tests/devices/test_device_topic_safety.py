"""A device's topic overrides: topics the broker accepts, no rule listens on (issue 31, findings 3, 4)."""

import json

import pytest
from django.contrib.auth.models import User
from django.test import Client

from devices.models import Device
from tests.factories import DeviceFactory, template_with_steps
from triggers.models import TriggerRule

pytestmark = pytest.mark.django_db

MALFORMED = [
    "dev/\x01/in",
    "dev/\x1b/x",
    "dev/\x7f",
    "dev/\x9f/x",
    "dev/\x85/x",
    "dev/\ufffe",
    "dev/\U0010ffff",
    "dev/\udfff",
]


@pytest.fixture
def sensor_rule():
    template = template_with_steps((DeviceFactory(), "snapshot", {}))
    return TriggerRule.objects.create(name="sensor", topic_filter="site/+/sensor", template=template)


@pytest.mark.parametrize("field", ["command_topic", "reply_topic"])
@pytest.mark.parametrize("topic", MALFORMED)
def test_an_override_the_broker_would_refuse_is_400_naming_the_field(admin_api, field, topic):
    # as JSON escapes, the only way a lone surrogate travels in a body
    body = json.dumps({"name": "legacy-1", field: topic})
    response = admin_api.post("/api/devices/", body, content_type="application/json")

    # named as the field's error, or (a lone surrogate) by the body parser's refusal
    assert response.status_code == 400, response.content
    assert list(response.json()) == [field] or f"{field}:" in response.json()["detail"], response.json()
    assert not Device.objects.filter(name="legacy-1").exists()


@pytest.mark.parametrize("field", ["command_topic", "reply_topic"])
def test_an_override_a_rule_listens_on_is_400(admin_api, sensor_rule, field):
    response = admin_api.post("/api/devices/", {"name": "legacy-1", field: "site/a/sensor"}, format="json")

    assert response.status_code == 400, response.content
    assert "trigger rule sensor" in response.json()[field][0]
    assert not Device.objects.filter(name="legacy-1").exists()


def test_a_patch_onto_a_rules_topic_is_400_and_keeps_the_old_topic(admin_api, sensor_rule):
    DeviceFactory(name="legacy-1", reply_topic="plant/legacy-1/out")

    response = admin_api.patch("/api/devices/legacy-1/", {"reply_topic": "site/b/sensor"}, format="json")

    assert response.status_code == 400 and list(response.json()) == ["reply_topic"], response.content
    assert Device.objects.get(name="legacy-1").reply_topic == "plant/legacy-1/out"


def test_the_admin_form_refuses_them_too(sensor_rule):
    browser = Client()
    browser.force_login(User.objects.create_superuser("admin", "a@example.com", "pw"))
    form = {
        "name": "legacy-1",
        "labels": "{}",
        "config": "{}",
        "min_interval_seconds": 0,
        "max_per_minute": 0,
        "protocol": "iotqueue",
    }

    for field, topic in (
        ("reply_topic", "dev/\x01/out"),
        ("reply_topic", "site/c/sensor"),
        ("command_topic", "site/d/sensor"),
    ):
        page = browser.post("/admin/devices/device/add/", {**form, field: topic})
        assert set(page.context["adminform"].form.errors) == {field}, (field, topic)

    assert not Device.objects.filter(name="legacy-1").exists()
