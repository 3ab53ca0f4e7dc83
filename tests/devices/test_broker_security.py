"""The broker lets no one in but known identities, and a device only at its own topics.

Runs against the real Mosquitto with its dynamic security plugin (the embedded broker is
started that way whenever the system has Mosquitto); skipped where the broker's identities
are not managed by iotqueue (the pip-only amqtt broker).
"""

from __future__ import annotations

import io
import json
import queue
import threading
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from django.conf import settings
from django.contrib.auth.models import Permission, User
from django.core.management import call_command
from django.db import connection
from rest_framework.test import APIClient

from devices import certificates
from devices.credentials import device_certificate_issue, device_password_issue, identity_remove, managed
from devices.models import Device
from devices.profiles import DeviceProtocol
from iotqueue.dynsec import control
from iotqueue.mqtt import broker_address
from jobs.models import RunEvent, StepRun, StepStatus
from jobs.services import run_start
from tests.conftest import WAIT_SECONDS, wait_for
from tests.devices.certificate_client import CertificateClient, files_for
from tests.factories import DeviceFactory, template_with_steps
from tests.mqtt_device import mqtt_client


@pytest.fixture(autouse=True)
def _broker_managed(services):
    if not managed():
        pytest.skip("this broker's identities are not managed by iotqueue (IOTQUEUE_MQTT_AUTH=none)")


def connect_result(username: str | None, password: str | None) -> mqtt.ReasonCode:
    """The broker's CONNACK reason for these credentials (the client is closed again)."""
    address = broker_address(settings.MQTT_URL)
    client = mqtt.Client(callback_api_version=mqtt.CallbackAPIVersion.VERSION2)
    if username is not None:
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


def topic(device: str, kind: str) -> str:
    return f"{settings.IOTQUEUE_TOPIC_PREFIX}/{device}/{kind}"


@pytest.mark.django_db
def test_anonymous_and_wrong_passwords_are_refused():
    device = DeviceFactory()
    password = device_password_issue(device)

    assert connect_result(None, None).is_failure
    assert connect_result(device.name, password + "x").is_failure
    assert connect_result("no-such-device", password).is_failure
    assert not connect_result(device.name, password).is_failure


@pytest.mark.django_db
def test_a_disabled_device_cannot_connect_and_a_rotated_password_stops_the_old_one():
    device = DeviceFactory()
    old = device_password_issue(device)
    new = device_password_issue(device)

    assert connect_result(device.name, old).is_failure
    assert not connect_result(device.name, new).is_failure

    device.enabled = False
    device.save()
    assert connect_result(device.name, new).is_failure
    device.enabled = True
    device.save()
    assert not connect_result(device.name, new).is_failure

    name = device.name
    device.delete()
    assert connect_result(name, new).is_failure


@pytest.mark.django_db
def test_a_device_cannot_subscribe_to_another_devices_commands():
    a, b = DeviceFactory(), DeviceFactory()
    client = mqtt_client(settings.MQTT_URL, username=a.name, password=device_password_issue(a))
    granted: queue.Queue = queue.Queue()
    client.on_subscribe = lambda c, u, mid, codes, p: granted.put([code.is_failure for code in codes])
    try:
        client.subscribe([(topic(a.name, "cmd/#"), 1), (topic(b.name, "cmd/#"), 1), ("#", 1)])
        assert granted.get(timeout=WAIT_SECONDS) == [False, True, True]
    finally:
        client.loop_stop()
        client.disconnect()


@pytest.mark.django_db(transaction=True)
def test_a_forged_done_from_another_device_does_not_complete_the_step(stack, manual_device):
    # given a run waiting on device B's done, and device A logged in as itself
    a, b = DeviceFactory(), DeviceFactory()
    device_b = manual_device(b.name)
    template = template_with_steps((b, "open", {}))
    template.steps.update(timeout_seconds=300)  # far beyond the test: only B's done may end it
    run, _ = run_start(template=template)
    command = device_b.next_command()
    forger = mqtt_client(settings.MQTT_URL, username=a.name, password=device_password_issue(a))
    watcher = mqtt_client(settings.MQTT_URL)  # the service user sees everything that passes
    seen: queue.Queue = queue.Queue()
    watcher.on_message = lambda c, u, message: seen.put(message.topic)
    subscribed = threading.Event()
    watcher.on_subscribe = lambda *args: subscribed.set()
    watcher.subscribe([(topic(b.name, "done"), 1), (topic(a.name, "heartbeat"), 1)])
    assert subscribed.wait(WAIT_SECONDS)
    try:
        # when A publishes a done for B's command, then a heartbeat of its own
        forged = json.dumps({"id": command["id"], "ok": True, "result": {"forged": True}})
        forger.publish(topic(b.name, "done"), forged, qos=1).wait_for_publish(WAIT_SECONDS)
        forger.publish(topic(a.name, "heartbeat"), b"{}", qos=1).wait_for_publish(WAIT_SECONDS)

        # then the broker passed the heartbeat (sent after the forgery) and never the forgery
        assert seen.get(timeout=WAIT_SECONDS) == topic(a.name, "heartbeat")
        assert seen.empty()
        # and the bridge saw no done for B: the step is still waiting, with no reply event
        assert StepRun.objects.get(run=run).status == StepStatus.DISPATCHED
        assert not RunEvent.objects.filter(run=run, kind__startswith="reply.").exists()

        # and B's own done completes it on the first attempt, with B's result
        device_b.done(command["id"], result={"real": True})
        step = wait_for(
            lambda: StepRun.objects.filter(run=run, status=StepStatus.SUCCEEDED).first(), what="B's done"
        )
        assert step.attempt == 1
        assert step.result == {"real": True}
    finally:
        for client in (forger, watcher):
            client.loop_stop()
            client.disconnect()


