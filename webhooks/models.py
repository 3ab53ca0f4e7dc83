"""Webhooks (where run events are POSTed, signed) and their delivery log."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.core.validators import URLValidator
from django.db import models
from django.utils.text import format_lazy
from django.utils.translation import gettext_lazy as _

from jobs.models import JobTemplate

from . import signing

# The kinds a webhook may subscribe to: jobs.events.LIFECYCLE_KINDS, with their labels.
EVENT_KINDS = {
    "run.started": _("Run started"),
    "run.succeeded": _("Run succeeded"),
    "run.failed": _("Run failed"),
    "run.timed_out": _("Run timed out"),
    "run.canceled": _("Run canceled"),
    "run.compensated": _("Run compensated (rolled back)"),
    "step.failed": _("Step failed"),
    "step.rejected": _("Step rejected by its device"),
    "step.timed_out": _("Step timed out"),
    "step.aborted": _("Fan-out aborted"),
}
EventKind = models.TextChoices("EventKind", [(kind, (kind, label)) for kind, label in EVENT_KINDS.items()])
# A receiver's address; http(s) only (no file:, ftp: or the like through urllib).
http_url_validator = URLValidator(schemes=["http", "https"], message=_("Enter an http:// or https:// URL."))


def secret_generate() -> str:
    """A new webhook secret: `whsec_` + base64 of 32 random bytes (webhooks/signing.py)."""
    return signing.secret_generate()


def events_validate(value: object) -> None:
    if not isinstance(value, list) or not value:
        raise ValidationError(_("Give a non-empty list of event kinds."))
    unknown = [kind for kind in value if kind not in EVENT_KINDS]
    if unknown:
        raise ValidationError(
            _("Unknown event kinds %(unknown)r; choose from %(kinds)s.")
            % {"unknown": unknown, "kinds": ", ".join(EVENT_KINDS)}
        )
    if len(set(value)) != len(value):
        raise ValidationError(_("An event kind is listed twice."))


class Webhook(models.Model):
    """A receiver of run events: each matching event is POSTed to `url`, signed with `secret`.

    `consecutive_failures` counts deliveries that failed for good since the last success;
    at IOTQUEUE_WEBHOOK_DISABLE_AFTER the webhook is disabled (`disabled_reason` says why).
    """

    name = models.CharField(_("name"), max_length=128, unique=True)
    url = models.URLField(_("url"), max_length=2000, validators=[http_url_validator])
    events = models.JSONField(
        _("events"),
        default=list,
        validators=[events_validate],
        help_text=format_lazy(_("event kinds: {kinds}"), kinds=", ".join(EVENT_KINDS)),
    )
    template = models.ForeignKey(
        JobTemplate,
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        related_name="webhooks",
        help_text=_("only runs of this template (empty: every run)"),
        verbose_name=_("template"),
    )
    # Write-only: never shown back (admin and API say "set" and rotate it, showing the new
    # one once); stored as whsec_<base64 of the key> (webhooks/signing.py).
    secret = models.CharField(
        _("secret"),
        max_length=300,
        default=secret_generate,
        help_text=_("whsec_<base64>: the HMAC-SHA256 key of the signatures"),
    )
    enabled = models.BooleanField(_("enabled"), default=True)
    consecutive_failures = models.PositiveIntegerField(_("consecutive failures"), default=0, editable=False)
    disabled_reason = models.CharField(_("disabled reason"), max_length=300, blank=True)
    created_at = models.DateTimeField(_("created at"), auto_now_add=True)
    updated_at = models.DateTimeField(_("updated at"), auto_now=True)

    class Meta:
        verbose_name = _("webhook")
        verbose_name_plural = _("webhooks")
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
    PENDING = "pending", _("Pending")
    DELIVERED = "delivered", _("Delivered")
    FAILED = "failed", _("Failed")


class Delivery(models.Model):
    """One event sent to one webhook: its payload and how each attempt went."""

    webhook = models.ForeignKey(
        Webhook, on_delete=models.CASCADE, related_name="deliveries", verbose_name=_("webhook")
    )
    kind = models.CharField(_("kind"), max_length=48, choices=EventKind.choices)
    # Not a foreign key: a delivery log outlives the runs retention prunes.
    run_id = models.UUIDField(_("run id"), null=True, blank=True, db_index=True)
    payload = models.JSONField(
        _("payload"),
    )
    state = models.CharField(
        _("state"), max_length=16, choices=DeliveryState.choices, default=DeliveryState.PENDING
    )
    attempts = models.PositiveSmallIntegerField(_("attempts"), default=0)
    status_code = models.PositiveSmallIntegerField(
        _("status code"), null=True, blank=True, help_text=_("of the last attempt")
    )
    latency_ms = models.PositiveIntegerField(
        _("latency ms"), null=True, blank=True, help_text=_("of the last attempt")
    )
    last_error = models.TextField(_("last error"), blank=True)
    created_at = models.DateTimeField(_("created at"), auto_now_add=True, db_index=True)
    updated_at = models.DateTimeField(_("updated at"), auto_now=True)

    class Meta:
        ordering = ["-id"]
        verbose_name = _("delivery")
        verbose_name_plural = _("deliveries")
        indexes = [models.Index(fields=["webhook", "-id"], name="delivery_webhook_id")]

    def __str__(self) -> str:
        return f"{self.kind} -> {self.webhook_id} ({self.state})"
