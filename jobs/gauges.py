"""The state gauges the jobs app reports on /metrics: the present, read at each scrape.

Counters say what happened (jobs/metrics.py); these say how things stand now: runs not yet
ended by status, steps at work by status, the fleet by state (the console's fleet board),
stuck runs (the console's definition, IOTQUEUE_STUCK_AFTER_SECONDS), the engine's inbox
(entries waiting and the age of the oldest), how long ago each bridge last heard a message
and whether a beat holds the scheduling lease.
Registered with their readers when the app loads (jobs/apps.py, `gauges_register`).

Each reader is one indexed aggregate or one Redis round trip, whatever the history holds:
runs through `jobrun_status_created`, steps through `steprun_status_deadline` (rows at work
are few), the fleet as one GROUP-free aggregate over the device table plus the lock lease
index (jobs/dashboard.py, measured at 10,000 devices in bench/README.md), the inbox as
XLEN and one XRANGE entry. How it fails: a reader that raises (database or Redis away) is
left out of that scrape and `iotqueue_gauge_read_errors` says which (iotqueue/metrics.py).
"""

from __future__ import annotations

import time

from django.conf import settings
from django.db.models import Count
from django.utils import timezone

from devices.models import Device
from iotqueue.beat_lease import Lease
from iotqueue.health import bridge_heartbeat_key
from iotqueue.metrics import GAUGE, Family, gauge_register
from iotqueue.redis_conn import redis_connection, redis_key

from .dashboard import FLEET_STATES, device_state_q, devices_locked
from .inbox import INBOX
from .models import RUN_TERMINAL, STEP_AT_WORK, JobRun, RunStatus, StepRun
from .waiting import RUN_WAITING, stuck_after

# Terminal runs are history, not state: counted by iotqueue_runs_total when they end.
RUN_ACTIVE = tuple(status for status in RunStatus if status not in RUN_TERMINAL)

RUNS_ACTIVE = Family(
    "iotqueue_runs_active",
    "Runs not yet ended, by status (pending, running, compensating).",
    GAUGE,
    ("status",),
)
STEPS_AT_WORK = Family(
    "iotqueue_steps_at_work",
    "Step runs at work, by status: queued (waiting for their device), dispatched and in_progress "
    "(a command in flight), retrying (waiting out a back-off).",
    GAUGE,
    ("status",),
)
DEVICES = Family(
    "iotqueue_devices",
    "Devices by state, as the console's fleet board counts them: online + offline + disabled = total; "
    "busy (holding its lock or with a command in flight) and idle (online, not busy) count enabled devices.",
    GAUGE,
    ("state",),
)
RUNS_STUCK = Family(
    "iotqueue_runs_stuck",
    "Runs not yet ended whose oldest unfinished step (or the run itself, not started) has waited longer "
    "than IOTQUEUE_STUCK_AFTER_SECONDS: the console's stuck runs.",
    GAUGE,
)
INBOX_ENTRIES = Family(
    "iotqueue_inbox_entries",
    "Entries (groups of device replies, run starts) in the engine's inbox not yet applied.",
    GAUGE,
)
INBOX_OLDEST_AGE = Family(
    "iotqueue_inbox_oldest_age_seconds",
    "Age of the oldest entry in the engine's inbox not yet applied; 0 when the inbox is empty.",
    GAUGE,
)
BRIDGE_LAST_MESSAGE_AGE = Family(
    "iotqueue_bridge_last_message_age_seconds",
    "Seconds since each running bridge (by MQTT client id) last received a message of any kind: replies, "
    "status, heartbeats. A bridge that has received none since it started is not listed.",
    GAUGE,
    ("bridge",),
)
BEAT_LEASE_HELD = Family(
    "iotqueue_beat_lease_held",
    "1 while a celery beat holds the scheduling lease, 0 when none does (no beat schedules the monitor).",
    GAUGE,
)


def runs_active_read() -> dict[tuple[str, ...], int]:
    """Runs not yet ended by status (every such status listed, 0 when none): one GROUP BY."""
    counts = dict.fromkeys(((str(status),) for status in RUN_ACTIVE), 0)
    rows = JobRun.objects.filter(status__in=RUN_ACTIVE).order_by().values("status").annotate(n=Count("pk"))
    for row in rows:
        counts[(row["status"],)] = row["n"]
    return counts


