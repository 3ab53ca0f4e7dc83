"""A device's protocol over REST (refused values name the field, devices filter by it) and in
the broker: switching a device to aws-iot-jobs gives its role the $aws/things/<name>/jobs
topics, switching it back takes them away."""

from __future__ import annotations

import io
import uuid

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from rest_framework.test import APIClient

from devices.credentials import identity_read, managed
from devices.models import Device
from iotqueue.dynsec import SERVICE_ACL_TYPES, SERVICE_ROLE, control

pytestmark = pytest.mark.django_db


@pytest.fixture
def api() -> APIClient:
    client = APIClient()
    client.force_authenticate(User.objects.create_superuser(f"root-{uuid.uuid4().hex[:6]}"))
    return client


def role_topics(name: str) -> set[str]:
    return {acl["topic"] for acl in identity_read(name).role["acls"]}


def test_a_device_is_of_the_iotqueue_protocol_unless_told(api, services):
    name = f"plain-{uuid.uuid4().hex[:8]}"
    response = api.post("/api/devices/", {"name": name}, format="json")
    assert response.status_code == 201, response.content
    assert response.json()["protocol"] == "iotqueue"


def test_a_new_aws_device_does_not_wait_for_a_status_it_never_sends_unless_told(api, services):
    created = api.post("/api/devices/", {"name": f"gw-{uuid.uuid4().hex[:8]}", "protocol": "aws-iot-jobs"})
    assert created.status_code == 201 and created.json()["presence_required"] is False
    told = {"name": f"gw-{uuid.uuid4().hex[:8]}", "protocol": "aws-iot-jobs", "presence_required": True}
    assert api.post("/api/devices/", told, format="json").json()["presence_required"] is True


def test_an_unknown_protocol_is_refused_naming_the_field(api, services):
    response = api.post(
        "/api/devices/", {"name": f"odd-{uuid.uuid4().hex[:8]}", "protocol": "lwm2m"}, format="json"
    )
    assert response.status_code == 400
    assert "protocol" in response.json()


def test_devices_are_listed_by_protocol_and_an_unknown_one_is_a_400(api, services):
    aws = Device.objects.create(name=f"gw-{uuid.uuid4().hex[:8]}", protocol="aws-iot-jobs")
    Device.objects.create(name=f"own-{uuid.uuid4().hex[:8]}")
    listed = api.get("/api/devices/", {"protocol": "aws-iot-jobs", "page_size": 500}).json()
    names = [device["name"] for device in listed.get("results", listed)]
    assert aws.name in names and all(name.startswith("gw-") for name in names)
    refused = api.get("/api/devices/", {"protocol": "mqtt"})
    assert refused.status_code == 400 and "protocol" in refused.json()


def test_changing_the_protocol_rewrites_the_devices_broker_role(api, services):
    if not managed():
        pytest.skip("this broker's identities are not managed by iotqueue (IOTQUEUE_MQTT_AUTH=none)")
    # given a device of the iotqueue protocol: no $aws topic in its role
    name = f"move-{uuid.uuid4().hex[:8]}"
    assert api.post("/api/devices/", {"name": name}, format="json").status_code == 201
    assert not [topic for topic in role_topics(name) if topic.startswith("$aws/")]

    # when it is switched to AWS IoT Jobs, then its role allows its own jobs topics
    response = api.patch(f"/api/devices/{name}/", {"protocol": "aws-iot-jobs"}, format="json")
    assert response.status_code == 200, response.content
    assert {f"$aws/things/{name}/jobs/#", f"$aws/things/{name}/jobs/+/update"} <= role_topics(name)

    # when it is switched back, then they are gone again
    assert api.patch(f"/api/devices/{name}/", {"protocol": "iotqueue"}, format="json").status_code == 200
    assert not [topic for topic in role_topics(name) if topic.startswith("$aws/")]


def service_acls() -> list[tuple[str, str]]:
    (response,) = control.execute([{"command": "getRole", "rolename": SERVICE_ROLE}])
    return [(acl["acltype"], acl["topic"]) for acl in response["data"]["role"]["acls"]]


def test_identities_sync_gives_an_older_brokers_service_role_the_aws_topics(services):
    if not managed():
        pytest.skip("this broker's identities are not managed by iotqueue (IOTQUEUE_MQTT_AUTH=none)")
    # given a service role written before the AWS IoT Jobs profile: no $aws/things/# ACL
    wanted = {(kind, "$aws/things/#") for kind in SERVICE_ACL_TYPES}
    # (Mosquitto 2.0.11 removes the ACL yet answers "ACL not found": the check below says.)
    control.execute_checked(
        [{"command": "removeRoleACL", "rolename": SERVICE_ROLE, "acltype": kind, "topic": topic}
         for kind, topic in wanted],
        tolerate=("not found",),
    )  # fmt: skip
    assert not wanted & set(service_acls())

    # when the identities are synchronised, twice
    call_command("mqtt_identities_sync", stdout=io.StringIO())
    call_command("mqtt_identities_sync", stdout=io.StringIO())

    # then the service role has them, once each
    acls = service_acls()
    assert all(acls.count(acl) == 1 for acl in wanted), acls
