"""Issuing a device's client certificate over REST and in the admin: shown once, fail closed."""

from __future__ import annotations

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID
from django.contrib.auth.models import Permission, User
from rest_framework.test import APIClient

from devices import certificates
from devices.credentials import managed
from devices.models import Device
from tests.devices.certificate_client import CertificateClient, files_for
from tests.factories import DeviceFactory


@pytest.fixture
def broker_managed(services):
    if not managed():
        pytest.skip("this broker's identities are not managed by iotqueue (IOTQUEUE_MQTT_AUTH=none)")


@pytest.fixture
def operator_api() -> APIClient:
    operator = User.objects.create_user("cert-operator")
    operator.user_permissions.add(*Permission.objects.filter(codename__in=["view_device", "change_device"]))
    api = APIClient()
    api.force_authenticate(operator)
    return api


def url(device: Device) -> str:
    return f"/api/devices/{device.name}/certificate/"


def csr_for(common_name: str, key) -> str:
    request = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .sign(key, hashes.SHA256())
    )
    return request.public_bytes(serialization.Encoding.PEM).decode()


@pytest.mark.django_db
def test_an_issued_certificate_and_key_are_shown_once_and_connect(
    broker_managed, services, operator_api, tmp_path
):
    # given a device and an operator who may change devices
    device = DeviceFactory()

    # when the operator asks for a certificate
    response = operator_api.post(url(device), {}, format="json")

    # then the answer carries a certificate for the device's name, its new key and the CA
    assert response.status_code == 201, response.content
    body = response.json()
    certificate = x509.load_pem_x509_certificate(body["certificate"].encode())
    assert certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == device.name
    assert body["private_key"].startswith("-----BEGIN PRIVATE KEY-----")
    # and the device keeps only what identifies it, shown by the REST read, never the key
    read = operator_api.get(f"/api/devices/{device.name}/").json()
    assert read["certificate_serial"] == body["serial"] == format(certificate.serial_number, "X")
    assert read["certificate_fingerprint"] == body["fingerprint"]
    assert read["certificate_not_after"]
    assert "PRIVATE KEY" not in str(read)
    # and with them the device logs in on the mTLS listener
    if services.broker is not None and services.broker.tls_url:
        files = files_for(
            tmp_path,
            certificate_pem=body["certificate"],
            key_pem=body["private_key"],
            ca_pem=body["broker_ca_certificate"],
        )
        client = CertificateClient(services.broker.tls_url, files)
        try:
            kind, code = client.connect()
            assert kind == "connack" and not code.is_failure
        finally:
            client.close()


@pytest.mark.django_db
def test_a_csr_for_the_device_is_signed_without_a_key_in_the_answer(broker_managed, operator_api):
    device = DeviceFactory()
    key = certificates.key_new()

    response = operator_api.post(url(device), {"csr": csr_for(device.name, key)}, format="json")

    assert response.status_code == 201, response.content
    body = response.json()
    assert body["private_key"] == ""
    certificate = x509.load_pem_x509_certificate(body["certificate"].encode())
    assert certificate.public_key().public_numbers() == key.public_key().public_numbers()


@pytest.mark.django_db
@pytest.mark.parametrize(
    "key_and_name",
    [
        pytest.param(lambda device: (certificates.key_new(), "someone-else"), id="another-name"),
        pytest.param(
            lambda device: (rsa.generate_private_key(public_exponent=65537, key_size=1024), device.name),
            id="weak-key",
        ),
    ],
)
def test_a_csr_of_another_name_or_a_weak_key_is_refused_naming_the_field(
    broker_managed, operator_api, key_and_name
):
    device = DeviceFactory()
    key, name = key_and_name(device)

    response = operator_api.post(url(device), {"csr": csr_for(name, key)}, format="json")

    assert response.status_code == 400
    assert list(response.json()) == ["csr"]
    device.refresh_from_db()
    assert device.certificate_serial == ""