def steps_at_work_read() -> dict[tuple[str, ...], int]:
    """Step rows at work by status: one GROUP BY through the step status index."""
    counts = dict.fromkeys(((str(status),) for status in STEP_AT_WORK), 0)
    rows = StepRun.objects.filter(status__in=STEP_AT_WORK).order_by().values("status").annotate(n=Count("pk"))
    for row in rows:
        counts[(row["status"],)] = row["n"]
    return counts


def devices_read() -> dict[tuple[str, ...], int]:
    """The fleet board's totals: one aggregate over the device table and one Redis pipeline
    (without Redis, busy counts only devices with a command in flight, as on the board)."""
    locked = devices_locked()
    states = {
        f"n_{state}": Count("pk", filter=device_state_q(state=state, locked=locked)) for state in FLEET_STATES
    }
    row = Device.objects.order_by().aggregate(**states)
    return {(state,): row[f"n_{state}"] for state in FLEET_STATES}


def runs_stuck_count() -> int:
    """How many runs jobs.waiting.runs_stuck would list without a limit: runs not ended with
    a step at work queued before the cutoff, and pending runs created before it. Two counts
    through the step status index and `jobrun_status_created`."""
    cutoff = timezone.now() - stuck_after()
    stepped = StepRun.objects.filter(
        status__in=STEP_AT_WORK, queued_at__lt=cutoff, run__status__in=RUN_WAITING
    )
    with_steps = stepped.order_by().values("run_id").distinct().count()
    unstarted = (
        JobRun.objects.filter(status=RunStatus.PENDING, created_at__lt=cutoff)
        .exclude(pk__in=stepped.values("run_id"))
        .count()
    )
    return with_steps + unstarted


def runs_stuck_read() -> dict[tuple[str, ...], int]:
    return {(): runs_stuck_count()}


def _inbox_read() -> tuple[int, float]:
    """(entries, age of the oldest in seconds) in one round trip: XLEN and the first entry
    (entries are deleted once applied, so the first is the oldest not applied)."""
    with redis_connection().pipeline(transaction=False) as pipe:
        pipe.xlen(INBOX.key())
        pipe.xrange(INBOX.key(), count=1)
        depth, first = pipe.execute()
    if not first:
        return int(depth), 0.0
    entry_id = first[0][0]
    millis = int((entry_id.decode() if isinstance(entry_id, bytes) else entry_id).split("-")[0])
    return int(depth), max(0.0, time.time() - millis / 1000)


def inbox_entries_read() -> dict[tuple[str, ...], float]:
    return {(): _inbox_read()[0]}


def inbox_oldest_age_read() -> dict[tuple[str, ...], float]:
    return {(): _inbox_read()[1]}


def bridge_last_message_age_read() -> dict[tuple[str, ...], float]:
    """From the heartbeat each running bridge writes every few seconds (iotqueue/health.py):
    one SCAN over the few heartbeat keys (they expire when a bridge stops) and one pipeline."""
    conn = redis_connection()
    prefix = bridge_heartbeat_key("")
    keys = sorted(conn.scan_iter(match=f"{prefix}*", count=100))
    with conn.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.hget(key, "last_message")
        lasts = pipe.execute()
    now = time.time()
    return {
        (key[len(prefix) :],): max(0.0, now - float(last))
        for key, last in zip(keys, lasts, strict=True)
        if last and float(last) > 0
    }


def beat_lease_held_read() -> dict[tuple[str, ...], int]:
    """Whether the beat lease key (iotqueue/beat_lease.py `lease_gate`) names a holder."""
    lease = Lease(
        redis_connection(), redis_key("beat", "lease"), float(settings.IOTQUEUE_BEAT_LEASE_SECONDS), owner=""
    )
    return {(): int(lease.holder() is not None)}


GAUGES = (
    (RUNS_ACTIVE, runs_active_read),
    (STEPS_AT_WORK, steps_at_work_read),
    (DEVICES, devices_read),
    (RUNS_STUCK, runs_stuck_read),
    (INBOX_ENTRIES, inbox_entries_read),
    (INBOX_OLDEST_AGE, inbox_oldest_age_read),
    (BRIDGE_LAST_MESSAGE_AGE, bridge_last_message_age_read),
    (BEAT_LEASE_HELD, beat_lease_held_read),
)


def gauges_register() -> None:
    """Export the jobs app's state gauges on /metrics (called as the app loads)."""
    for family, read in GAUGES:
        gauge_register(family, read)
