"""Presence in groups (devices/presence.py): the statuses and heartbeats of many devices are
recorded in a few set-based statements, each device's last word wins, the jobs app hears of
exactly the devices whose state changed, and the bridge's presence writes wait for no reply
and hold up none."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta

import psycopg
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from devices import presence
from devices.models import Device
from devices.presence import HEARTBEAT, OFFLINE, ONLINE
from devtools import pg_restart
from devtools.simulator import DeviceBehaviour, Simulator
from iotqueue.batching import Batcher
from iotqueue.redelivery import OUTAGE_ERRORS
from jobs.models import RunStatus
from jobs.services import run_start
from tests.conftest import database_url, wait_for
from tests.factories import DeviceFactory, template_with_steps

only_postgresql = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="needs a row lock and a database server to restart"
)


def online(name: str) -> bool:
    return Device.objects.get(name=name).online


@pytest.fixture
def heard():
    """The changes the jobs app is told of, one list per `devices_presence_changed`."""
    signals: list[list[tuple[str, bool]]] = []

    def receiver(sender, *, changes, **kwargs):
        signals.append(list(changes))

    presence.devices_presence_changed.connect(receiver, dispatch_uid="test.presence.heard")
    yield signals
    presence.devices_presence_changed.disconnect(dispatch_uid="test.presence.heard")


# --- one group, recorded directly -------------------------------------------------------------


@pytest.mark.django_db
def test_a_group_of_many_devices_costs_a_few_statements_and_reports_only_the_changes(heard):
    # given 200 offline devices and 100 online ones
    coming = [DeviceFactory(online=False).name for _ in range(200)]
    staying = [DeviceFactory(online=True).name for _ in range(50)]
    leaving = [DeviceFactory(online=True).name for _ in range(50)]
    items = [(name, ONLINE) for name in coming + staying] + [(name, OFFLINE) for name in leaving]

    # when one group of their statuses is flushed
    with CaptureQueriesContext(connection) as queries:
        presence.presence_flush(items)

    # then each ends as its status says, in one read and one write per direction
    assert set(Device.objects.filter(online=True).values_list("name", flat=True)) >= set(coming + staying)
    assert not Device.objects.filter(name__in=leaving, online=True).exists()
    writes = [q["sql"] for q in queries if not q["sql"].upper().startswith(("SAVEPOINT", "RELEASE"))]
    assert len(writes) == 3, writes
    # and the jobs app hears once, of exactly the devices that changed, in arrival order
    assert heard == [[(name, True) for name in coming] + [(name, False) for name in leaving]]


@pytest.mark.django_db
def test_an_offline_right_after_an_online_ends_offline(heard):
    # given an offline device and an online one
    flicker, bouncing = DeviceFactory(online=False).name, DeviceFactory(online=True).name

    # when one group says each came online and went offline, in that order
    presence.presence_flush([(flicker, ONLINE), (bouncing, OFFLINE), (flicker, OFFLINE), (bouncing, ONLINE)])

    # then each device's last word counts: nothing changed, nobody is told
    assert not online(flicker) and online(bouncing)
    assert heard == []

    # and over two groups the later one wins too
    presence.presence_flush([(flicker, ONLINE)])
    presence.presence_flush([(flicker, OFFLINE)])
    assert not online(flicker)
    assert heard == [[(flicker, True)], [(flicker, False)]]


@pytest.mark.django_db
def test_heartbeats_bring_a_device_back_and_refresh_last_seen_at_most_every_interval(heard):
    # given a device seen just now, one last seen long ago and one offline
    long_ago = timezone.now() - presence.LAST_SEEN_WRITE_INTERVAL - timedelta(seconds=1)
    fresh = DeviceFactory(online=True, last_seen=timezone.now()).name
    stale = DeviceFactory(online=True, last_seen=long_ago, presence_since=long_ago).name
    away = DeviceFactory(online=False).name
    fresh_seen = Device.objects.get(name=fresh).last_seen

    # when they all beat in one group
    presence.presence_flush([(fresh, HEARTBEAT), (stale, HEARTBEAT), (away, HEARTBEAT)])

    # then the offline one is back, the stale one's last_seen moves, the fresh one is not written
    assert online(away) and heard == [[(away, True)]]
    stale_row = Device.objects.get(name=stale)
    assert stale_row.last_seen > long_ago and stale_row.presence_since == long_ago
    assert Device.objects.get(name=fresh).last_seen == fresh_seen


@pytest.mark.django_db
def test_a_name_the_database_refuses_leaves_the_others_of_its_group_recorded(heard):
    # given a device going online in the same group as a name PostgreSQL cannot store (NUL)
    device = DeviceFactory(online=False).name

    # when the group is flushed
    presence.presence_flush([("bad\x00name", ONLINE), (device, ONLINE)])

    # then the device is recorded (on PostgreSQL each device alone, the bad name dropped)
    assert online(device)
    assert heard == [[(device, True)]]


@pytest.mark.django_db
def test_a_message_beyond_the_waiting_limit_is_an_outage_to_the_bridge(settings, monkeypatch):
    # given presence writes so far behind that the limit of waiting messages is reached
    group = Batcher(presence.presence_flush, max_items=99, idle_seconds=3600, max_wait_seconds=3600, name="t")
    monkeypatch.setattr(presence, "presence_batcher", group)
    monkeypatch.setattr(presence, "PRESENCE_WAITING_MAX", 3)
    names = [DeviceFactory(online=False).name for _ in range(4)]
    topics = [f"{settings.IOTQUEUE_TOPIC_PREFIX}/{name}/status" for name in names]
    for topic in topics[:3]:
        presence.presence_message_handle(topic, b"online")

    # when one more comes, the bridge is told of an outage: it holds the message, to try again
    with pytest.raises(OUTAGE_ERRORS):
        presence.presence_message_handle(topics[3], b"online")

    # and once the waiting ones are written, the message tried again joins the next group
    group.drain()
    presence.presence_message_handle(topics[3], b"online")
    group.drain()
    assert Device.objects.filter(name__in=names, online=True).count() == 4


# --- through the real bridge -------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_many_devices_statuses_reach_the_rows_and_the_log_has_a_line_per_group(stack, simulator):
    # given 30 devices not seen online yet
    names = [DeviceFactory(online=False).name for _ in range(30)]
    since = stack.supervisor.log_size("bridge")

    # when they connect (a retained "online" each), and one goes offline right after
    sim = simulator({name: DeviceBehaviour() for name in names}, heartbeat_interval=0)
    sim.device_remove(names[0])

    # then the 29 others are online, and the one that left ends offline behind its "online"
    wait_for(lambda: Device.objects.filter(name__in=names[1:], online=True).count() == 29, what="29 online")
    barrier = DeviceFactory(online=False).name
    simulator({barrier: DeviceBehaviour()}, heartbeat_interval=0)
    wait_for(lambda: online(barrier), what="a later status, recorded after the first 30 devices'")
    assert not online(names[0])
    # and the bridge logs its changes per group, not per device
    log = stack.supervisor.children["bridge"].log_text()[since:]
    assert "presence: " in log and f"device {names[1]} is online" not in log


@only_postgresql
@pytest.mark.django_db(transaction=True)
def test_replies_go_on_while_a_presence_write_waits(stack, simulator):
    # given a device at work and one whose row another connection holds locked
    worker, blocked = DeviceFactory(), DeviceFactory(online=False)
    others = [DeviceFactory(online=False).name for _ in range(10)]
    simulator({worker.name: DeviceBehaviour()}, heartbeat_interval=0)
    wait_for(lambda: online(worker.name), what=f"{worker.name} online")
    template = template_with_steps((worker, "step", {}))

    with row_locked(blocked.pk):
        # when the bridge's presence write waits for that row, and more statuses queue behind it
        simulator({blocked.name: DeviceBehaviour()}, heartbeat_interval=0)
        wait_for(presence_write_waiting, what="the bridge's presence write waiting for the row lock")
        simulator({name: DeviceBehaviour() for name in others}, heartbeat_interval=0)
        run, _ = run_start(template=template)

        # then the device's replies still end its run
        wait_for(lambda: run_status(run) == RunStatus.SUCCEEDED, what="the run to succeed")
        # while the presence group is still held up
        assert not Device.objects.filter(name__in=[blocked.name, *others], online=True).exists()

    # and once the row is free, every status queued meanwhile is recorded
    names = [blocked.name, *others]
    wait_for(lambda: Device.objects.filter(name__in=names, online=True).count() == 11, what="all 11 online")


@only_postgresql
@pytest.mark.django_db(transaction=True)
def test_a_status_sent_while_the_database_restarts_is_recorded_once_it_is_back(stack, simulator):
    # given a device online and one offline, whose simulator is built now (it reads the
    # database to log in) to connect while the database is away
    leaving, joining = DeviceFactory(), DeviceFactory(online=False)
    sim = simulator({leaving.name: DeviceBehaviour()}, heartbeat_interval=0)
    joiner = Simulator({joining.name: DeviceBehaviour()}, url=stack.services.mqtt_url, heartbeat_interval=0)
    bridge = stack.supervisor.children["bridge"]
    since = stack.supervisor.log_size("bridge")

    try:
        # when each changes while the database is away
        with pg_restart.database_restarting(database_url(), connection.settings_dict["NAME"]):
            sim.device_remove(leaving.name)
            joiner.start()
            wait_for(
                lambda: "batcher presence: flushing" in bridge.log_text()[since:],
                what="the bridge's presence write meeting the outage",
            )
        connection.close()

        # then both are recorded once it is back, by the bridge that kept running
        wait_for(lambda: not online(leaving.name), what=f"{leaving.name}'s offline")
        wait_for(lambda: online(joining.name), what=f"{joining.name}'s online")
        assert bridge.alive()
    finally:
        joiner.stop()


@contextlib.contextmanager
def row_locked(pk: int) -> Iterator[None]:
    """A device row locked (SELECT … FOR UPDATE) by a connection of the test's own until the
    `with` body is over."""
    db = connection.settings_dict
    with psycopg.connect(
        host=db["HOST"] or "127.0.0.1",
        port=db["PORT"] or 5432,
        user=db["USER"],
        password=db["PASSWORD"] or None,
        dbname=db["NAME"],
    ) as other:
        other.execute("SELECT id FROM devices_device WHERE id = %s FOR UPDATE", [pk])
        try:
            yield
        finally:
            other.rollback()


def presence_write_waiting() -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND query LIKE %s",
            ["%devices_device%FOR UPDATE%"],
        )
        return cursor.fetchone()[0] > 0


def run_status(run) -> str:
    run.refresh_from_db()
    return run.status
