"""The signature of a webhook delivery, per Standard Webhooks, and the deprecated one.

Standard Webhooks (https://www.standardwebhooks.com/), signed with the `standardwebhooks`
package:

    webhook-id:        msg_<delivery id>   (the same on every attempt: deduplicate on it)
    webhook-timestamp: <Unix seconds when this attempt was signed>
    webhook-signature: v1,<base64 of HMAC-SHA256(key, "<id>.<timestamp>.<raw body>")>

The key is the secret's bytes: a secret is stored as `whsec_<base64 of the key>`, the form
the package (and every Standard Webhooks library) takes. The id and the timestamp are inside
the signed string, so a receiver that refuses a timestamp further than TOLERANCE_SECONDS
from its clock (either way) and remembers the ids it saw for that long accepts each
delivery once: neither a recorded delivery nor one with a rewritten id gets in again.

Deprecated, still sent for one release (removed in the next), so receivers can move over:

    X-Iotqueue-Timestamp: <the same timestamp>
    X-Iotqueue-Signature: sha256=<hex of HMAC-SHA256(key, "<timestamp>.<raw body>")>

A secret that was set before secrets took the whsec_ form was converted to it keeping its
key (the old secret's UTF-8 bytes): a receiver checking the old header keeps working, and
`whsec_` + base64 of its old secret is its Standard Webhooks secret.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
import time
from collections.abc import Mapping
from datetime import UTC, datetime

from standardwebhooks import Webhook as StandardWebhook

ID_HEADER = "webhook-id"
STANDARD_TIMESTAMP_HEADER = "webhook-timestamp"
STANDARD_SIGNATURE_HEADER = "webhook-signature"
# Deprecated (one more release): the old headers, sent beside the standard ones.
SIGNATURE_HEADER = "X-Iotqueue-Signature"
TIMESTAMP_HEADER = "X-Iotqueue-Timestamp"
EVENT_HEADER = "X-Iotqueue-Event"
DELIVERY_HEADER = "X-Iotqueue-Delivery"
# How far a delivery's timestamp may be from the receiver's clock, into the past or the
# future (the standardwebhooks package's fixed five minutes): a retry is signed anew, so
# only clock skew and transit need to fit in.
TOLERANCE_SECONDS = 300
SECRET_PREFIX = "whsec_"
# Bytes of a generated key; Standard Webhooks asks for 24 to 64.
SECRET_KEY_BYTES = 32
# A key shorter than this is guessable enough to forge signatures offline.
SECRET_MIN_BYTES = 16


class SecretInvalid(ValueError):
    """A secret that is neither `whsec_<base64>` of a long enough key nor long enough text."""


def secret_generate() -> str:
    """A new secret: `whsec_` + base64 of SECRET_KEY_BYTES random bytes."""
    return secret_from_key(secrets.token_bytes(SECRET_KEY_BYTES))


def secret_from_key(key: bytes) -> str:
    return SECRET_PREFIX + base64.b64encode(key).decode()


def _whsec_key(secret: str) -> bytes | None:
    if not secret.startswith(SECRET_PREFIX):
        return None
    try:
        return base64.b64decode(secret[len(SECRET_PREFIX) :], validate=True) or None
    except (binascii.Error, ValueError):
        return None


def secret_key(secret: str) -> bytes:
    """The HMAC key of a secret: the bytes of `whsec_<base64>`, or, for a secret stored as
    plain text (written to the database directly, as the dev stack's demo does), its UTF-8
    bytes, as before secrets took the whsec_ form. Raises SecretInvalid for an empty one."""
    key = _whsec_key(secret)
    if key is None:
        key = secret.encode()
    if not key:
        raise SecretInvalid("the secret is empty")
    return key


def secret_normalize(value: str) -> str:
    """The stored form of a secret a user gives: a valid `whsec_<base64>` as it is, any
    other text as `whsec_` + base64 of its UTF-8 bytes (so the old header's key is that
    text, as before). Raises SecretInvalid when the key is shorter than SECRET_MIN_BYTES."""
    key = secret_key(value) if value else b""
    if len(key) < SECRET_MIN_BYTES:
        raise SecretInvalid(f"the key is shorter than {SECRET_MIN_BYTES} bytes")
    return secret_from_key(key)


def message_id(delivery_id: int) -> str:
    """The webhook-id of a delivery: the same on every attempt."""
    return f"msg_{delivery_id}"


def headers_sign(secret: str, *, delivery_id: int, body: bytes, now: float | None = None) -> dict[str, str]:
    """The signature headers of one attempt, standard and deprecated, signed at `now`.

    How it fails: SecretInvalid when the webhook has no secret."""
    key = secret_key(secret)
    signed_at = int(time.time() if now is None else now)
    msg_id = message_id(delivery_id)
    standard = StandardWebhook(key).sign(
        msg_id=msg_id, timestamp=datetime.fromtimestamp(signed_at, tz=UTC), data=body.decode()
    )
    return {
        ID_HEADER: msg_id,
        STANDARD_TIMESTAMP_HEADER: str(signed_at),
        STANDARD_SIGNATURE_HEADER: standard,
        TIMESTAMP_HEADER: str(signed_at),
        SIGNATURE_HEADER: signature_legacy(key, str(signed_at), body),
    }


def signature_legacy(key: bytes, timestamp: str, body: bytes) -> str:
    """The deprecated X-Iotqueue-Signature value for `body` sent at `timestamp`."""
    return "sha256=" + hmac.new(key, timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()


def delivery_verify(
    secret: str, *, headers: Mapping[str, str], body: bytes, now: float | None = None
) -> bool:
    """Whether a received delivery is genuine and fresh, by its standard headers (what a
    receiver does; docs/orchestration.md has one that also drops repeated ids). A timestamp
    more than TOLERANCE_SECONDS before or after `now` is refused."""
    lowered = {name.lower(): value for name, value in headers.items()}
    msg_id, timestamp = lowered.get(ID_HEADER), lowered.get(STANDARD_TIMESTAMP_HEADER, "")
    signatures = lowered.get(STANDARD_SIGNATURE_HEADER, "")
    if not msg_id or not timestamp.isdigit() or not signatures:
        return False
    if abs((time.time() if now is None else now) - int(timestamp)) > TOLERANCE_SECONDS:
        return False
    try:
        expected = StandardWebhook(secret_key(secret)).sign(
            msg_id=msg_id, timestamp=datetime.fromtimestamp(int(timestamp), tz=UTC), data=body.decode()
        )
    except (SecretInvalid, UnicodeDecodeError):
        return False
    return any(hmac.compare_digest(expected, given) for given in signatures.split(" "))
