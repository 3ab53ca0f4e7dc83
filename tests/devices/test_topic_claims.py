"""A legacy device's override topics may not be another device's topics."""

import pytest
from django.contrib.auth.models import User
from django.test import Client

from devices import protocol
from devices.models import Device
from devices.topic_claims import device_topic_collisions
from tests.factories import DeviceFactory

pytestmark = pytest.mark.django_db


def space(name: str) -> str:
    return f"{protocol.topic_prefix()}/{name}"


@pytest.fixture
def press():
    return DeviceFactory(name="press-4", command_topic="plant/press-4/in", reply_topic="plant/press-4/out")


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"command_topic": "plant/press-4/in"}, "command_topic"),
        ({"reply_topic": "plant/press-4/in"}, "reply_topic"),
        ({"command_topic": "plant/press-4/out"}, "command_topic"),
        ({"command_topic": "{P}/lamp-2/cmd/on"}, "command_topic"),
        ({"reply_topic": "{P}/lamp-2/done"}, "reply_topic"),
        # The broker's own topics: an ACL on $CONTROL/... would hand the device the broker.
        ({"reply_topic": "$CONTROL/dynamic-security/v1"}, "reply_topic"),
        ({"command_topic": "$CONTROL/dynamic-security/v1/response"}, "command_topic"),
        ({"reply_topic": "$SYS/broker/uptime"}, "reply_topic"),
        # Where run events go out: a device may not publish forged ones.
        ({"reply_topic": "{P}/events/runs/x"}, "reply_topic"),
        ({"command_topic": "{P}/events"}, "command_topic"),
        ({"name": "ghost", "command_topic": "x"}, None),  # sanity: a free topic is fine
    ],
)
def test_an_override_colliding_with_another_device_is_400_naming_the_field(admin_api, press, change, field):
    DeviceFactory(name="lamp-2")
    body = {"name": "legacy-1", **{k: v.replace("{P}", protocol.topic_prefix()) for k, v in change.items()}}

    response = admin_api.post("/api/devices/", body, format="json")

    if field is None:
        assert response.status_code == 201, response.content
        return
    assert response.status_code == 400 and list(response.json()) == [field], response.json()
    assert not Device.objects.filter(name="legacy-1").exists()


def test_a_device_may_use_its_own_space_and_keep_its_topics_on_update(admin_api, press):
    own = admin_api.post(
        "/api/devices/", {"name": "gate", "reply_topic": f"{space('gate')}/legacy"}, format="json"
    )
    unchanged = admin_api.patch(f"/api/devices/{press.name}/", {"description": "still mine"}, format="json")

    assert own.status_code == 201, own.content
    assert unchanged.status_code == 200, unchanged.content


def test_a_name_whose_topics_hold_another_devices_override_is_400(admin_api):
    DeviceFactory(name="old-pump", command_topic=f"{space('pump-9')}/cmd/run")

    response = admin_api.post("/api/devices/", {"name": "pump-9"}, format="json")

    assert response.status_code == 400 and list(response.json()) == ["name"], response.json()


def test_a_patch_onto_another_devices_topic_is_400(admin_api, press):
    other = DeviceFactory()

    response = admin_api.patch(
        f"/api/devices/{other.name}/", {"reply_topic": "plant/press-4/out"}, format="json"
    )

    assert response.status_code == 400 and list(response.json()) == ["reply_topic"]


def test_the_admin_form_refuses_the_same(press):
    browser = Client()
    browser.force_login(User.objects.create_superuser("admin", "a@example.com", "pw"))
    form = {
        "name": "legacy-1",
        "description": "",
        "labels": "{}",
        "command_topic": "plant/press-4/in",
        "reply_topic": "",
        "config": "{}",
        "min_interval_seconds": "0",
        "max_per_minute": "0",
        "protocol": "iotqueue",
        "enabled": "on",
        "presence_required": "on",
    }

    page = browser.post("/admin/devices/device/add/", form)

    assert page.status_code == 200
    assert set(page.context["adminform"].form.errors) == {"command_topic"}
    assert not Device.objects.filter(name="legacy-1").exists()


def test_collisions_are_named_per_field():
    DeviceFactory(name="lamp-2")

    errors = device_topic_collisions(
        pk=None, name="x", command_topic=f"{space('lamp-2')}/cmd/on", reply_topic=f"{space('x')}/done"
    )

    assert set(errors) == {"command_topic"} and "lamp-2" in errors["command_topic"]
