"""Broker identities iotqueue did not create are never touched (issue 31, finding 2).

A device named like an existing broker user (an edge consumer, an operator holding
dynsec-admin) must not hand that user's login to whoever may add devices. Runs against the
real Mosquitto with its dynamic security plugin; skipped where the broker's identities are
not managed by iotqueue (the pip-only amqtt broker).
"""

from __future__ import annotations

import io
import queue
import uuid

import paho.mqtt.client as mqtt
import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.core.management import call_command
from rest_framework.test import APIClient

from devices import credentials
from devices import serializers as device_serializers
from devices.credentials import (
    device_acls,
    device_password_issue,
    identity_conflict,
    identity_read,
    managed,
    role_name,
)
from devices.models import Device
from iotqueue.dynsec import ADMIN_ROLE, MANAGED_MARK, control, password_new
from iotqueue.mqtt import broker_address
from tests.conftest import WAIT_SECONDS
from tests.factories import DeviceFactory


@pytest.fixture(autouse=True)
def _broker_managed(services):
    if not managed():
        pytest.skip("this broker's identities are not managed by iotqueue (IOTQUEUE_MQTT_AUTH=none)")


@pytest.fixture
def foreign_user():
    """Make broker users by hand, as an operator would (no iotqueue mark); removed afterwards."""
    made: list[str] = []

    def make(*, roles: tuple[str, ...] = (), textname: str = "edge consumer") -> tuple[str, str]:
        name, password = f"edge-{uuid.uuid4().hex[:10]}", password_new()
        control.execute_checked(
            [
                {
                    "command": "createClient",
                    "username": name,
                    "password": password,
                    "textname": textname,
                    "roles": [{"rolename": role} for role in roles],
                }
            ]
        )
        made.append(name)
        return name, password

    yield make
    control.execute([{"command": "deleteClient", "username": name} for name in made])
    control.execute([{"command": "deleteRole", "rolename": role_name(name)} for name in made])


@pytest.fixture
def api() -> APIClient:
    client = APIClient()
    client.force_authenticate(User.objects.create_superuser(f"root-{uuid.uuid4().hex[:6]}"))
    return client


def connect_result(username: str, password: str) -> mqtt.ReasonCode:
    """The broker's CONNACK reason for these credentials (the client is closed again)."""
    address = broker_address(settings.MQTT_URL)
    client = mqtt.Client(callback_api_version=mqtt.CallbackAPIVersion.VERSION2)
    client.username_pw_set(username, password)
    answer: queue.Queue = queue.Queue()
    client.on_connect = lambda c, u, f, reason_code, p: answer.put(reason_code)
    client.connect(address.host, address.port)
    client.loop_start()
    try:
        return answer.get(timeout=WAIT_SECONDS)
    finally:
        client.disconnect()
        client.loop_stop()


def client_roles(name: str) -> list[str]:
    client = identity_read(name).client
    return [entry["rolename"] for entry in client["roles"]]


@pytest.mark.django_db
def test_rest_refuses_a_device_named_like_a_foreign_broker_user_with_409(api, foreign_user):
    # given an operator's broker user that administers the plugin
    name, password = foreign_user(roles=(ADMIN_ROLE,))

    # when someone who may add devices creates a device of that name
    response = api.post("/api/devices/", {"name": name}, format="json")

    # then 409 saying so, no row, the user untouched and still the operator's alone
    assert response.status_code == 409, response.content
    assert "did not create" in response.json()["name"][0]
    assert not Device.objects.filter(name=name).exists()
    assert client_roles(name) == [ADMIN_ROLE]
    assert identity_read(name).role is None
    assert not connect_result(name, password).is_failure


@pytest.mark.django_db
def test_renaming_a_device_to_a_foreign_user_is_refused_and_the_device_keeps_its_name(api, foreign_user):
    device = DeviceFactory()
    name, _ = foreign_user()

    response = api.patch(f"/api/devices/{device.name}/", {"name": name}, format="json")

    assert response.status_code == 409, response.content
    assert Device.objects.filter(pk=device.pk, name=device.name).exists()
    assert client_roles(name) == []
    assert identity_read(device.name).client is not None  # the old identity was not removed


@pytest.mark.django_db
def test_a_foreign_user_created_between_the_check_and_the_write_rolls_the_device_back(api, monkeypatch):
    # given the name is free when the request checks it, and an operator creates a broker
    # user of that name right after the check, before the device is written
    checked = identity_conflict
    name_holder: dict[str, str] = {}

    def race_on_the_posted_name(name: str) -> str | None:
        answer = checked(name)
        password = password_new()
        control.execute_checked([{"command": "createClient", "username": name, "password": password}])
        name_holder["name"], name_holder["password"] = name, password
        return answer

    monkeypatch.setattr(device_serializers, "identity_conflict", race_on_the_posted_name)
    posted = f"race-{uuid.uuid4().hex[:10]}"
    try:
        # when the device is created
        response = api.post("/api/devices/", {"name": posted}, format="json")

        # then the write finds the foreign user: 409, no row, the user untouched
        assert response.status_code == 409, response.content
        assert not Device.objects.filter(name=posted).exists()
        assert client_roles(posted) == []
        assert identity_read(posted).role is None
        assert not connect_result(posted, name_holder["password"]).is_failure
    finally:
        control.execute([{"command": "deleteClient", "username": posted}])


