"""The beat lease's logic (iotqueue/beat_lease.py), on an in-memory Redis and a fake clock.

Two real beats against a real Redis, one killed, are in tests/jobs/test_beat.py.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
import redis
from celery.beat import Scheduler
from celery.schedules import crontab, schedule
from django.utils import timezone

from iotqueue import beat_lease, celery_app
from iotqueue.beat_lease import RELEASE_LUA, RENEW_LUA, Lease, LeasedSchedulerMixin, LeaseGate, _whole_seconds

LEASE_SECONDS = 9.0
KEY = "test:beat:lease"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class MemoryRedis:
    """The few Redis commands a lease uses, with expiry on the test's clock; `down` fails them."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.values: dict[str, str] = {}
        self.expires: dict[str, float] = {}
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise redis.ConnectionError("Redis is down")

    def get(self, key: str) -> str | None:
        self._check()
        if key in self.expires and self.clock() >= self.expires[key]:
            del self.values[key], self.expires[key]
        return self.values.get(key)

    def set(self, key: str, value: str, *, nx: bool = False, px: int | None = None) -> bool | None:
        if nx and self.get(key) is not None:
            return None
        self.values[key] = value
        if px is not None:
            self.expires[key] = self.clock() + px / 1000
        return True

    def register_script(self, text: str):
        def run(keys: list[str], args: list[object]) -> int:
            key, owner = keys[0], args[0]
            if self.get(key) != owner:
                return 0
            if text == RENEW_LUA:
                self.expires[key] = self.clock() + int(args[1]) / 1000
            elif text == RELEASE_LUA:
                del self.values[key], self.expires[key]
            return 1

        return run


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def server(clock) -> MemoryRedis:
    return MemoryRedis(clock)


def gate(server: MemoryRedis, clock: Clock, owner: str) -> LeaseGate:
    return LeaseGate(Lease(server, KEY, LEASE_SECONDS, owner=owner), clock=clock)


def messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "iotqueue.beat_lease"]


def test_the_first_beat_holds_the_lease_and_the_second_stands_by_logging_it_once(server, clock, caplog):
    caplog.set_level(logging.INFO)
    first, second = gate(server, clock, "host-a:1:aa"), gate(server, clock, "host-b:2:bb")

    # when both check, the second three times
    assert first.check() is True
    assert [second.check() for _ in range(3)] == [False, False, False]

    # then the key names the first, and the log says so once for each
    assert server.values[KEY] == "host-a:1:aa"
    assert messages(caplog) == [
        "beat: holding the lease, scheduling (host-a:1:aa)",
        "beat: standing by (lease held by host-a:1:aa)",
    ]


def test_the_holder_renews_every_third_of_the_lease_so_it_never_lapses(server, clock):
    holder, standby = gate(server, clock, "a"), gate(server, clock, "b")
    assert holder.check()

    # when the holder ticks for three lease lengths, renewing whenever a third has passed
    for _ in range(9):
        assert holder.sleep_cap() == pytest.approx(LEASE_SECONDS / 3)
        clock.now += holder.sleep_cap()
        assert holder.check() is True
        # then the standby never gets it
        assert standby.check() is False

    assert server.expires[KEY] == pytest.approx(clock.now + LEASE_SECONDS)


def test_a_standby_polls_briefly_and_a_holder_sleeps_no_longer_than_its_renewal(server, clock):
    holder, standby = gate(server, clock, "a"), gate(server, clock, "b")
    holder.check()
    standby.check()

    assert standby.standby_seconds == 1.0
    clock.now += 2.0
    assert holder.sleep_cap() == pytest.approx(LEASE_SECONDS / 3 - 2.0)
    clock.now += 5.0
    assert holder.sleep_cap() == 0.0


def test_a_standby_takes_over_once_a_dead_holder_lease_expired(server, clock, caplog):
    caplog.set_level(logging.INFO)
    holder, standby = gate(server, clock, "a"), gate(server, clock, "b")
    holder.check()
    standby.check()

    # when the holder stops renewing (it died) and the standby keeps polling
    clock.now += LEASE_SECONDS - 0.1
    assert standby.check() is False
    clock.now += 0.1

    # then it takes over once the lease ran out
    assert standby.check() is True
    assert server.values[KEY] == "b"
    assert messages(caplog)[-1] == "beat: took over the lease from a, scheduling"


def test_a_holder_that_finds_its_lease_taken_stops_at_once(server, clock, caplog):
    caplog.set_level(logging.INFO)
    holder, standby = gate(server, clock, "a"), gate(server, clock, "b")
    holder.check()

    # given the holder paused past its lease, and the standby took over meanwhile
    clock.now += LEASE_SECONDS + 1
    assert standby.check() is True

    # when the holder wakes up and ticks, then it schedules nothing and says why
    assert holder.check() is False
    assert holder.holding is False
    assert messages(caplog)[-1] == "beat: lost the lease to b; standing by"
    assert server.values[KEY] == "b"


def test_a_holder_whose_lease_lapsed_unclaimed_takes_it_again(server, clock, caplog):
    caplog.set_level(logging.INFO)
    holder = gate(server, clock, "a")
    holder.check()

    clock.now += LEASE_SECONDS + 1

    assert holder.check() is True
    assert server.values[KEY] == "a"
    assert "beat: the lease expired before it was renewed; taking it again" in messages(caplog)


