"""Exactly one beat: a lease in Redis gates every scheduler tick.

Any number of `celery beat` processes may run against the same Redis; the one holding the
lease schedules, the others stand by. The lease is one key (`<prefix>:beat:lease`, through
`redis_key`) holding the holder's owner token (host:pid:random), taken with SET NX PX and
renewed with a compare-and-pexpire script at least every third of its length
(IOTQUEUE_BEAT_LEASE_SECONDS), so while the holder runs it never lapses. A holder that dies
stops renewing: the key expires and the first standby that polls takes it over. A beat
stopped cleanly deletes the key in `close()` (compare-and-delete), so a standby takes over
at its next poll. A holder that finds on renewal that the key names someone else (it was
paused longer than the lease) stops scheduling at once.

The holder schedules only while its lease is certainly valid: until the lease length after
it last sent the renewal, by its own monotonic clock. Redis being unreachable for a moment
changes nothing until then; after, it stands by until Redis answers again.

Celery's beat loop sleeps as long as `tick()` says, so a holder's tick never asks for more
than the time to its next renewal, and a standby's returns a short poll interval and sends
nothing. `LeasedDatabaseScheduler` (production: schedules edited in the admin) and
`LeasedPersistentScheduler` (a file, for the tests and the dev stack) are the two wirings.

Every beat, holder or standby, records its last tick in `<prefix>:beat:tick:<host>` (owner,
holding, wall-clock time), which `manage.py healthcheck beat` reads (iotqueue/health.py).

`LeasedDatabaseScheduler.lease_taken` writes private state of django-celery-beat's
DatabaseScheduler (and Celery's Scheduler `_heap`): the import checks that the installed
versions are those it was written for (iotqueue/private_api.py).
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis
from celery.beat import PersistentScheduler
from celery.schedules import schedule
from django.conf import settings
from django.db import close_old_connections
from django_celery_beat.schedulers import DatabaseScheduler

from .private_api import private_api_check
from .redis_conn import redis_connection, redis_key

log = logging.getLogger(__name__)

# Renew the expiry only if the key still names us: 1 when renewed, 0 when lost.
RENEW_LUA = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('pexpire', KEYS[1], ARGV[2])
end
return 0
"""
# Delete the key only if it still names us (a clean shutdown hands the lease on at once).
RELEASE_LUA = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('del', KEYS[1])
end
return 0
"""

# A beat's last tick (TickRecorder): owner, holding, wall-clock time, and an expiry, in one
# round trip.
TICK_LUA = """
redis.call('hset', KEYS[1], 'owner', ARGV[1], 'holding', ARGV[2], 'at', ARGV[3])
return redis.call('expire', KEYS[1], ARGV[4])
"""

# A renewal is sent every third of the lease: two renewals may fail before it lapses.
RENEWALS_PER_LEASE = 3
# A standby tries to take the lease this often (or every third of a lease shorter than 3 s).
STANDBY_POLL_SECONDS = 1.0
# A beat records its last tick (for `manage.py healthcheck beat`) at most this often: a
# holder may tick many times a second, and one Redis write a second says enough.
TICK_RECORD_SECONDS = 1.0


def owner_token() -> str:
    """Who holds the lease, as the standbys' logs show it: host:pid:random."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Lease:
    """A Redis key that one owner at a time holds for `seconds`, renewable by its owner."""

    def __init__(self, client: redis.Redis, key: str, seconds: float, *, owner: str) -> None:
        if seconds <= 0:
            raise ValueError(f"a lease lasts more than 0 seconds, not {seconds}")
        self.client = client
        self.key = key
        self.seconds = seconds
        self.owner = owner
        self._renew = client.register_script(RENEW_LUA)
        self._release = client.register_script(RELEASE_LUA)

    @property
    def _milliseconds(self) -> int:
        return max(1, round(self.seconds * 1000))

    def acquire(self) -> bool:
        """Take the lease if nobody holds it (or renew it if we already do)."""
        if self.client.set(self.key, self.owner, nx=True, px=self._milliseconds):
            return True
        # Ours already when an earlier SET went through but its answer was lost.
        return self.holder() == self.owner and self.renew()

    def renew(self) -> bool:
        """Extend the lease by its length from now; False when someone else holds it."""
        return bool(self._renew(keys=[self.key], args=[self.owner, self._milliseconds]))

    def release(self) -> bool:
        """Give the lease up if we hold it."""
        return bool(self._release(keys=[self.key], args=[self.owner]))

    def holder(self) -> str | None:
        """The holder's owner token, or None when the lease is free."""
        return self.client.get(self.key)


