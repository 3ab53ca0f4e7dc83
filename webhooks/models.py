"""Webhooks (where run events are POSTed, signed) and their delivery log."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.core.validators import URLValidator
from django.db import models
from django.utils.translation import gettext_lazy as _

from jobs.models import JobTemplate

from . import signing

# The kinds a webhook may subscribe to: jobs.events.LIFECYCLE_KINDS, with their labels.
EVENT_KINDS = {
    "run.started": "Run started",
    "run.succeeded": "Run succeeded",
    "run.failed": "Run failed",
    "run.timed_out": "Run timed out",
    "run.canceled": "Run canceled",
    "run.compensated": "Run compensated (rolled back)",
    "step.failed": "Step failed",
    "step.rejected": "Step rejected by its device",
    "step.timed_out": "Step timed out",
    "step.aborted": "Fan-out aborted",
}
EventKind = models.TextChoices("EventKind", [(kind, (kind, label)) for kind, label in EVENT_KINDS.items()])
# A receiver's address; http(s) only (no file:, ftp: or the like through urllib).
http_url_validator = URLValidator(schemes=["http", "https"], message="Enter an http:// or https:// URL.")


def secret_generate() -> str:
    """A new webhook secret: `whsec_` + base64 of 32 random bytes (webhooks/signing.py)."""
    return signing.secret_generate()


def events_validate(value: object) -> None:
    if not isinstance(value, list) or not value:
        raise ValidationError("Give a non-empty list of event kinds.")
    unknown = [kind for kind in value if kind not in EVENT_KINDS]
    if unknown:
        raise ValidationError(f"Unknown event kinds {unknown!r}; choose from {', '.join(EVENT_KINDS)}.")
    if len(set(value)) != len(value):
        raise ValidationError("An event kind is listed twice.")


class Webhook(models.Model):
    """A receiver of run events: each matching event is POSTed to `url`, signed with `secret`.

    `consecutive_failures` counts deliveries that failed for good since the last success;
    at IOTQUEUE_WEBHOOK_DISABLE_AFTER the webhook is disabled (`disabled_reason` says why).
    """

    name = models.CharField(max_length=128, unique=True)
    url = models.URLField(max_length=2000, validators=[http_url_validator])
    events = models.JSONField(
        default=list, validators=[events_validate], help_text=f"event kinds: {', '.join(EVENT_KINDS)}"
    )
    template = models.ForeignKey(
        JobTemplate,
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        related_name="webhooks",
        help_text="only runs of this template (empty: every run)",
    )
    # Write-only: never shown back (admin and API say "set" and rotate it, showing the new
    # one once); stored as whsec_<base64 of the key> (webhooks/signing.py).
    secret = models.CharField(
        max_length=300,
        default=secret_generate,
        help_text=_("whsec_<base64>: the HMAC-SHA256 key of the signatures"),
    )
    enabled = models.BooleanField(default=True)
    consecutive_failures = models.PositiveIntegerField(default=0, editable=False)
    disabled_reason = models.CharField(max_length=300, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def save(self, *args, **kwargs) -> None:
        # Saved enabled (a re-enable, a fixed URL): failures start counting afresh.
        if self.enabled:
            self.consecutive_failures, self.disabled_reason = 0, ""
        super().save(*args, **kwargs)

    @property
    def secret_is_set(self) -> bool:
        return bool(self.secret)


class DeliveryState(models.TextChoices):
    PENDING = "pending"
    DELIVERED = "delivered"
    FAILED = "failed"


class Delivery(models.Model):
    """One event sent to one webhook: its payload and how each attempt went."""

    webhook = models.ForeignKey(Webhook, on_delete=models.CASCADE, related_name="deliveries")
    kind = models.CharField(max_length=48, choices=EventKind.choices)
    # Not a foreign key: a delivery log outlives the runs retention prunes.
    run_id = models.UUIDField(null=True, blank=True, db_index=True)
    payload = models.JSONField()
    state = models.CharField(max_length=16, choices=DeliveryState.choices, default=DeliveryState.PENDING)
    attempts = models.PositiveSmallIntegerField(default=0)
    status_code = models.PositiveSmallIntegerField(null=True, blank=True, help_text="of the last attempt")
    latency_ms = models.PositiveIntegerField(null=True, blank=True, help_text="of the last attempt")
    last_error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-id"]
        verbose_name_plural = "deliveries"
        indexes = [models.Index(fields=["webhook", "-id"], name="delivery_webhook_id")]

    def __str__(self) -> str:
        return f"{self.kind} -> {self.webhook_id} ({self.state})"