@pytest.mark.django_db
def test_a_role_given_by_another_writer_between_the_read_and_the_write_is_no_error(monkeypatch):
    # given a device whose identity is written, its role then taken away
    device = DeviceFactory()
    control.execute_checked(
        [{"command": "removeClientRole", "username": device.name, "rolename": role_name(device.name)}]
    )
    # and another process saving the same device gives the role back right after our read
    # (Mosquitto 2.0 then answers our addClientRole with "Internal error")
    read = credentials.identity_read

    def read_then_another_writer(name: str):
        identity = read(name)
        control.execute_checked([{"command": "addClientRole", "username": name, "rolename": role_name(name)}])
        monkeypatch.setattr(credentials, "identity_read", read)
        return identity

    monkeypatch.setattr(credentials, "identity_read", read_then_another_writer)

    # when the device's identity is written (as saving it does)
    credentials.identity_write(device)

    # then the write stands, and the device holds its role once
    assert client_roles(device.name) == [role_name(device.name)]


@pytest.mark.django_db
def test_the_admin_refuses_a_foreign_name_with_a_form_error(client, foreign_user):
    name, _ = foreign_user()
    client.force_login(User.objects.create_superuser("admin-ident"))

    response = client.post(
        "/admin/devices/device/add/",
        {"name": name, "labels": "{}", "config": "{}", "min_interval_seconds": 0, "max_per_minute": 0},
    )

    assert response.status_code == 200  # the form again, with the error
    assert "did not create" in str(response.context["adminform"].form.errors["name"])
    assert not Device.objects.filter(name=name).exists()
    assert client_roles(name) == []


@pytest.mark.django_db
def test_iotqueue_marks_what_it_creates(api):
    response = api.post("/api/devices/", {"name": f"marked-{uuid.uuid4().hex[:8]}"}, format="json")
    assert response.status_code == 201, response.content

    identity = identity_read(response.json()["name"])

    assert identity.client["textdescription"] == MANAGED_MARK
    assert identity.role["textdescription"] == MANAGED_MARK


@pytest.mark.django_db
def test_deleting_a_device_never_deletes_a_foreign_user(api):
    # given a device whose broker user was replaced by one an operator made by hand
    device = DeviceFactory()
    password = password_new()
    control.execute_checked(
        [
            {"command": "deleteClient", "username": device.name},
            {"command": "createClient", "username": device.name, "password": password, "textname": "ops"},
        ]
    )
    try:
        # when the device is deleted
        response = api.delete(f"/api/devices/{device.name}/")

        # then the row and iotqueue's role are gone, the operator's user still logs in
        assert response.status_code == 204, response.content
        assert not Device.objects.filter(pk=device.pk).exists()
        assert identity_read(device.name).role is None
        assert not connect_result(device.name, password).is_failure
    finally:
        control.execute([{"command": "deleteClient", "username": device.name}])


@pytest.mark.django_db
def test_sync_reports_a_foreign_user_under_a_device_name_and_leaves_it_alone(foreign_user):
    # given a device row (saved without signals, as before the fix) named like an operator's user
    name, password = foreign_user(roles=(ADMIN_ROLE,))
    Device.objects.bulk_create([Device(name=name)])

    # when the sync runs
    out, err = io.StringIO(), io.StringIO()
    call_command("mqtt_identities_sync", stdout=out, stderr=err)

    # then it says so and the user keeps exactly its own roles
    assert name in err.getvalue()
    assert "1 not iotqueue's left alone" in out.getvalue()
    assert client_roles(name) == [ADMIN_ROLE]
    assert identity_read(name).role is None
    assert not connect_result(name, password).is_failure


@pytest.mark.django_db
def test_an_identity_from_before_the_mark_is_adopted_and_keeps_working():
    # given a device and its broker user and role as the pre-mark code made them
    device = Device.objects.bulk_create([Device(name=f"legacy-{uuid.uuid4().hex[:8]}")])[0]
    role, password = role_name(device.name), password_new()
    control.execute_checked(
        [
            {"command": "createRole", "rolename": role, "acls": device_acls(device)},
            {"command": "createClient", "username": device.name, "textname": f"device {device.name}"},
            {"command": "addClientRole", "username": device.name, "rolename": role},
            {"command": "setClientPassword", "username": device.name, "password": password},
        ]
    )

    # when the sync runs (as after an upgrade)
    out = io.StringIO()
    call_command("mqtt_identities_sync", stdout=out, stderr=io.StringIO())

    # then both are marked, the password still works, and deleting the device removes them
    identity = identity_read(device.name)
    assert identity.client["textdescription"] == MANAGED_MARK
    assert identity.role["textdescription"] == MANAGED_MARK
    assert "0 not iotqueue's" in out.getvalue()
    assert not connect_result(device.name, password).is_failure
    Device.objects.get(pk=device.pk).delete()
    assert identity_read(device.name).client is None
    assert connect_result(device.name, password).is_failure


@pytest.mark.django_db
def test_issuing_credentials_for_a_foreign_name_changes_nothing(foreign_user):
    name, password = foreign_user()
    device = Device.objects.bulk_create([Device(name=name)])[0]

    with pytest.raises(device_serializers.IdentityForeign):
        device_password_issue(device)

    assert not connect_result(name, password).is_failure
    assert client_roles(name) == []
