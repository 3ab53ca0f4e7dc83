"""The device CA's signing rules: a CSR only for the device's own name and a strong key."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from devices import certificates
from devices.certificates import AuthorityUnavailable, CsrRefused


def csr_for(common_name: str, key=None) -> str:
    key = key or certificates.key_new()
    request = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .sign(key, hashes.SHA256())
    )
    return request.public_bytes(serialization.Encoding.PEM).decode()


@pytest.fixture(scope="module")
def authority() -> certificates.Authority:
    return certificates.authority_create("test device CA", days=30)


def test_a_signed_device_certificate_chains_to_the_ca_and_is_for_client_auth_only(authority):
    # given a device's CSR for its own name
    public_key = certificates.csr_public_key(csr_for("pump-7"), device_name="pump-7")

    # when the CA signs it
    certificate = certificates.certificate_sign(
        authority, common_name="pump-7", public_key=public_key, days=10
    )

    # then it names the device, chains to the CA and serves TLS client authentication only
    certificate.verify_directly_issued_by(authority.certificate)
    assert certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "pump-7"
    usage = certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert certificate.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    # and what the row keeps identifies exactly this certificate
    assert int(certificates.certificate_serial(certificate), 16) == certificate.serial_number
    assert len(certificates.certificate_fingerprint(certificate).split(":")) == 32


def test_a_certificate_never_outlives_its_ca(authority):
    certificate = certificates.certificate_sign(
        authority, common_name="d", public_key=certificates.key_new().public_key(), days=10_000
    )
    assert certificate.not_valid_after_utc == authority.certificate.not_valid_after_utc


def test_a_server_certificate_names_its_hosts(authority):
    certificate = certificates.certificate_sign(
        authority,
        common_name="localhost",
        public_key=certificates.key_new().public_key(),
        days=1,
        server_names=("localhost", "127.0.0.1"),
    )
    names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["localhost"]
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]


@pytest.mark.parametrize(
    ("csr", "says"),
    [
        (lambda: csr_for("other-device"), "common name"),
        (lambda: csr_for("pump-7", rsa.generate_private_key(public_exponent=65537, key_size=1024)), "2048"),
        (lambda: csr_for("pump-7", ec.generate_private_key(ec.SECP256K1())), "secp256k1"),
        (
            lambda: "-----BEGIN CERTIFICATE REQUEST-----\nnot base64\n-----END CERTIFICATE REQUEST-----\n",
            "PEM",
        ),
        (lambda: "x" * (certificates.CSR_MAX_CHARS + 1), "longer"),
    ],
    ids=["another-name", "weak-rsa", "odd-curve", "garbage", "oversized"],
)
def test_a_csr_of_another_name_a_weak_key_or_garbage_is_refused(csr, says):
    with pytest.raises(CsrRefused, match=says):
        certificates.csr_public_key(csr(), device_name="pump-7")


def test_a_csr_with_two_common_names_is_refused():
    key = certificates.key_new()
    request = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.COMMON_NAME, "pump-7"),
                    x509.NameAttribute(NameOID.COMMON_NAME, "root"),
                ]
            )
        )
        .sign(key, hashes.SHA256())
    )
    with pytest.raises(CsrRefused):
        certificates.csr_public_key(
            request.public_bytes(serialization.Encoding.PEM).decode(), device_name="pump-7"
        )


def test_no_configured_ca_or_a_mismatched_key_makes_the_authority_unavailable(authority, tmp_path):
    with pytest.raises(AuthorityUnavailable, match="IOTQUEUE_DEVICE_CA_CERT"):
        certificates.authority_load("", "")
    with pytest.raises(AuthorityUnavailable):
        certificates.authority_load(str(tmp_path / "missing.crt"), str(tmp_path / "missing.key"))
    paths = certificates.files_write(
        tmp_path,
        {
            "ca.crt": authority.certificate_pem,
            "ca.key": certificates.key_pem(authority.key),
            "other.key": certificates.key_pem(certificates.key_new()),
        },
    )
    loaded = certificates.authority_load(str(paths["ca.crt"]), str(paths["ca.key"]))
    assert loaded.certificate == authority.certificate
    with pytest.raises(AuthorityUnavailable, match="does not belong"):
        certificates.authority_load(str(paths["ca.crt"]), str(paths["other.key"]))
    assert oct(paths["ca.key"].stat().st_mode & 0o777) == "0o600"


def test_the_dev_ca_is_a_ca_valid_now(authority):
    now = datetime.datetime.now(datetime.UTC)
    assert authority.certificate.not_valid_before_utc < now < authority.certificate.not_valid_after_utc
    assert authority.certificate.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_a_process_that_never_signs_does_not_load_x509():
    # The bridge and the workers load every app (the admin included) but sign nothing:
    # `cryptography`'s X.509 and key code (about 10 MB a process) stays out of them.
    code = (
        "import sys, django; django.setup(); "
        "import iotqueue.bridge, jobs.tasks, devices.admin, devices.api; "
        "print(sorted(m for m in sys.modules if m.startswith('cryptography.')))"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "iotqueue.settings", "DEBUG": "true"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)

    assert done.returncode == 0, done.stderr
    assert "cryptography.x509" not in done.stdout and "cryptography.hazmat" not in done.stdout, done.stdout