@pytest.mark.django_db
def test_a_legacy_device_gets_exactly_its_override_topics():
    device = DeviceFactory(command_topic=f"legacy/{settings.IOTQUEUE_TOPIC_PREFIX}/in", reply_topic="")
    device.reply_topic = f"legacy/{settings.IOTQUEUE_TOPIC_PREFIX}/out"
    device.save()
    client = mqtt_client(settings.MQTT_URL, username=device.name, password=device_password_issue(device))
    granted: queue.Queue = queue.Queue()
    client.on_subscribe = lambda c, u, mid, codes, p: granted.put([code.is_failure for code in codes])
    try:
        client.subscribe([(device.command_topic, 1), (f"legacy/{settings.IOTQUEUE_TOPIC_PREFIX}/other", 1)])
        assert granted.get(timeout=WAIT_SECONDS) == [False, True]
    finally:
        client.loop_stop()
        client.disconnect()


@pytest.mark.django_db
def test_credentials_over_rest_need_change_permission_and_are_shown_once():
    device = DeviceFactory()
    viewer = User.objects.create_user("viewer")
    viewer.user_permissions.add(Permission.objects.get(codename="view_device"))
    operator = User.objects.create_user("operator")
    operator.user_permissions.add(*Permission.objects.filter(codename__in=["view_device", "change_device"]))
    api = APIClient()
    url = f"/api/devices/{device.name}/credentials/"

    api.force_authenticate(viewer)
    assert api.post(url).status_code == 403
    api.force_authenticate(operator)
    response = api.post(url)
    assert response.status_code == 201
    body = response.json()
    assert body["username"] == device.name
    assert not connect_result(device.name, body["password"]).is_failure
    # the device's own page never shows it again
    assert body["password"] not in api.get(f"/api/devices/{device.name}/").content.decode()
    assert api.post("/api/devices/no-such-device/credentials/").status_code == 404


@pytest.mark.django_db
def test_a_device_may_not_take_the_service_users_name():
    service_user = broker_address(settings.MQTT_URL).username
    api = APIClient()
    api.force_authenticate(User.objects.create_superuser("root"))
    response = api.post("/api/devices/", {"name": service_user}, format="json")
    assert response.status_code == 400
    assert "name" in response.json()
    assert not Device.objects.filter(name=service_user).exists()


@pytest.mark.django_db
def test_identities_sync_makes_the_broker_match_the_rows():
    # given rows changed behind the signals' back: an identity lost, a row deleted with
    # plain SQL, a device disabled with update()
    kept = DeviceFactory()
    identity_remove(kept.name)
    gone = DeviceFactory()
    gone_password = device_password_issue(gone)
    with connection.cursor() as cursor:
        cursor.execute(f"DELETE FROM {Device._meta.db_table} WHERE id = %s", [gone.pk])
    stale = DeviceFactory()
    stale_password = device_password_issue(stale)
    Device.objects.filter(pk=stale.pk).update(enabled=False)
    assert not connect_result(gone.name, gone_password).is_failure
    assert not connect_result(stale.name, stale_password).is_failure

    # when the sync runs
    out = io.StringIO()
    call_command("mqtt_identities_sync", stdout=out)

    # then the deleted device's user is gone, the disabled one's refused, the lost one back
    assert connect_result(gone.name, gone_password).is_failure
    assert connect_result(stale.name, stale_password).is_failure
    assert not connect_result(kept.name, device_password_issue(kept)).is_failure
    assert "removed" in out.getvalue()


