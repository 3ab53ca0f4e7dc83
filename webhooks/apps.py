"""The webhooks app: hooks the run lifecycle of jobs.events to the ways events leave."""

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class WebhooksConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "webhooks"
    verbose_name = _("Webhooks")

    def ready(self) -> None:
        from django.core import checks
        from django.db.models.signals import post_delete, post_save

        from iotqueue.metrics import gauge_register
        from jobs.events import lifecycle_events

        from . import addresses, metrics, outbox
        from .models import Webhook

        checks.register(addresses.allowed_networks_check, "webhooks")
        # /metrics counts the webhooks their failing deliveries disabled (webhooks/metrics.py).
        gauge_register(metrics.WEBHOOKS_DISABLED, metrics.webhooks_disabled_read)
        lifecycle_events.connect(outbox.lifecycle_events_received, dispatch_uid="webhooks.lifecycle_events")
        for signal in (post_save, post_delete):
            signal.connect(outbox.webhooks_changed, sender=Webhook, dispatch_uid=f"webhooks.changed.{signal}")