def test_a_clean_stop_hands_the_lease_on_at_the_next_poll(server, clock, caplog):
    caplog.set_level(logging.INFO)
    holder, standby = gate(server, clock, "a"), gate(server, clock, "b")
    holder.check()
    standby.check()

    holder.release()

    assert KEY not in server.values
    assert standby.check() is True
    assert "beat: released the lease" in messages(caplog)


def test_releasing_never_deletes_another_holders_lease(server, clock):
    holder, standby = gate(server, clock, "a"), gate(server, clock, "b")
    holder.check()
    clock.now += LEASE_SECONDS
    standby.check()

    holder.release()

    assert server.values[KEY] == "b"


def test_redis_unreachable_keeps_the_holder_scheduling_only_while_its_lease_is_valid(server, clock, caplog):
    caplog.set_level(logging.INFO)
    holder, standby = gate(server, clock, "a"), gate(server, clock, "b")
    holder.check()

    # given Redis gone once a renewal is due
    server.down = True
    clock.now += LEASE_SECONDS / 3

    # then the holder goes on until its lease ran out, and a standby cannot take it
    assert holder.check() is True
    assert standby.check() is False
    clock.now += LEASE_SECONDS * 2 / 3 - 0.01
    assert holder.check() is True
    clock.now += 0.01
    assert holder.check() is False

    # and the warnings are logged once, not every tick
    warnings = [m for m in messages(caplog) if "Redis" in m]
    assert warnings == [
        "beat: cannot renew the lease (still valid, scheduling): Redis: Redis is down",
        "beat: cannot take the lease: Redis: Redis is down",
        "beat: the lease expired while Redis was unreachable; standing by: Redis is down",
    ]

    # when Redis is back (its copy of the lease expired), then one of them holds it again
    server.down = False
    assert [holder.check(), standby.check()] == [True, False]


def test_a_lease_of_no_length_is_refused(server):
    with pytest.raises(ValueError, match="more than 0 seconds"):
        Lease(server, KEY, 0, owner="a")


class RecordingScheduler(LeasedSchedulerMixin, Scheduler):
    """A leased scheduler with one entry due now, recording what it would send."""

    producer = None  # never connects to a broker

    def setup_schedule(self) -> None:
        self.sent: list[str] = []
        self.taken = 0
        self.merge_inplace({"ping": {"task": "ping", "schedule": 60.0}})
        self.schedule["ping"].last_run_at = timezone.now() - timedelta(minutes=2)

    def apply_entry(self, entry, producer=None) -> None:
        self.sent.append(entry.name)

    def lease_taken(self) -> None:
        self.taken += 1


@pytest.fixture
def schedulers(server, clock, monkeypatch):
    """Two leased schedulers sharing the in-memory Redis, as two beats would."""
    gates = iter([gate(server, clock, "a"), gate(server, clock, "b")])
    monkeypatch.setattr(beat_lease, "lease_gate", lambda: next(gates))
    return RecordingScheduler(app=celery_app), RecordingScheduler(app=celery_app)


def test_only_the_holding_scheduler_sends_and_the_standby_takes_over_after_close(schedulers):
    holder, standby = schedulers

    # when both tick
    assert holder.tick() == 0  # sent the due entry
    assert standby.tick() == 1.0  # the standby's poll interval

    # then only the holder sent, and sleeps no longer than its next renewal
    assert holder.sent == ["ping"]
    assert standby.sent == []
    assert holder.tick() == pytest.approx(LEASE_SECONDS / 3)

    # when the holder stops cleanly, then the standby takes over at its next tick and sends
    holder.close()
    assert standby.tick() == 0
    assert standby.sent == ["ping"]
    assert (holder.taken, standby.taken) == (1, 1)


def test_a_scheduler_that_lost_the_lease_sends_nothing_more(schedulers, clock):
    holder, standby = schedulers
    holder.tick()

    # given the holder paused past its lease while the standby took over
    clock.now += LEASE_SECONDS + 1
    standby.tick()

    # when the old holder ticks again, then it returns to polling without sending
    holder.schedule["ping"].last_run_at = timezone.now() - timedelta(minutes=2)
    assert holder.tick() == 1.0
    assert holder.sent == ["ping"]


@pytest.mark.parametrize(
    ("interval", "stored"),
    [
        (0.5, 1.0),
        (1.5, 2.0),
        (0, 1.0),
        (timedelta(milliseconds=200), 1.0),
        (schedule(timedelta(seconds=0.5)), 1.0),
    ],
)
def test_the_database_scheduler_gets_whole_seconds(interval, stored):
    # IntervalSchedule.every is an integer: 0.5 s would be stored as 0, due at every tick.
    entry = {"task": "jobs.monitor_tick", "schedule": interval}
    assert _whole_seconds("iotqueue-monitor", entry) == {"task": "jobs.monitor_tick", "schedule": stored}


@pytest.mark.parametrize("interval", [1, 60.0, timedelta(hours=1), crontab(minute="*/5")])
def test_whole_intervals_and_crontabs_are_left_as_they_are(interval):
    entry = {"task": "jobs.runs_prune", "schedule": interval}
    assert _whole_seconds("iotqueue-retention", entry) is entry
