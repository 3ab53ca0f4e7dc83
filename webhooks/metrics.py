"""The gauge the webhooks app reports on /metrics (docs/operations.md, "Metrics and logs").

Registered with its reader when the app loads (webhooks/apps.py).
"""

from __future__ import annotations

from iotqueue.metrics import GAUGE, Family

from .models import Webhook

WEBHOOKS_DISABLED = Family(
    "iotqueue_webhooks_disabled",
    "Webhooks disabled after IOTQUEUE_WEBHOOK_DISABLE_AFTER failed deliveries (disabled_reason set); "
    "webhooks an admin switched off are not counted.",
    GAUGE,
)


def webhooks_disabled_read() -> dict[tuple[str, ...], int]:
    """Webhooks the delivery disabled (webhooks/delivery.py), read at each scrape: the table is small."""
    return {(): Webhook.objects.filter(enabled=False).exclude(disabled_reason="").count()}
