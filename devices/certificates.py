"""X.509 for certificate devices: the device CA, CSR checks, and signing (with `cryptography`).

A certificate device logs in on the broker's mTLS listener with a certificate whose CN is
its name (Mosquitto `use_identity_as_username`); the broker then confines it by that name's
dynamic-security role, as it does a password device. This module is pure X.509 — no rows,
no broker — so the dev stack (devtools/servers.py) makes its CA and server certificate with
the same code that signs devices; `devices/credentials.py` issues a device's certificate.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from django.utils.translation import gettext as _

from .certificate_rules import CSR_MAX_CHARS, AuthorityUnavailable, CsrRefused

# The smallest RSA key accepted in a CSR: NIST SP 800-57 retired 1024-bit RSA in 2013.
RSA_MIN_BITS = 2048
# Elliptic curves accepted in a CSR: those every TLS stack (and AWS IoT) takes, 128-bit or stronger.
EC_CURVES = (ec.SECP256R1, ec.SECP384R1, ec.SECP521R1)
# A certificate starts a little in the past: a device whose clock runs a few minutes behind
# must not refuse a certificate made just now.
CLOCK_SKEW = datetime.timedelta(minutes=5)


@dataclass(frozen=True)
class Authority:
    """A CA: its certificate and private key."""

    certificate: x509.Certificate
    key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey

    @property
    def certificate_pem(self) -> str:
        return self.certificate.public_bytes(serialization.Encoding.PEM).decode()


def authority_load(certificate_path: str, key_path: str) -> Authority:
    """The CA from its PEM files (the key unencrypted, readable by this process only).

    How it fails: AuthorityUnavailable when a path is empty, a file is unreadable, or the
    files are not a CA certificate and its matching key.
    """
    if not certificate_path or not key_path:
        raise AuthorityUnavailable(
            _(
                "no device CA is configured (IOTQUEUE_DEVICE_CA_CERT and IOTQUEUE_DEVICE_CA_KEY): "
                "no certificate can be issued"
            )
        )
    try:
        certificate = x509.load_pem_x509_certificate(Path(certificate_path).read_bytes())
        key = serialization.load_pem_private_key(Path(key_path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise AuthorityUnavailable(_("the device CA cannot be read: %(error)s") % {"error": exc}) from None
    if certificate.public_key().public_bytes(*_PUBLIC_DER) != key.public_key().public_bytes(*_PUBLIC_DER):
        raise AuthorityUnavailable(_("the device CA's key does not belong to its certificate"))
    return Authority(certificate, key)


_PUBLIC_DER = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def authority_create(common_name: str, *, days: int) -> Authority:
    """A new self-signed CA with an EC P-256 key (the dev stack's and the tests' device CA)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(key_cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Authority(certificate, key)


def key_new() -> ec.EllipticCurvePrivateKey:
    """A device's (or server's) new private key: EC P-256, small and taken by every TLS stack."""
    return ec.generate_private_key(ec.SECP256R1())


def key_pem(key) -> str:
    """The private key as unencrypted PKCS#8 PEM (what Mosquitto, paho and the AWS SDK read)."""
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()


def certificate_pem(certificate: x509.Certificate) -> str:
    return certificate.public_bytes(serialization.Encoding.PEM).decode()


def certificate_fingerprint(certificate: x509.Certificate) -> str:
    """SHA-256 of the certificate's DER, as `openssl x509 -fingerprint -sha256` prints it."""
    return certificate.fingerprint(hashes.SHA256()).hex(":").upper()


def certificate_serial(certificate: x509.Certificate) -> str:
    """The serial number in hex, as `openssl x509 -serial` prints it."""
    return format(certificate.serial_number, "X")


def csr_public_key(csr_pem: str, *, device_name: str):
    """The public key of a CSR that may be signed for `device_name`.

    How it fails: CsrRefused (translated message) when it is not one PEM CSR, its signature
    does not verify (the sender does not hold the key), its subject is not exactly
    CN=<device_name>, or its key is weak.
    """
    if len(csr_pem) > CSR_MAX_CHARS:
        raise CsrRefused(
            _("not a certificate signing request: longer than %(max)d characters") % {"max": CSR_MAX_CHARS}
        )
    try:
        csr = x509.load_pem_x509_csr(csr_pem.encode())
    except (ValueError, UnicodeEncodeError):
        raise CsrRefused(
            _("not a PEM certificate signing request (-----BEGIN CERTIFICATE REQUEST-----)")
        ) from None
    try:
        valid = csr.is_signature_valid
    except (InvalidSignature, ValueError):
        valid = False
    if not valid:
        raise CsrRefused(_("the request's signature does not verify"))
    names = csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if [attribute.value for attribute in names] != [device_name]:
        raise CsrRefused(
            _("the request's common name (CN) must be the device name %(name)r") % {"name": device_name}
        )
    weakness = key_weakness(csr.public_key())
    if weakness:
        raise CsrRefused(weakness)
    return csr.public_key()


def key_weakness(public_key) -> str | None:
    """Why a device's public key is too weak to certify (translated), or None."""
    if isinstance(public_key, rsa.RSAPublicKey):
        if public_key.key_size < RSA_MIN_BITS:
            return _("an RSA key needs at least %(bits)d bits, not %(size)d") % {
                "bits": RSA_MIN_BITS,
                "size": public_key.key_size,
            }
        return None
    if isinstance(public_key, ec.EllipticCurvePublicKey):
        if not isinstance(public_key.curve, EC_CURVES):
            return _("elliptic curve %(curve)s is not accepted; use P-256, P-384 or P-521") % {
                "curve": public_key.curve.name
            }
        return None
    if isinstance(public_key, ed25519.Ed25519PublicKey | ed448.Ed448PublicKey):
        return None
    return _("this kind of key is not accepted; use RSA (2048 bits or more) or EC P-256")


def certificate_sign(
    authority: Authority,
    *,
    common_name: str,
    public_key,
    days: int,
    server_names: tuple[str, ...] = (),
) -> x509.Certificate:
    """A leaf certificate for `public_key`, CN=`common_name`, signed by `authority`.

    A client certificate (TLS client auth) unless `server_names` are given: then a server
    certificate for those DNS names and IP addresses. It never outlives the CA.
    """
    now = datetime.datetime.now(datetime.UTC)
    not_after = min(now + datetime.timedelta(days=days), authority.certificate.not_valid_after_utc)
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server_names else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(authority.certificate.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(key_encipherment=isinstance(public_key, rsa.RSAPublicKey)), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(authority.key.public_key()), critical=False
        )
    )
    if server_names:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([_general_name(name) for name in server_names]), critical=False
        )
    return builder.sign(authority.key, _signing_hash(authority.key))


def _signing_hash(key):
    """Ed25519/Ed448 sign without a separate hash; RSA and EC with SHA-256."""
    return None if isinstance(key, ed25519.Ed25519PrivateKey | ed448.Ed448PrivateKey) else hashes.SHA256()


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _key_usage(*, key_cert_sign: bool = False, key_encipherment: bool = False) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=key_encipherment,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=key_cert_sign,
        crl_sign=key_cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def files_write(directory: Path, files: dict[str, str]) -> dict[str, Path]:
    """Write PEM texts into `directory` (keys mode 0600); returns each file's path by name."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, text in files.items():
        path = directory / name
        path.touch(mode=0o600)
        path.write_text(text)
        paths[name] = path
    return paths
