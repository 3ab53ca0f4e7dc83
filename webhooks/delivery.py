"""One attempt of a webhook delivery: a signed POST, its outcome, the retry or the give-up.

Attempts are numbered; a task names the attempt it makes and a row that is no longer at
that attempt (a redelivered task) is left alone, so an attempt is made at most once unless
a worker dies during the POST (receivers deduplicate on X-Iotqueue-Delivery). After
IOTQUEUE_WEBHOOK_DISABLE_AFTER deliveries in a row fail for good the webhook is disabled
and a `webhook.disabled` event (without a run) goes on the timeline.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from django.conf import settings
from django.db import transaction
from django.db.models import F

from jobs.events import event_record

from . import signing
from .models import Delivery, DeliveryState, Webhook

log = logging.getLogger(__name__)

# What is kept of an error message and read of a response body (the body is not used).
ERROR_MAX_CHARS = 500
RESPONSE_READ_BYTES = 4096


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is an answer, not a new address: the webhook's URL is the one configured."""

    def redirect_request(self, *args, **kwargs):
        return None


_opener = urllib.request.build_opener(_NoRedirect)


@dataclass(frozen=True)
class Answer:
    status_code: int | None
    latency_ms: int
    error: str

    @property
    def ok(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300


def backoff_seconds(attempt: int) -> float:
    """Wait after failed attempt `attempt` (1-based): doubling, capped."""
    base = settings.IOTQUEUE_WEBHOOK_BACKOFF_SECONDS * 2 ** (attempt - 1)
    return min(base, settings.IOTQUEUE_WEBHOOK_BACKOFF_MAX_SECONDS)


def request_body(payload: dict) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()


def webhook_post(webhook: Webhook, delivery: Delivery) -> Answer:
    """POST the delivery's payload, signed now; never raises for the receiver's failures."""
    if not webhook.url.lower().startswith(("http://", "https://")):
        # Refused at save; checked again since urllib would also open file: and ftp: URLs.
        return Answer(None, 0, "not an http(s) URL")
    body = request_body(delivery.payload)
    timestamp = str(int(time.time()))
    request = urllib.request.Request(
        webhook.url,
        data=body,
        method="POST",
        headers={
            "Content-Type": "application/json",
            "User-Agent": "iotqueue-webhooks",
            signing.EVENT_HEADER: delivery.kind,
            signing.DELIVERY_HEADER: str(delivery.pk),
            signing.TIMESTAMP_HEADER: timestamp,
            signing.SIGNATURE_HEADER: signing.signature(webhook.secret, timestamp, body),
        },
    )
    started = time.monotonic()
    status, error = None, ""
    try:
        with _opener.open(request, timeout=settings.IOTQUEUE_WEBHOOK_TIMEOUT_SECONDS) as response:
            status = response.status
            response.read(RESPONSE_READ_BYTES)
    except urllib.error.HTTPError as exc:
        status, error = exc.code, f"HTTP {exc.code} {exc.reason}"
    except (OSError, ValueError) as exc:  # URLError, timeouts, refused connections
        error = f"{type(exc).__name__}: {exc}"
    latency_ms = int((time.monotonic() - started) * 1000)
    if status is not None and not 200 <= status < 300 and not error:
        error = f"HTTP {status}"
    return Answer(status, latency_ms, error[:ERROR_MAX_CHARS])


def delivery_attempt(*, delivery_id: int, attempt: int) -> float | None:
    """Make attempt `attempt` of a delivery. Returns the seconds to wait before the next
    attempt, or None when the delivery is over (delivered, failed for good, or not at this
    attempt any more)."""
    delivery = Delivery.objects.select_related("webhook").filter(pk=delivery_id).first()
    if delivery is None or delivery.state != DeliveryState.PENDING or delivery.attempts != attempt - 1:
        return None
    webhook = delivery.webhook
    current = Delivery.objects.filter(pk=delivery_id, state=DeliveryState.PENDING, attempts=attempt - 1)
    if not webhook.enabled:
        current.update(state=DeliveryState.FAILED, last_error="webhook disabled")
        return None
    answer = webhook_post(webhook, delivery)
    last = attempt >= settings.IOTQUEUE_WEBHOOK_MAX_ATTEMPTS
    state = DeliveryState.DELIVERED if answer.ok else DeliveryState.FAILED if last else DeliveryState.PENDING
    with transaction.atomic():
        if not current.update(
            state=state,
            attempts=attempt,
            status_code=answer.status_code,
            latency_ms=answer.latency_ms,
            last_error=answer.error,
        ):
            return None
        if answer.ok:
            Webhook.objects.filter(pk=webhook.pk, consecutive_failures__gt=0).update(consecutive_failures=0)
        elif last:
            webhook_failure(webhook=webhook, error=answer.error)
    if state != DeliveryState.PENDING:
        return None
    log.info(
        "webhook %s: delivery %s attempt %s failed: %s", webhook.name, delivery_id, attempt, answer.error
    )
    return backoff_seconds(attempt)


def webhook_failure(*, webhook: Webhook, error: str) -> None:
    """A delivery failed for good: count it, and disable the webhook at the limit."""
    Webhook.objects.filter(pk=webhook.pk).update(consecutive_failures=F("consecutive_failures") + 1)
    failures = Webhook.objects.values_list("consecutive_failures", flat=True).get(pk=webhook.pk)
    limit = settings.IOTQUEUE_WEBHOOK_DISABLE_AFTER
    if failures < limit:
        return
    reason = f"{failures} deliveries in a row failed; last: {error}"[
        : Webhook._meta.get_field("disabled_reason").max_length
    ]
    if Webhook.objects.filter(pk=webhook.pk, enabled=True).update(enabled=False, disabled_reason=reason):
        log.warning("webhook %s disabled: %s", webhook.name, reason)
        event_record("webhook.disabled", message=f"webhook {webhook.name}: {reason}", webhook=webhook.name)
