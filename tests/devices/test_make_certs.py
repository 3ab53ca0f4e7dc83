"""deploy/make-certs.sh makes a device CA that iotqueue signs device certificates with, which
the broker's 8884 listener (its cafile certs/device-ca.crt) accepts, and hands devices the
broker CA that verifies the broker's own certificate."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from devices import certificates

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def openssl_verify(ca: Path, certificate: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["openssl", "verify", "-CAfile", str(ca), str(certificate)], capture_output=True, text=True
    )


@pytest.mark.skipif(shutil.which("openssl") is None, reason="deploy/make-certs.sh needs openssl")
def test_make_certs_makes_a_device_ca_iotqueue_signs_with(tmp_path):
    # given a copy of deploy/ (the script writes beside itself)
    script = tmp_path / "make-certs.sh"
    shutil.copy2(DEPLOY / "make-certs.sh", script)

    # when it makes the broker's certificates for a host name and an address
    made = subprocess.run([str(script), "mqtt.example.com", "127.0.0.1"], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr

    # then the device CA is there, its certificate copied where the 8884 listener reads it,
    # and its key readable by its owner only
    device_ca = tmp_path / "device-ca"
    assert (tmp_path / "certs" / "device-ca.crt").read_text() == (device_ca / "ca.crt").read_text()
    assert (device_ca / "ca.key").stat().st_mode & 0o077 == 0
    # and a device certificate iotqueue signs with it chains to the listener's CA file
    authority = certificates.authority_load(str(device_ca / "ca.crt"), str(device_ca / "ca.key"))
    key = certificates.key_new()
    signed = certificates.certificate_sign(
        authority, common_name="lamp-2", public_key=key.public_key(), days=1
    )
    device_cert = tmp_path / "lamp-2.crt"
    device_cert.write_text(certificates.certificate_pem(signed))
    assert openssl_verify(tmp_path / "certs" / "device-ca.crt", device_cert).returncode == 0
    # but not to the broker CA (the two stay apart), which verifies the broker's certificate
    assert openssl_verify(tmp_path / "certs" / "ca.crt", device_cert).returncode != 0
    assert openssl_verify(device_ca / "broker-ca.crt", tmp_path / "certs" / "server.crt").returncode == 0

    # and running it again keeps the same device CA (devices' certificates stay valid)
    again = subprocess.run([str(script), "--device-ca"], capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert openssl_verify(tmp_path / "certs" / "device-ca.crt", device_cert).returncode == 0
