"""Presence: a device's retained status / last will and its heartbeats update the Device row.

The bridge's handler (`presence_message_handle`) only checks a message and adds it to the
presence batcher (iotqueue/batching.py), its own, apart from the replies' one: the statuses and
heartbeats of many devices that arrive together are recorded in one transaction of a few
set-based statements (`presence_record`), and the MQTT message is acknowledged once that
committed. A bridge replaying every retained status after a restart so never makes the
replies it receives wait behind a presence write. Within a group each device's last word
counts (an `offline` after an `online` leaves it offline); groups are recorded in order.
`devices_presence_changed` is sent once per group with the devices whose state changed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import timedelta

from django.db import OperationalError, close_old_connections, transaction
from django.db.models import Q
from django.dispatch import Signal
from django.utils import timezone

from iotqueue.batching import Batcher
from iotqueue.bridge import ack_defer, message_again
from iotqueue.budget import MessageBudget, message_drop_note
from iotqueue.redelivery import OUTAGE_ERRORS

from . import protocol
from .models import Device

log = logging.getLogger(__name__)

# Heartbeats only refresh last_seen; writing the row on every beat of 10,000 devices
# would be wasted I/O, so a row is written at most once per this interval.
LAST_SEEN_WRITE_INTERVAL = timedelta(seconds=15)
# Status and heartbeat messages a device may send before the bridge stops touching the
# database for them: each joins a presence write on the bridge (and a status change a
# Celery task), so a device repeating them must not slow the bridge down for everyone.
# Real firmware sends a status per connection and a heartbeat every few seconds.
PRESENCE_MESSAGES_PER_SECOND = 1.0
PRESENCE_BURST = 10
presence_budget = MessageBudget(rate=PRESENCE_MESSAGES_PER_SECOND, burst=PRESENCE_BURST)

# Presence groups: at most this many messages (the statements' name lists stay far below
# any database's parameter limit), written once no new one came for the idle time or the
# first waited the max wait. A status is acknowledged only after its write, and a broker may
# cap the unacknowledged QoS 1 messages it sends a client (Mosquitto's max_inflight_messages):
# a short idle time keeps such a capped stream moving, a group every few milliseconds; the
# max wait bounds a heartbeat's delay under a steady stream.
PRESENCE_BATCH_MAX = 1000
PRESENCE_BATCH_IDLE_SECONDS = 0.005
PRESENCE_BATCH_MAX_WAIT_SECONDS = 0.1
# Messages waiting for their group's write at most. Beyond it the bridge holds a message as
# it holds one that met an outage (iotqueue/redelivery.py: bounded per device and in bytes,
# tried again later), so a database away for minutes while 100,000 devices beat cannot fill
# the bridge's memory (about 1 KB a waiting message). Far above the backlog of a restarted
# bridge's replay of 100,000 statuses (written at ~9,000 a second).
PRESENCE_WAITING_MAX = 50_000

# What a presence message says: a status (online/offline) or a heartbeat (online, seen now).
ONLINE, OFFLINE, HEARTBEAT = "online", "offline", "heartbeat"

# Sent (with changes=[(name, online), ...], in arrival order) after a presence write
# committed, naming each device whose presence it changed; the jobs app resumes or fails
# their steps. Sent from the bridge process (the presence batcher's thread).
devices_presence_changed = Signal()


def presence_fold(items: Iterable[tuple[str, str]]) -> tuple[dict[str, bool], set[str]]:
    """Each device's last word, in the order of those last words ({name: online}), and the
    devices whose heartbeat asks for a last_seen refresh (those that end online)."""
    last: dict[str, bool] = {}
    beating: set[str] = set()
    for name, word in items:
        last.pop(name, None)  # ordered by the device's last word, not its first
        last[name] = word != OFFLINE
        if word == HEARTBEAT:
            beating.add(name)
    return last, {name for name in beating if last[name]}


def presence_record(items: Iterable[tuple[str, str]]) -> list[tuple[str, bool]]:
    """Record a group of presence messages ((name, ONLINE|OFFLINE|HEARTBEAT), in arrival
    order) in one transaction; the devices whose state changed, as (name, online).

    One `SELECT … FOR UPDATE` finds the rows that need a write (an online device going
    offline, an offline one coming online, a heartbeat's device last written longer ago than
    LAST_SEEN_WRITE_INTERVAL), in primary-key order so two bridges writing the same statuses
    never deadlock; then one UPDATE each for those going online, going offline and seen.
    The row lock makes a change count once: a second bridge recording the same status finds
    the row changed and leaves it.
    How it fails: a database error raises with nothing written (the batcher tries again).
    """
    last, seen = presence_fold(items)
    if not last:
        return []
    now = timezone.now()
    wanted = Q(name__in=[n for n, online in last.items() if online], online=False)
    wanted |= Q(name__in=[n for n, online in last.items() if not online], online=True)
    if seen:
        stale = Q(last_seen__isnull=True) | Q(last_seen__lte=now - LAST_SEEN_WRITE_INTERVAL)
        wanted |= Q(name__in=seen) & stale
    with transaction.atomic():
        rows = list(
            Device.objects.select_for_update()
            .filter(wanted)
            .order_by("pk")
            .values_list("pk", "name", "online")
        )
        going = {True: [], False: []}
        refreshed = []
        for pk, name, online in rows:
            (refreshed if online == last[name] else going[last[name]]).append(pk)
        for online, pks in going.items():
            if pks:
                Device.objects.filter(pk__in=pks).update(online=online, last_seen=now, presence_since=now)
        if refreshed:
            Device.objects.filter(pk__in=refreshed).update(last_seen=now)
    changed = {name for _, name, online in rows if online != last[name]}
    return [(name, online) for name, online in last.items() if name in changed]


class PresenceBehind(OperationalError):
    """PRESENCE_WAITING_MAX messages wait for the presence write already: the database is
    away or too slow. An outage to the bridge, which holds the message and tries it again."""


class PresenceFlush:
    """The presence batcher's flush: record a group, then tell who changed.

    How it fails: an outage (database, Redis, Celery's broker) raises, and the batcher flushes
    the same group again until it goes through; changes already committed whose signal
    could not be sent (Redis down) are kept and sent first on the next try, so none is
    lost to a write that, tried again, finds nothing left to change. Any other error is the
    group's own (a name the database refuses): each device is then recorded alone, and a
    device that fails so is logged and left out.
    """

    def __init__(self) -> None:
        self._unsent: list[tuple[str, bool]] = []

    def __call__(self, items: list[tuple[str, str]]) -> None:
        self._send()
        try:
            changes = presence_record(items)
        except OUTAGE_ERRORS:
            raise
        except Exception:
            log.exception("presence: recording %d messages failed; recording each device alone", len(items))
            changes = self._record_alone(items)
        else:
            self._unsent.extend(changes)
        self._send()
        self._log(items, changes)

    def _record_alone(self, items: list[tuple[str, str]]) -> list[tuple[str, bool]]:
        """Each device's messages in a transaction of their own; each change kept to be sent
        as soon as it committed (an outage midway raises with those kept)."""
        by_device: dict[str, list[tuple[str, str]]] = {}
        for item in items:
            by_device.setdefault(item[0], []).append(item)
        changes: list[tuple[str, bool]] = []
        for name, own in by_device.items():
            try:
                changed = presence_record(own)
            except OUTAGE_ERRORS:
                raise
            except Exception:
                log.exception("presence: recording device %r failed; its messages are dropped", name)
                continue
            self._unsent.extend(changed)
            changes += changed
        return changes

    def _send(self) -> None:
        if self._unsent:
            devices_presence_changed.send(sender=Device, changes=list(self._unsent))
            self._unsent.clear()

    @staticmethod
    def _log(items: list[tuple[str, str]], changes: list[tuple[str, bool]]) -> None:
        for name, online in changes:
            log.debug("device %s is %s", name, "online" if online else "offline")
        if not changes:
            log.debug("presence: %d messages, nothing changed", len(items))
            return
        online = sum(1 for _, is_online in changes if is_online)
        log.info(
            "presence: %d online, %d offline (%d messages of %d devices)",
            online,
            len(changes) - online,
            len(items),
            len({name for name, _ in items}),
        )


presence_flush = PresenceFlush()


def _group_flush(items: list[tuple[str, str]]) -> None:
    close_old_connections()  # the batcher's own thread: a connection an outage broke is reopened
    presence_flush(items)


presence_batcher = Batcher(
    _group_flush,
    max_items=PRESENCE_BATCH_MAX,
    idle_seconds=PRESENCE_BATCH_IDLE_SECONDS,
    max_wait_seconds=PRESENCE_BATCH_MAX_WAIT_SECONDS,
    name="presence",
)


def device_presence_set(*, name: str, online: bool) -> bool:
    """Record the device online/offline now (a group of one); True when that changed its state."""
    changes = presence_record([(name, ONLINE if online else OFFLINE)])
    if changes:
        devices_presence_changed.send(sender=Device, changes=changes)
    return bool(changes)


def device_seen(*, name: str) -> None:
    """A heartbeat recorded now (a group of one): last_seen refreshed (throttled); an offline
    device is back online."""
    changes = presence_record([(name, HEARTBEAT)])
    if changes:
        devices_presence_changed.send(sender=Device, changes=changes)


def presence_message_handle(topic: str, payload: bytes) -> None:
    """Bridge handler for P/<device>/status and P/<device>/heartbeat: checked here, recorded
    in the presence batcher's next group, acknowledged once that group committed."""
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
        _group_join(name, HEARTBEAT)
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
    _group_join(name, ONLINE if online else OFFLINE)


def _group_join(name: str, word: str) -> None:
    if presence_batcher.waiting() >= PRESENCE_WAITING_MAX:
        raise PresenceBehind(f"{PRESENCE_WAITING_MAX} presence messages wait for the database")
    presence_batcher.add((name, word), ack_defer())
