"""One attempt of a webhook delivery: a signed POST, its outcome, the retry or the give-up.

Attempts are numbered; a task names the attempt it makes and a row that is no longer at
that attempt (a redelivered task) is left alone, so an attempt is made at most once unless
a worker dies during the POST (receivers deduplicate on webhook-id). Each attempt resolves
the URL's host, refuses it unless every address is allowed (webhooks/addresses.py) and
connects to the address it checked. After IOTQUEUE_WEBHOOK_DISABLE_AFTER deliveries in a
row fail for good the webhook is disabled and a `webhook.disabled` event (without a run)
goes on the timeline.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import ssl
import time
from dataclasses import dataclass

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils.translation import gettext as _

from jobs.events import event_record

from . import addresses, signing
from .models import Delivery, DeliveryState, Webhook

log = logging.getLogger(__name__)

# What is kept of an error message and read of a response body (the body is not used).
ERROR_MAX_CHARS = 500
RESPONSE_READ_BYTES = 4096


class _PinnedHTTPConnection(http.client.HTTPConnection):
    """An HTTP connection to the address that was checked, not to a second lookup of the
    host (which could answer differently: DNS rebinding). The Host header is the URL's."""

    def __init__(self, target: addresses.Target, timeout: float) -> None:
        super().__init__(target.host, target.port, timeout=timeout)
        self.target = target

    def connect(self) -> None:
        self.sock = socket.create_connection((self.target.address, self.port), self.timeout)


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    """HTTPS to the checked address; the certificate is verified for the URL's host name."""

    def __init__(self, target: addresses.Target, timeout: float) -> None:
        self.tls = ssl.create_default_context()
        super().__init__(target.host, target.port, timeout=timeout, context=self.tls)
        self.target = target

    def connect(self) -> None:
        sock = socket.create_connection((self.target.address, self.port), self.timeout)
        self.sock = self.tls.wrap_socket(sock, server_hostname=self.target.host)


@dataclass(frozen=True)
class Answer:
    status_code: int | None
    latency_ms: int
    error: str
    # No later attempt can do better (a refused address): the delivery fails now.
    final: bool = False

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
    """POST the delivery's payload, signed now, to the address its host resolves to now;
    never raises for the receiver's failures.

    How it fails: a host that is (or resolves to) a refused address, or does not resolve,
    is an error with no request made ("refused: ..."); an empty secret (set by hand in the
    database) is an error too; redirects are not followed (a 3xx is a failure).
    """
    try:
        target = addresses.target_resolve(webhook.url)
    except addresses.HostUnresolved as exc:
        return Answer(None, 0, (_("no request made: %(error)s") % {"error": exc})[:ERROR_MAX_CHARS])
    except addresses.AddressRefused as exc:
        error = _("refused, no request made: %(error)s") % {"error": exc}
        return Answer(None, 0, error[:ERROR_MAX_CHARS], final=True)
    body = request_body(delivery.payload)
    try:
        signed = signing.headers_sign(webhook.secret, delivery_id=delivery.pk, body=body)
    except signing.SecretInvalid as exc:
        error = _("no request made: the webhook's secret is unusable (%(error)s); rotate it") % {"error": exc}
        return Answer(None, 0, error[:ERROR_MAX_CHARS], final=True)
    headers = {
        "Content-Type": "application/json",
        "User-Agent": "iotqueue-webhooks",
        signing.EVENT_HEADER: delivery.kind,
        signing.DELIVERY_HEADER: str(delivery.pk),
        **signed,
    }
    connection_class = _PinnedHTTPSConnection if target.scheme == "https" else _PinnedHTTPConnection
    connection = connection_class(target, settings.IOTQUEUE_WEBHOOK_TIMEOUT_SECONDS)
    started = time.monotonic()
    status, error = None, ""
    try:
        connection.request("POST", target.path, body=body, headers=headers)
        response = connection.getresponse()
        status = response.status
        response.read(RESPONSE_READ_BYTES)
        if not 200 <= status < 300:
            error = f"HTTP {status} {response.reason}".strip()
    except (OSError, ValueError, http.client.HTTPException) as exc:  # timeouts, refused, TLS
        error = f"{type(exc).__name__}: {exc}"
    finally:
        connection.close()
    latency_ms = int((time.monotonic() - started) * 1000)
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
    last = answer.final or attempt >= settings.IOTQUEUE_WEBHOOK_MAX_ATTEMPTS
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