def test_security_init_writes_the_file_once(tmp_path, settings):
    settings.MQTT_URL = "mqtt://svc:s3cret@broker:1883"
    path = tmp_path / "dynamic-security.json"
    call_command("mqtt_security_init", str(path), stdout=io.StringIO())
    first = json.loads(path.read_text())
    assert [c["username"] for c in first["clients"]] == ["svc"]
    assert first["defaultACLAccess"]["publishClientSend"] is False
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    call_command("mqtt_security_init", str(path), stdout=io.StringIO())
    assert json.loads(path.read_text()) == first


@pytest.mark.django_db
def test_the_admin_action_issues_a_password_shown_once(client):
    device = DeviceFactory()
    client.force_login(User.objects.create_superuser("admin-user"))
    response = client.post(
        "/admin/devices/device/",
        {"action": "credentials_issue", "_selected_action": [device.pk]},
        follow=True,
    )
    messages = [str(m) for m in response.context["messages"]]
    assert len(messages) == 1 and "not shown again" in messages[0]
    password = messages[0].split("password '")[1].split("'")[0]
    assert not connect_result(device.name, password).is_failure


@pytest.mark.django_db
def test_admin_bulk_delete_with_the_broker_unreachable_deletes_nothing_and_says_why(
    client, settings, monkeypatch
):
    devices = [DeviceFactory(), DeviceFactory()]
    monkeypatch.setattr("iotqueue.dynsec.CONNECT_TIMEOUT_SECONDS", 1.0)
    client.force_login(User.objects.create_superuser("bulk-admin"))
    settings.MQTT_URL = "mqtt://iotqueue:wrong-password@127.0.0.1:1"  # nothing listens there
    control.close()
    try:
        response = client.post(
            "/admin/devices/device/",
            {"action": "delete_selected", "_selected_action": [d.pk for d in devices], "post": "yes"},
            follow=True,
        )
    finally:
        control.close()
    assert response.status_code == 200
    assert any("nothing changed" in str(m) for m in response.context["messages"])
    assert Device.objects.filter(pk__in=[d.pk for d in devices]).count() == 2


# --- Certificate devices: the mTLS listener (require_certificate, use_identity_as_username) ---


@pytest.fixture
def tls_url(services) -> str:
    """The embedded broker's mTLS listener; skipped against a broker this suite did not start."""
    if services.broker is None or not services.broker.tls_url:
        pytest.skip("no mTLS listener on this broker (MQTT_URL given, or no dynamic security)")
    return services.broker.tls_url


@pytest.fixture
def certificate_device(tls_url, tmp_path):
    """certificate_device(device, client_id=None): a CertificateClient holding a certificate
    issued to `device` by iotqueue (not connected yet); all are closed after the test."""
    clients: list[CertificateClient] = []

    def make(device: Device, *, client_id: str | None = None) -> CertificateClient:
        issued = device_certificate_issue(device)
        files = files_for(
            tmp_path / f"{device.name}-{len(clients)}",
            certificate_pem=issued.certificate_pem,
            key_pem=issued.private_key_pem,
            ca_pem=issued.ca_certificate_pem,
        )
        clients.append(CertificateClient(tls_url, files, client_id=client_id))
        return clients[-1]

    yield make
    for client in clients:
        client.close()


def connected(client: CertificateClient) -> CertificateClient:
    kind, code = client.connect()
    assert kind == "connack" and not code.is_failure, (kind, code)
    return client


@pytest.mark.django_db
def test_a_certificate_device_touches_only_its_own_topics_with_any_client_id(certificate_device):
    # given device A holding a certificate from iotqueue, and device B
    a, b = DeviceFactory(), DeviceFactory()

    # when A connects twice with SDK-style random client ids (and once with an empty one)
    first = connected(certificate_device(a))
    second = connected(certificate_device(a, client_id=""))

    # then each may subscribe to A's commands, never to B's or to everything
    assert first.subscribe(topic(a.name, "cmd/#"), topic(b.name, "cmd/#"), "#") == [False, True, True]
    assert second.subscribe(topic(a.name, "cmd/#")) == [False]
    # and may publish A's replies, never B's
    assert not first.publish_refused(topic(a.name, "done"))
    assert first.publish_refused(topic(b.name, "done"))


@pytest.mark.django_db
def test_a_password_device_may_use_any_client_id():
    device = DeviceFactory()
    password = device_password_issue(device)
    address = broker_address(settings.MQTT_URL)
    for client_id in ("", f"sdk-{device.name}-1", "anything-else"):
        client = mqtt.Client(callback_api_version=mqtt.CallbackAPIVersion.VERSION2, client_id=client_id)
        client.username_pw_set(device.name, password)
        answer: queue.Queue = queue.Queue()
        client.on_connect = lambda c, u, f, reason_code, p, answer=answer: answer.put(reason_code)
        client.connect(address.host, address.port)
        client.loop_start()
        try:
            assert not answer.get(timeout=WAIT_SECONDS).is_failure, client_id
        finally:
            client.disconnect()
            client.loop_stop()


