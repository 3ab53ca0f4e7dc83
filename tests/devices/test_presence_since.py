"""A device's presence_since says since when it is online or offline: written when its
presence changes, never moved by heartbeats (devices/presence.py); the device list and the
waiting reasons read it."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from devices import presence
from devices.models import Device

pytestmark = pytest.mark.django_db


def test_going_online_sets_presence_since_and_a_heartbeat_does_not_move_it():
    # given a device that came online an hour ago and was last seen then
    an_hour_ago = timezone.now() - timedelta(hours=1)
    Device.objects.create(name="pump-1", online=True, last_seen=an_hour_ago, presence_since=an_hour_ago)

    # when it sends a heartbeat
    presence.device_seen(name="pump-1")

    # then last_seen moves, presence_since stays
    device = Device.objects.get(name="pump-1")
    assert device.last_seen > an_hour_ago
    assert device.presence_since == an_hour_ago


def test_a_presence_change_writes_presence_since():
    # given a device that has never reported
    Device.objects.create(name="pump-2")
    before = timezone.now()

    # when it comes online, then goes offline
    presence.device_presence_set(name="pump-2", online=True)
    online_since = Device.objects.get(name="pump-2").presence_since
    presence.device_presence_set(name="pump-2", online=False)

    # then each change is stamped
    device = Device.objects.get(name="pump-2")
    assert online_since is not None and online_since >= before
    assert not device.online and device.presence_since >= online_since


def test_a_repeated_status_does_not_move_presence_since():
    # given a device online since an hour ago
    an_hour_ago = timezone.now() - timedelta(hours=1)
    Device.objects.create(name="pump-3", online=True, last_seen=an_hour_ago, presence_since=an_hour_ago)

    # when it repeats its online status (a reconnect with the same retained status)
    changed = presence.device_presence_set(name="pump-3", online=True)

    # then nothing changed
    assert changed is False
    assert Device.objects.get(name="pump-3").presence_since == an_hour_ago
