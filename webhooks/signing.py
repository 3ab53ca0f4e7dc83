"""The signature of a webhook delivery: HMAC-SHA256 over the timestamp and the body.

    signed string  = <X-Iotqueue-Timestamp> + "." + <raw request body>
    X-Iotqueue-Signature: sha256=<hex of HMAC-SHA256(secret as UTF-8, signed string)>

The timestamp (Unix seconds) is inside the signed string, so a receiver that refuses
timestamps older than a few minutes cannot be fed a recorded delivery again later
(docs/orchestration.md#run-events-out shows a receiver).
"""

from __future__ import annotations

import hashlib
import hmac
import time

SIGNATURE_HEADER = "X-Iotqueue-Signature"
TIMESTAMP_HEADER = "X-Iotqueue-Timestamp"
EVENT_HEADER = "X-Iotqueue-Event"
DELIVERY_HEADER = "X-Iotqueue-Delivery"
# How far a receiver should let a delivery's timestamp be from its own clock: a retry is
# signed anew, so only clock skew and transit need to fit in.
TOLERANCE_SECONDS = 300


def signature(secret: str, timestamp: str, body: bytes) -> str:
    """The value of the signature header for `body` sent at `timestamp`."""
    digest = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"sha256={digest}"


def signature_verify(
    secret: str, *, timestamp: str, signed: str, body: bytes, now: float | None = None
) -> bool:
    """Whether a received delivery is genuine and fresh (what a receiver does)."""
    try:
        age = abs((time.time() if now is None else now) - int(timestamp))
    except ValueError:
        return False
    return age <= TOLERANCE_SECONDS and hmac.compare_digest(signature(secret, timestamp, body), signed)
