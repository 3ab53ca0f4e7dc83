"""A device repeating status or heartbeat messages cannot make the bridge write the database
for each: past its presence budget they are dropped and noted, not applied (devices/presence.py)."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from devices import presence
from devices.models import Device
from iotqueue import budget

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(
        presence, "presence_budget", budget.MessageBudget(rate=1, burst=presence.PRESENCE_BURST)
    )
    tally = budget.DropTally()
    monkeypatch.setattr(budget, "drop_tally", tally)
    return tally


def test_a_heartbeat_flood_stops_touching_the_database_after_the_burst(settings, fresh):
    Device.objects.create(name="chatty", online=True)
    topic = f"{settings.IOTQUEUE_TOPIC_PREFIX}/chatty/heartbeat"

    with CaptureQueriesContext(connection) as queries:
        for _ in range(500):
            presence.presence_message_handle(topic, b"")

    # at most two statements per admitted heartbeat, none for the rest
    assert len(queries) <= 2 * presence.PRESENCE_BURST
    [summary] = fresh.summaries_take()
    assert summary.device == "chatty" and summary.count == 500 - presence.PRESENCE_BURST


def test_another_devices_status_is_still_applied(settings):
    Device.objects.create(name="chatty", online=True)
    Device.objects.create(name="quiet", online=True)
    prefix = settings.IOTQUEUE_TOPIC_PREFIX
    for _ in range(100):
        presence.presence_message_handle(f"{prefix}/chatty/status", b"online")

    presence.presence_message_handle(f"{prefix}/quiet/status", b"offline")

    assert Device.objects.get(name="quiet").online is False
