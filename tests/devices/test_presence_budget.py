"""A device repeating status or heartbeat messages cannot make the bridge write the database
for each: past its presence budget they are dropped and noted, not applied (devices/presence.py).
What is admitted joins a presence group; here a batcher of the test's own holds the group
until the test flushes it on its own thread (`drain`), inside the test's transaction."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from devices import presence
from devices.models import Device
from iotqueue import budget
from iotqueue.batching import Batcher

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(
        presence, "presence_budget", budget.MessageBudget(rate=1, burst=presence.PRESENCE_BURST)
    )
    tally = budget.DropTally()
    monkeypatch.setattr(budget, "drop_tally", tally)
    return tally


@pytest.fixture
def group(monkeypatch) -> Batcher:
    """The presence batcher, replaced by one that never flushes by itself."""
    flush = presence.presence_flush
    held = Batcher(flush, max_items=10_000, idle_seconds=3600, max_wait_seconds=3600, name="test")
    monkeypatch.setattr(presence, "presence_batcher", held)
    return held


def test_a_heartbeat_flood_stops_touching_the_database_after_the_burst(settings, fresh, group):
    Device.objects.create(name="chatty", online=True)
    topic = f"{settings.IOTQUEUE_TOPIC_PREFIX}/chatty/heartbeat"

    with CaptureQueriesContext(connection) as handled:
        for _ in range(500):
            presence.presence_message_handle(topic, b"")
    with CaptureQueriesContext(connection) as flushed:
        group.drain()

    # the handler touches no row; its group (the admitted heartbeats) costs two statements at most
    assert len(handled) == 0
    assert len([q for q in flushed if not q["sql"].startswith(("SAVEPOINT", "RELEASE"))]) <= 2
    [summary] = fresh.summaries_take()
    assert summary.device == "chatty" and summary.count == 500 - presence.PRESENCE_BURST


def test_another_devices_status_is_still_applied(settings, group):
    Device.objects.create(name="chatty", online=True)
    Device.objects.create(name="quiet", online=True)
    prefix = settings.IOTQUEUE_TOPIC_PREFIX
    for _ in range(100):
        presence.presence_message_handle(f"{prefix}/chatty/status", b"online")

    presence.presence_message_handle(f"{prefix}/quiet/status", b"offline")
    group.drain()

    assert Device.objects.get(name="quiet").online is False
