"""The metric families the devices app reports on /metrics (docs/operations.md, "Metrics and logs").

Declared when the app loads (devices/apps.py registers the gauge with its reader).
"""

from __future__ import annotations

from iotqueue.metrics import GAUGE, Family

from .locks import device_queue_depths

DEVICE_QUEUE_DEPTH = Family(
    "iotqueue_device_queue_depth",
    "Holders waiting in a device's lock queue; only devices with someone waiting are listed.",
    GAUGE,
    ("device",),
)


def queue_depths_read() -> dict[tuple[str], int]:
    """The wait queue of every device that has one (devices/locks.py), read at each scrape."""
    return {(device,): depth for device, depth in device_queue_depths().items()}
