"""Presence: a device's retained status / last will and its heartbeats update the Device row."""

from __future__ import annotations

import logging
from datetime import timedelta

from django.dispatch import Signal
from django.utils import timezone

from iotqueue.bridge import message_again
from iotqueue.budget import MessageBudget, message_drop_note

from . import protocol
from .models import Device

log = logging.getLogger(__name__)

# Heartbeats only refresh last_seen; writing the row on every beat of 10,000 devices
# would be wasted I/O, so a row is written at most once per this interval.
LAST_SEEN_WRITE_INTERVAL = timedelta(seconds=15)
# Status and heartbeat messages a device may send before the bridge stops touching the
# database for them: each costs an UPDATE on the bridge's network thread (and a status
# change a Celery task), so a device repeating them must not slow the bridge down for
# everyone. Real firmware sends a status per connection and a heartbeat every few seconds.
PRESENCE_MESSAGES_PER_SECOND = 1.0
PRESENCE_BURST = 10
presence_budget = MessageBudget(rate=PRESENCE_MESSAGES_PER_SECOND, burst=PRESENCE_BURST)


# Sent (with name= and online=) when a device's presence actually changes; the jobs app
# resumes or fails that device's steps. Sent from the bridge process.
device_presence_changed = Signal()


def device_presence_set(*, name: str, online: bool) -> bool:
    """Record the device online/offline; True when that changed its state."""
    now = timezone.now()
    changed = (
        Device.objects.filter(name=name)
        .exclude(online=online)
        .update(online=online, last_seen=now, presence_since=now)
    )
    if changed:
        log.info("device %s is %s", name, "online" if online else "offline")
        device_presence_changed.send(sender=Device, name=name, online=online)
    return bool(changed)


def device_seen(*, name: str) -> None:
    """A heartbeat: refresh last_seen (throttled); an offline device is back online."""
    if device_presence_set(name=name, online=True):
        return
    now = timezone.now()
    Device.objects.filter(name=name).exclude(last_seen__gt=now - LAST_SEEN_WRITE_INTERVAL).update(
        last_seen=now
    )


def presence_message_handle(topic: str, payload: bytes) -> None:
    """Bridge handler for P/<device>/status and P/<device>/heartbeat."""
    parsed = protocol.topic_parse(topic)
    if parsed is None:
        return
    name, kind = parsed
    # Held through an outage and given again (iotqueue/redelivery.py): charged the first time.
    if (payload or kind == "heartbeat") and not message_again() and not presence_budget.admit(name):
        why = f"{kind} over {PRESENCE_MESSAGES_PER_SECOND:g} a second; not applied"
        message_drop_note(device=name, reason=why, message=why, topic=topic, size=len(payload))
        return
    if kind == "heartbeat":
        device_seen(name=name)
        return
    if not payload:
        return  # a retained status being cleared
    try:
        online = protocol.status_parse(payload)
    except protocol.ProtocolError as exc:
        # Not logged per message (a flood would flood the log): summarized by the bridge.
        why = f"status: {exc}"
        message_drop_note(device=name, reason=why[:80], message=why, topic=topic, size=len(payload))
        return
    device_presence_set(name=name, online=online)
