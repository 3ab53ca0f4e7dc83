"""webhooks/signing.py: Standard Webhooks signatures, their freshness both ways, secrets in
the whsec_ form, and the deprecated headers (issue 31, finding 10: replay)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import time

import pytest
from standardwebhooks import Webhook as StandardWebhook
from standardwebhooks import WebhookVerificationError

from webhooks import signing

BODY = b'{"kind":"run.failed","run":"r1"}'
PLAIN = "a-test-secret-of-some-length"


def test_a_delivery_is_signed_as_standard_webhooks_and_the_reference_library_verifies_it():
    secret = signing.secret_generate()
    assert secret.startswith("whsec_") and len(signing.secret_key(secret)) == signing.SECRET_KEY_BYTES
    headers = signing.headers_sign(secret, delivery_id=42, body=BODY)
    assert headers["webhook-id"] == "msg_42" and headers["webhook-signature"].startswith("v1,")
    # the standardwebhooks package, as a receiver uses it, accepts it
    assert StandardWebhook(secret).verify(BODY, headers) == {"kind": "run.failed", "run": "r1"}
    assert signing.delivery_verify(secret, headers=headers, body=BODY)


def test_the_id_and_the_timestamp_are_signed_so_a_rewritten_one_does_not_verify():
    secret = signing.secret_generate()
    headers = signing.headers_sign(secret, delivery_id=42, body=BODY)
    rewritten_id = {**headers, "webhook-id": "msg_43"}
    with pytest.raises(WebhookVerificationError):
        StandardWebhook(secret).verify(BODY, rewritten_id)
    assert not signing.delivery_verify(secret, headers=rewritten_id, body=BODY)
    moved = {**headers, "webhook-timestamp": str(int(headers["webhook-timestamp"]) + 1)}
    assert not signing.delivery_verify(secret, headers=moved, body=BODY)
    assert not signing.delivery_verify(secret, headers=headers, body=BODY + b" ")
    assert not signing.delivery_verify(signing.secret_generate(), headers=headers, body=BODY)


@pytest.mark.parametrize("offset", [-301, 301, -3600, 3600])
def test_a_stale_or_future_timestamp_is_refused(offset):
    secret = signing.secret_generate()
    now = time.time()
    headers = signing.headers_sign(secret, delivery_id=1, body=BODY, now=now + offset)
    assert not signing.delivery_verify(secret, headers=headers, body=BODY, now=now)
    with pytest.raises(WebhookVerificationError, match=r"too (old|new)"):
        StandardWebhook(secret).verify(BODY, headers)


def test_a_timestamp_within_the_tolerance_either_way_is_accepted():
    secret, now = signing.secret_generate(), time.time()
    for offset in (-290, 290):
        headers = signing.headers_sign(secret, delivery_id=1, body=BODY, now=now + offset)
        assert signing.delivery_verify(secret, headers=headers, body=BODY, now=now)


def test_a_text_secret_becomes_whsec_with_the_same_key_and_the_deprecated_header_still_verifies():
    secret = signing.secret_normalize(PLAIN)
    assert secret == "whsec_" + base64.b64encode(PLAIN.encode()).decode()
    assert signing.secret_key(secret) == PLAIN.encode()
    headers = signing.headers_sign(secret, delivery_id=7, body=BODY)
    # what a receiver written for the old header computes, with the text it was given
    timestamp = headers["X-Iotqueue-Timestamp"]
    old = "sha256=" + hmac.new(PLAIN.encode(), timestamp.encode() + b"." + BODY, hashlib.sha256).hexdigest()
    assert headers["X-Iotqueue-Signature"] == old and timestamp == headers["webhook-timestamp"]
    # a whsec_ secret given is kept as it is
    generated = signing.secret_generate()
    assert signing.secret_normalize(generated) == generated


@pytest.mark.parametrize("value", ["short", "whsec_c2hvcnQ=", "x" * 15])
def test_a_secret_with_a_key_under_16_bytes_is_refused(value):
    with pytest.raises(signing.SecretInvalid):
        signing.secret_normalize(value)