@pytest.mark.django_db
def test_a_certificate_with_a_device_name_but_not_from_the_device_ca_is_refused(tls_url, tmp_path):
    # given a CA of someone else's, signing a certificate whose CN is an existing device's name
    device = DeviceFactory()
    forger_ca = certificates.authority_create("not iotqueue", days=1)
    key = certificates.key_new()
    forged = certificates.certificate_sign(
        forger_ca, common_name=device.name, public_key=key.public_key(), days=1
    )
    files = files_for(
        tmp_path,
        certificate_pem=certificates.certificate_pem(forged),
        key_pem=certificates.key_pem(key),
        # the client trusts the broker (it has the right CA file), only its own certificate is foreign
        ca_pem=Path(settings.IOTQUEUE_DEVICE_CA_CERT).read_text(),
    )
    client = CertificateClient(tls_url, files)

    # when it connects, then the broker ends the handshake: no CONNACK
    try:
        kind, why = client.connect()
        assert kind in ("refused", "disconnect"), (kind, why)
    finally:
        client.close()


@pytest.mark.django_db
def test_a_certificate_device_cannot_log_in_on_the_password_listener_without_a_password(certificate_device):
    # given a device that has only ever been given a certificate
    device = DeviceFactory()
    connected(certificate_device(device))

    # then its name alone, or with any password, does not open the password listener
    assert connect_result(device.name, None).is_failure
    assert connect_result(device.name, "").is_failure
    assert connect_result(device.name, "guess").is_failure


def granted_topics(device: Device) -> tuple[list[str], list[str]]:
    """(subscribe, publish): topics the device's role grants while it is enabled, of its protocol."""
    subscribe = [topic(device.name, "cmd/#"), topic(device.name, "jobs/current")]
    publish = [topic(device.name, "heartbeat")]
    if device.protocol == DeviceProtocol.AWS_IOT_JOBS:
        subscribe.append(f"$aws/things/{device.name}/jobs/notify-next")
        publish.append(f"$aws/things/{device.name}/jobs/get")
    return subscribe, publish


def may_do_nothing(client: CertificateClient, subscribe: list[str], publish: list[str]) -> None:
    """Every subscription refused (SUBACK 0x87: its topics and everything) and every publish
    refused (PUBACK 0x87): the broker's answers, each awaited."""
    assert client.subscribe(*subscribe, "#", "$aws/#") == [True] * (len(subscribe) + 2)
    assert [client.publish_refused(name) for name in publish] == [True] * len(publish)


@pytest.mark.django_db
@pytest.mark.parametrize("protocol", DeviceProtocol.values)
def test_disabling_a_certificate_device_kicks_it_and_locks_it_out_until_enabled(certificate_device, protocol):
    # given a certificate device of either protocol, connected and using its own topics
    device = DeviceFactory(protocol=protocol)
    subscribe, publish = granted_topics(device)
    client = connected(certificate_device(device))
    assert client.subscribe(*subscribe) == [False] * len(subscribe)
    assert [client.publish_refused(name) for name in publish] == [False] * len(publish)

    # when the device is disabled, then the broker drops its connection at once
    device.enabled = False
    device.save()
    assert client.next_event()[0] == "disconnect"
    # and a new connection (Mosquitto accepts the certificate itself) may do nothing at all
    connected(client)
    may_do_nothing(client, subscribe, publish)

    # when it is enabled again, then the same certificate works again
    device.enabled = True
    device.save()
    client.close()
    connected(client)
    assert client.subscribe(*subscribe) == [False] * len(subscribe)
    assert [client.publish_refused(name) for name in publish] == [False] * len(publish)


@pytest.mark.django_db
@pytest.mark.parametrize("protocol", DeviceProtocol.values)
def test_a_deleted_devices_certificate_is_kicked_and_can_do_nothing_again(certificate_device, protocol):
    # given a certificate device of either protocol, connected
    device = DeviceFactory(protocol=protocol)
    subscribe, publish = granted_topics(device)
    client = connected(certificate_device(device))

    # when the device is deleted, then its connection is dropped at once
    device.delete()
    assert client.next_event()[0] == "disconnect"
    # and every new connection with that certificate may neither subscribe nor publish
    for _attempt in range(2):
        connected(client)
        may_do_nothing(client, subscribe, publish)
        client.close()