@pytest.mark.django_db
def test_without_a_device_ca_nothing_is_issued(broker_managed, operator_api, settings):
    device = DeviceFactory()
    settings.IOTQUEUE_DEVICE_CA_CERT = settings.IOTQUEUE_DEVICE_CA_KEY = ""

    response = operator_api.post(url(device), {}, format="json")

    assert response.status_code == 503
    assert "IOTQUEUE_DEVICE_CA_CERT" in response.json()["detail"]
    device.refresh_from_db()
    assert device.certificate_serial == ""


@pytest.mark.django_db
def test_the_broker_ca_handed_to_devices_is_the_configured_one(
    broker_managed, operator_api, settings, tmp_path
):
    # given a deployment whose broker certificate comes from another CA than the device CA
    broker_ca = certificates.authority_create("broker CA", days=1)
    path = certificates.files_write(tmp_path, {"broker-ca.crt": broker_ca.certificate_pem})["broker-ca.crt"]
    settings.IOTQUEUE_BROKER_CA_CERT = str(path)

    body = operator_api.post(url(DeviceFactory()), {}, format="json").json()

    # then the device gets that CA to verify the broker, and the device CA as its issuer
    assert body["broker_ca_certificate"] == broker_ca.certificate_pem
    assert body["ca_certificate"] != broker_ca.certificate_pem


@pytest.mark.django_db
def test_a_device_whose_name_no_certificate_can_hold_gets_none(broker_managed, operator_api):
    # given a device with a valid name longer than a certificate's common name holds (64)
    device = DeviceFactory(name="d" * 65)

    response = operator_api.post(url(device), {}, format="json")

    assert response.status_code == 409
    assert "64" in response.json()["detail"]
    device.refresh_from_db()
    assert device.certificate_serial == ""


@pytest.mark.django_db
def test_a_broker_whose_identities_iotqueue_does_not_manage_gets_no_certificate(operator_api, settings):
    # e.g. the pip-only amqtt broker: no dynamic security, so nothing could confine the device
    settings.IOTQUEUE_MQTT_AUTH = "none"
    device = DeviceFactory()

    response = operator_api.post(url(device), {}, format="json")

    assert response.status_code == 409
    assert "IOTQUEUE_MQTT_AUTH=none" in response.json()["detail"]


@pytest.mark.django_db
def test_issuing_needs_the_change_permission_and_a_hidden_device_is_unknown(broker_managed):
    device = DeviceFactory()
    viewer = User.objects.create_user("cert-viewer")
    viewer.user_permissions.add(Permission.objects.get(codename="view_device"))
    nobody = User.objects.create_user("cert-nobody")
    api = APIClient()

    api.force_authenticate(viewer)
    assert api.post(url(device), {}, format="json").status_code == 403
    api.force_authenticate(nobody)
    assert api.post(url(device), {}, format="json").status_code == 404
    api.force_authenticate(None)
    assert api.post(url(device), {}, format="json").status_code in (401, 403)
    device.refresh_from_db()
    assert device.certificate_serial == ""


@pytest.mark.django_db
def test_the_admin_action_shows_the_key_once_and_the_device_page_the_serial(broker_managed, client):
    device = DeviceFactory()
    client.force_login(User.objects.create_superuser("cert-admin"))

    response = client.post(
        "/admin/devices/device/", {"action": "certificate_issue", "_selected_action": [device.pk]}
    )

    assert response.status_code == 200
    page = response.content.decode()
    assert "-----BEGIN PRIVATE KEY-----" in page and "-----BEGIN CERTIFICATE-----" in page
    assert "no-store" in response["Cache-Control"]
    device.refresh_from_db()
    assert device.certificate_serial and device.certificate_serial in page
    change_page = client.get(f"/admin/devices/device/{device.pk}/change/").content.decode()
    assert device.certificate_serial in change_page
    assert "PRIVATE KEY" not in change_page
