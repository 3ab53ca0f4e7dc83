"""Bulk label edits: set and remove label keys on many devices at once."""

from __future__ import annotations

from django.db import transaction
from django.db.models import QuerySet
from django.dispatch import Signal

from .models import Device

# Sent (with device_ids=[...]) in the transaction of a bulk label edit, naming the devices
# whose labels changed: bulk_update sends no save signal, and the jobs app's continuous
# fan-outs look for devices that came to match them.
devices_labels_changed = Signal()


def device_labels_update(
    *, devices: QuerySet[Device], set_labels: dict[str, str], remove: list[str]
) -> list[str]:
    """Remove the `remove` keys and set `set_labels` on every device of `devices`, in one
    transaction; the names of the devices whose labels changed, sorted.

    The rows are locked while read and written, so a concurrent edit of one device is not
    lost. bulk_update sends no save signals: labels are no part of a device's broker
    identity (devices/credentials.py IDENTITY_FIELDS), so the broker is never called.
    """
    changed: list[Device] = []
    with transaction.atomic():
        for device in Device.objects.filter(pk__in=devices.values("pk")).select_for_update().order_by("pk"):
            labels = {key: value for key, value in device.labels.items() if key not in remove} | set_labels
            if labels != device.labels:
                device.labels = labels
                changed.append(device)
        Device.objects.bulk_update(changed, ["labels"])
        if changed:
            devices_labels_changed.send(sender=Device, device_ids=[device.pk for device in changed])
    return sorted(device.name for device in changed)
