"""Exactly one beat: two real beats against the same Redis, one schedules (iotqueue/beat_lease.py).

Both beats run the leased file scheduler on a key prefix and a Celery queue of their own,
so neither competes with the session's beat nor feeds its worker: what they send is
observed in their logs ("Scheduler: Sending due task"), with Celery's timestamps.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from django.utils import timezone
from django_celery_beat.models import IntervalSchedule, PeriodicTask

from devtools.processes import Supervisor, beat_argv
from iotqueue import celery_app
from iotqueue.beat_lease import LeasedDatabaseScheduler
from iotqueue.redis_conn import redis_connection
from tests.conftest import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

LEASED_FILE_SCHEDULER = "iotqueue.beat_lease:LeasedPersistentScheduler"
LEASE_SECONDS = 2.0
# The monitor entry fires every half second (the stack's IOTQUEUE_MONITOR_INTERVAL).
SENDS_OBSERVED = 5
# A standby takes over within a lease (the dead holder's last renewal expiring) plus a poll
# and its start-up; generous, only so that a broken takeover fails instead of hanging.
TAKEOVER_SECONDS = LEASE_SECONDS + 15
# Celery's log line: [2026-01-02 03:04:05,678: INFO/MainProcess] message
LOG_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}): \w+/[^\]]*\] (.*)$", re.MULTILINE)
SEND = "Scheduler: Sending due task"


@pytest.fixture
def beats(stack, tmp_path) -> Iterator[Supervisor]:
    """A supervisor for beats "a" and "b", sharing a lease of their own; cleaned up after."""
    namespace = f"{stack.services.namespace}-beats"
    env = {
        **stack.supervisor.env,
        "IOTQUEUE_REDIS_KEY_PREFIX": namespace,
        "CELERY_TASK_DEFAULT_QUEUE": namespace,
        "IOTQUEUE_BEAT_LEASE_SECONDS": str(LEASE_SECONDS),
        "IOTQUEUE_LOG_FORMAT": "text",
    }
    supervisor = Supervisor(tmp_path / "logs", env)
    try:
        yield supervisor
    finally:
        supervisor.stop_all()
        redis = redis_connection()
        # The lease (released already) and the queue nobody consumed.
        stale = list(redis.scan_iter(f"{namespace}*"))
        if stale:
            redis.delete(*stale)
        for binding in redis.scan_iter("_kombu.binding.*"):
            members = [m for m in redis.smembers(binding) if namespace in m]
            if members:
                redis.srem(binding, *members)


def beat_start(beats: Supervisor, name: str, tmp_path: Path) -> None:
    state = tmp_path / name
    state.mkdir(exist_ok=True)
    beats.start(name, beat_argv(state, scheduler=LEASED_FILE_SCHEDULER))


def events(beats: Supervisor, name: str, *, since: int = 0) -> list[tuple[datetime, str]]:
    """(time, message) of each line the beat logged after offset `since`."""
    text = beats.children[name].log_text()[since:]
    return [
        (datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f"), message)
        for stamp, message in LOG_LINE.findall(text)
    ]


def sends(beats: Supervisor, name: str, *, since: int = 0) -> list[datetime]:
    """When the beat sent a due task (after log offset `since`)."""
    return [at for at, message in events(beats, name, since=since) if message.startswith(SEND)]


def test_a_second_beat_stands_by_and_takes_over_when_the_first_is_killed(beats, tmp_path):
    # given beat a holding the lease, then beat b started against the same Redis
    beat_start(beats, "a", tmp_path)
    beats.wait_for_log("a", r"beat: holding the lease, scheduling")
    beat_start(beats, "b", tmp_path)
    beats.wait_for_log("b", r"beat: standing by \(lease held by [^)]+\)")
    a_since = beats.log_size("a")

    # when a has sent the monitor tick several times since b stood by
    wait_for(lambda: len(sends(beats, "a", since=a_since)) >= SENDS_OBSERVED, what="beat a's sends")

    # then b, standing by the whole time, sent nothing
    assert sends(beats, "b") == []

    # when a is killed (no clean shutdown: its lease has to expire)
    beats.kill("a")
    killed_at = time.monotonic()

    # then b takes over within about a lease and sends
    wait_for(
        lambda: len(sends(beats, "b")) >= SENDS_OBSERVED,
        timeout=TAKEOVER_SECONDS + SENDS_OBSERVED,
        what="beat b taking over and sending",
    )
    assert "beat: took over the lease from" in beats.children["b"].log_text()
    assert time.monotonic() - killed_at < TAKEOVER_SECONDS + SENDS_OBSERVED

    # and the two sent in periods that never overlap: all of a's sends before all of b's
    a_sends, b_sends = sends(beats, "a"), sends(beats, "b")
    assert max(a_sends) < min(b_sends)
    # b took over only once a's lease could have lapsed (a renewed at least every third of it)
    assert (min(b_sends) - max(a_sends)).total_seconds() > LEASE_SECONDS / 3


def test_a_beat_stopped_cleanly_hands_the_lease_on_without_waiting_for_it(beats, tmp_path):
    # given beat a scheduling and beat b standing by (a long lease: only a release is quick)
    beats.env["IOTQUEUE_BEAT_LEASE_SECONDS"] = "30"
    beat_start(beats, "a", tmp_path)
    beats.wait_for_log("a", r"beat: holding the lease, scheduling")
    beat_start(beats, "b", tmp_path)
    beats.wait_for_log("b", r"beat: standing by \(lease held by [^)]+\)")
    wait_for(lambda: sends(beats, "a"), what="beat a's first send")

    # when a stops (SIGTERM, as a deploy or compose does)
    beats.stop("a")
    assert "beat: released the lease" in beats.children["a"].log_text()

    # then b takes over at its next poll, long before the lease would have expired
    wait_for(lambda: sends(beats, "b"), timeout=10, what="beat b's first send")
    assert "beat: took over the lease from" in beats.children["b"].log_text()
    assert max(sends(beats, "a")) < min(sends(beats, "b"))


class RecordingDatabaseScheduler(LeasedDatabaseScheduler):
    """The production scheduler, in this process, recording what it would send."""

    def __init__(self, *args, **kwargs) -> None:
        self.sent: list[str] = []
        super().__init__(*args, **kwargs)

    def apply_entry(self, entry, producer=None) -> None:
        self.sent.append(entry.name)

    def ticks(self, count: int = 20) -> list[str]:
        """Tick until nothing more is due now (at most `count` sends); what it sent."""
        self.sent = []
        for _ in range(count):
            if self.tick() != 0:
                break
        return self.sent


def test_a_database_beat_taking_over_reads_what_the_previous_holder_sent(services, settings):
    # given an hourly schedule due now, loaded by two database beats on a lease of their own
    settings.IOTQUEUE_REDIS_KEY_PREFIX = f"{services.namespace}-dbbeats"
    every_hour = IntervalSchedule.objects.create(every=3600, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.create(
        name="hourly",
        task="jobs.runs_prune",
        interval=every_hour,
        last_run_at=timezone.now() - timedelta(hours=2),
    )
    holder, standby = RecordingDatabaseScheduler(app=celery_app), RecordingDatabaseScheduler(app=celery_app)
    try:
        # when the holder sends it and stops, and the standby (which loaded it as due) takes over
        assert holder.ticks().count("hourly") == 1
        assert standby.ticks() == []
        holder.close()
        taken_over = standby.ticks()

        # then the new holder schedules, but does not send the hourly entry a second time
        assert standby.lease_gate.holding
        assert "hourly" not in taken_over
        assert PeriodicTask.objects.get(name="hourly").total_run_count == 1
    finally:
        holder.close()
        standby.close()