class LeaseGate:
    """Tick by tick, whether this beat may schedule: takes, renews and gives up the lease.

    `check()` answers True while this process holds a lease it knows to be valid; it talks
    to Redis only to take the lease (standing by) or to renew it (every third of its
    length), and logs each change of state once.
    """

    def __init__(self, lease: Lease, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease = lease
        self.clock = clock
        self.holding = False
        # Monotonic times: the lease is certainly ours until valid_until; renew from renew_at.
        self.valid_until = 0.0
        self.renew_at = 0.0
        # The holder last logged while standing by (None before any), and whether Redis failed.
        self._standby_holder: str | None = None
        self._unreachable = False

    @property
    def renew_every(self) -> float:
        return self.lease.seconds / RENEWALS_PER_LEASE

    @property
    def standby_seconds(self) -> float:
        """How long a standby waits before it tries to take the lease again."""
        return min(STANDBY_POLL_SECONDS, self.renew_every)

    def sleep_cap(self) -> float:
        """The longest a holder may sleep before its next renewal is due."""
        return max(0.0, self.renew_at - self.clock())

    def check(self) -> bool:
        """True when this beat holds the lease and may send due tasks now."""
        return self._keep() if self.holding else self._take()

    def _granted(self, sent_at: float) -> None:
        self.holding = True
        self.valid_until = sent_at + self.lease.seconds
        self.renew_at = sent_at + self.renew_every
        self._unreachable = False

    def _take(self) -> bool:
        sent_at = self.clock()
        try:
            taken = self.lease.acquire()
            holder = None if taken else self.lease.holder()
        except redis.RedisError as exc:
            self._redis_failed("cannot take the lease", exc)
            return False
        if taken:
            if self._standby_holder:
                log.info("beat: took over the lease from %s, scheduling", self._standby_holder)
            else:
                log.info("beat: holding the lease, scheduling (%s)", self.lease.owner)
            self._standby_holder = None
            self._granted(sent_at)
            return True
        self._unreachable = False
        if holder and holder != self._standby_holder:
            log.info("beat: standing by (lease held by %s)", holder)
            self._standby_holder = holder
        return False

    def _keep(self) -> bool:
        now = self.clock()
        if now < self.renew_at:
            return True
        try:
            renewed = self.lease.renew()
            holder = None if renewed else self.lease.holder()
        except redis.RedisError as exc:
            # The clock again: the failed call itself may have taken seconds.
            if self.clock() < self.valid_until:
                self._redis_failed("cannot renew the lease (still valid, scheduling)", exc)
                return True
            self.holding = False
            self._unreachable = True
            log.warning("beat: the lease expired while Redis was unreachable; standing by: %s", exc)
            return False
        if renewed:
            self._granted(now)
            return True
        self.holding = False
        if holder is None:
            # Not renewed in time (this process was paused) and nobody took it: take it again.
            log.warning("beat: the lease expired before it was renewed; taking it again")
            return self._take()
        self._standby_holder = holder
        log.warning("beat: lost the lease to %s; standing by", holder)
        return False

    def _redis_failed(self, what: str, exc: Exception) -> None:
        if not self._unreachable:
            log.warning("beat: %s: Redis: %s", what, exc)
        self._unreachable = True

    def release(self) -> None:
        """Give the lease up (a clean shutdown): a standby takes over at its next poll."""
        if not self.holding:
            return
        self.holding = False
        try:
            if self.lease.release():
                log.info("beat: released the lease")
        except redis.RedisError as exc:
            log.warning("beat: could not release the lease (it expires by itself): %s", exc)


def beat_tick_key(host: str) -> str:
    """Where the beat on `host` records its last tick: one beat per host (container, pod)."""
    return redis_key("beat", "tick", host)


def beat_tick_read(host: str) -> dict[str, str]:
    """The last tick the beat on `host` recorded: owner, holding ("1"/"0"), at (wall clock);
    {} when none. Raises RedisError."""
    return redis_connection().hgetall(beat_tick_key(host))


class TickRecorder:
    """Records a beat's ticks in Redis (at most every TICK_RECORD_SECONDS), for its health check.

    How it fails: a Redis error is swallowed (the lease gate already says Redis is gone);
    the record then ages, which is what the health check reports. It expires after a few
    lease lengths, so a beat gone for good leaves none.
    """

    def __init__(self, gate: LeaseGate, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.gate = gate
        self.clock = clock
        self.key = beat_tick_key(socket.gethostname())
        self._record = gate.lease.client.register_script(TICK_LUA)
        self._next = 0.0

    def tick(self) -> None:
        now = self.clock()
        if now < self._next:
            return
        self._next = now + TICK_RECORD_SECONDS
        lease = self.gate.lease
        expiry = max(1, math.ceil(3 * lease.seconds))
        try:
            self._record(keys=[self.key], args=[lease.owner, int(self.gate.holding), time.time(), expiry])
        except redis.RedisError:
            pass


def lease_gate() -> LeaseGate:
    """The gate of this process's beat, on the project's Redis and key prefix."""
    lease = Lease(
        redis_connection(),
        redis_key("beat", "lease"),
        float(settings.IOTQUEUE_BEAT_LEASE_SECONDS),
        owner=owner_token(),
    )
    return LeaseGate(lease)


class LeasedSchedulerMixin:
    """Put before a Celery scheduler class: its ticks run only while this beat holds the lease.

    Nothing touches Redis before the first tick, so Celery may build a scheduler lazily
    (for introspection) without taking the lease.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.lease_gate = lease_gate()
        self.tick_recorder = TickRecorder(self.lease_gate)
        super().__init__(*args, **kwargs)

    def tick(self, *args: Any, **kwargs: Any) -> float:
        gate = self.lease_gate
        was_holding = gate.holding
        allowed = gate.check()
        self.tick_recorder.tick()
        if not allowed:
            if was_holding:
                self.lease_lost()
            return gate.standby_seconds
        if not was_holding:
            self.lease_taken()
        return min(super().tick(*args, **kwargs), gate.sleep_cap())

    def lease_taken(self) -> None:
        """This beat starts scheduling: a subclass reloads what another holder changed."""

    def lease_lost(self) -> None:
        """Another beat schedules now: keep what this one sent, then send nothing more."""
        self.sync()

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.lease_gate.release()


def _whole_seconds(name: str, entry: Any) -> Any:
    """A code-defined entry whose interval is not a whole number of seconds, rounded up to
    one (with a warning): the database scheduler cannot store a fraction."""
    if not isinstance(entry, dict):
        return entry
    interval = entry.get("schedule")
    if isinstance(interval, datetime.timedelta):
        seconds = interval.total_seconds()
    elif isinstance(interval, schedule) and type(interval) is schedule:
        seconds = interval.run_every.total_seconds()
    elif isinstance(interval, int | float) and not isinstance(interval, bool):
        seconds = float(interval)
    else:
        return entry
    if seconds == int(seconds) and seconds >= 1:
        return entry
    whole = max(1, math.ceil(seconds))
    log.warning(
        "beat: %s every %ss: the database scheduler counts whole seconds; every %ss", name, seconds, whole
    )
    return {**entry, "schedule": float(whole)}


# What LeasedDatabaseScheduler.lease_taken writes besides the public API.
DATABASE_SCHEDULER_PRIVATE = (
    "_dirty",
    "_last_timestamp",
    "_schedule",
    "_last_full_sync",
    "_heap",
    "_heap_invalidated",
)
WRITTEN_FOR = ("django-celery-beat", "2.9.0")
CELERY_WRITTEN_FOR = ("celery", "5.7.0")

private_api_check(
    WRITTEN_FOR,
    owner=DatabaseScheduler,
    attributes=DATABASE_SCHEDULER_PRIVATE,
    where="iotqueue/beat_lease.py",
)
private_api_check(
    CELERY_WRITTEN_FOR, owner=PersistentScheduler, attributes=("_heap",), where="iotqueue/beat_lease.py"
)


class LeasedDatabaseScheduler(LeasedSchedulerMixin, DatabaseScheduler):
    """django-celery-beat's DatabaseScheduler (schedules in the admin), one beat at a time."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Save when entries last ran every lease, not every 3 minutes: what a killed holder
        # sent since its last save is what a standby taking over may send once more.
        self.sync_every = min(self.sync_every, float(settings.IOTQUEUE_BEAT_LEASE_SECONDS))

    def update_from_dict(self, mapping: dict[str, Any]) -> None:
        # The table keeps intervals in whole seconds (IntervalSchedule.every is an integer):
        # 0.5 s would be stored as 0, an entry due at every tick, sent in a tight loop.
        super().update_from_dict({name: _whole_seconds(name, entry) for name, entry in mapping.items()})

    def lease_taken(self) -> None:
        # The previous holder saved when entries last ran: read them again, so a standby
        # that loaded the table long ago does not send again what was sent meanwhile. As
        # the `schedule` property does on a change, but the heap is rebuilt from scratch
        # and no change stays pending (it would rebuild it again after the first send,
        # from entries that do not know they were sent).
        close_old_connections()
        self._dirty.clear()
        self._last_timestamp = self.Changes.last_change()
        self._schedule = self.all_as_schedule()
        self._last_full_sync = datetime.datetime.now()
        self._heap = None
        self._heap_invalidated = False


class LeasedPersistentScheduler(LeasedSchedulerMixin, PersistentScheduler):
    """Celery's file-based PersistentScheduler (tests, dev stack), one beat at a time."""
