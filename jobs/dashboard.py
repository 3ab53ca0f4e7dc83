"""The console's first page, read: the fleet by state, runs by status over time, active
rollouts with their pace and abort margins, recent failures. Reads only.

Every figure comes from one aggregate query or an index range, never a read of the history
row by row: the device counts are one GROUP BY over the device table (the fleet itself,
10,000 rows, not its history); busy devices come from the lock lease index in Redis (one
pipeline, a sorted set per lock shard) and the step rows in flight (`steprun_status_deadline`);
the chart reads the last seven days of runs through `jobrun_created_at`; rollouts read their
step rows through the (run, phase, index, device) constraint. bench/admin_lists.py times it
at 10,000 devices and 1,000,000 step rows.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import date, datetime, time, timedelta
from typing import Any

from django.db import connection
from django.db.models import BooleanField, Count, Q, QuerySet
from django.db.models.expressions import RawSQL
from django.db.models.fields.json import KeyTextTransform
from django.db.models.functions import TruncHour
from django.utils import timezone
from django.utils.translation import gettext as _
from redis import RedisError

from devices.locks import lock_shards, shard_key
from devices.models import Device
from iotqueue.redis_conn import lock_redis_connection

from .choices import AbortCause, RolloutIncrementOn
from .engine.plan import spec_is_fanout
from .engine.rollout_pace import CAUSE_STATUSES, RAMP_MAX_STEPS, RATE_WINDOW, abort_criteria, rollout_rate
from .models import (
    STEP_AT_WORK,
    STEP_IN_FLIGHT,
    STEP_TERMINAL,
    JobRun,
    Phase,
    RolloutState,
    RunStatus,
    StepRun,
    StepStatus,
)
from .models import Rollout as WavesRollout
from .services import devices_from_text

log = logging.getLogger(__name__)

# The fleet board's states, in the order the page shows them.
FLEET_STATES = ("online", "offline", "busy", "idle", "disabled", "total")
# Label values shown per chosen key: a key with more values than this (a serial number, say)
# is no grouping; the rest are summed up in one "other values" row.
LABEL_VALUES_SHOWN = 50
# Label keys offered to group by: a fleet labelled with free-form keys would make the list
# unusable long before this.
LABEL_KEYS_SHOWN = 200
# Run statuses in the chart, in stacking order (bottom first).
CHART_STATUSES = (
    RunStatus.SUCCEEDED,
    RunStatus.RUNNING,
    RunStatus.PENDING,
    RunStatus.FAILED,
    RunStatus.TIMED_OUT,
    RunStatus.CANCELED,
    RunStatus.COMPENSATING,
    RunStatus.COMPENSATED,
)
CHART_HOURS = 24
CHART_DAYS = 7
# Rollouts shown: each costs its share of one GROUP BY over its step rows.
ROLLOUTS_SHOWN = 10
# Recent failures shown, newest first.
FAILURES_SHOWN = 10
FAILED_RUN_STATUSES = (RunStatus.FAILED, RunStatus.TIMED_OUT, RunStatus.COMPENSATED)


# --- the fleet ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class FleetCounts:
    """Devices by state. online + offline + disabled = total; busy and idle count enabled
    devices: busy holds its lock or has a command in flight (online or not), idle is online
    and not busy."""

    online: int = 0
    offline: int = 0
    busy: int = 0
    idle: int = 0
    disabled: int = 0
    total: int = 0

    def __add__(self, other: FleetCounts) -> FleetCounts:
        return FleetCounts(**{state: getattr(self, state) + getattr(other, state) for state in FLEET_STATES})

    def items(self) -> list[tuple[str, int]]:
        return [(state, getattr(self, state)) for state in FLEET_STATES]


@dataclass(frozen=True)
class FleetRow:
    """The counts of the devices whose chosen label has `value` (None: the key is missing)."""

    value: str | None
    counts: FleetCounts


@dataclass(frozen=True)
class FleetBoard:
    label: str | None
    totals: FleetCounts
    rows: list[FleetRow]
    other_values: int  # label values past LABEL_VALUES_SHOWN, summed up in `other`
    other: FleetCounts | None
    label_keys: list[str]
    locks_known: bool  # False: Redis could not be read, busy counts only commands in flight


def devices_locked() -> set[str] | None:
    """The names of the devices whose lock is held, from every shard's lease index (one
    pipeline, a sorted set per shard holding one member per held lock); None when Redis
    cannot be read.

    How it fails: a RedisError is logged and answered with None, so the page still renders.
    """
    try:
        with lock_redis_connection().pipeline(transaction=False) as pipe:
            for shard in range(lock_shards()):
                pipe.zrange(shard_key("leases", shard), 0, -1)
            replies = pipe.execute()
    except RedisError as exc:
        log.warning("dashboard without lock states: %s", exc)
        return None
    return {name for reply in replies for name in reply}


def _steps_in_flight() -> QuerySet:
    # Through steprun_status_deadline (status first): rows in flight are few, whatever the history.
    return StepRun.objects.filter(status__in=STEP_IN_FLIGHT, device__isnull=False).values("device_id")


def device_reachable_q() -> Q:
    """Online, or presence not tracked for the device (Device.reachable)."""
    return Q(online=True) | Q(presence_required=False)


def _device_named(names: list[str]) -> RawSQL:
    """The device's name is one of `names`, given as one parameter: `name IN (...)` would
    carry a placeholder per name (10,000 when every device is busy) into every count."""
    if connection.vendor == "postgresql":
        sql = '"devices_device"."name" = ANY(%s::text[])'
        params: list[Any] = [names]
    else:
        sql = '"devices_device"."name" IN (SELECT value FROM json_each(%s))'
        params = [json.dumps(names)]
    return RawSQL(sql, params, output_field=BooleanField())


def device_busy_q(*, locked: Iterable[str] | None) -> Q:
    """Devices holding their lock (names from `devices_locked`) or with a command in flight."""
    busy = Q(pk__in=_steps_in_flight())
    names = sorted(locked or ())
    return busy | Q(_device_named(names)) if names else busy


def device_state_q(*, state: str, locked: Iterable[str] | None) -> Q:
    """The devices of one fleet board state; ValueError for a state it does not know."""
    enabled = Q(enabled=True)
    if state == "online":
        return enabled & device_reachable_q()
    if state == "offline":
        return enabled & ~device_reachable_q()
    if state == "busy":
        return enabled & device_busy_q(locked=locked)
    if state == "idle":
        return enabled & device_reachable_q() & ~device_busy_q(locked=locked)
    if state == "disabled":
        return Q(enabled=False)
    if state == "total":
        return Q()
    raise ValueError(f"no device state {state!r}")


def device_label_keys() -> list[str]:
    """The label keys devices have, sorted (at most LABEL_KEYS_SHOWN): one pass over the
    device table's labels."""
    if connection.vendor == "postgresql":
        sql = "SELECT DISTINCT jsonb_object_keys(labels) FROM devices_device"
    else:
        sql = "SELECT DISTINCT j.key FROM devices_device, json_each(devices_device.labels) AS j"
    with connection.cursor() as cursor:
        cursor.execute(sql)
        return sorted(row[0] for row in cursor.fetchall())[:LABEL_KEYS_SHOWN]


def fleet_board(*, label: str | None = None) -> FleetBoard:
    """Devices by state, in all and per value of the `label` key: two queries (label keys,
    counts) and one Redis pipeline."""
    locked = devices_locked()
    keys = device_label_keys()
    if label not in keys:
        label = None
    # Aliases apart from the field names: Count(filter=Q(online=...)) must read the column.
    states = {
        f"n_{state}": Count("pk", filter=device_state_q(state=state, locked=locked)) for state in FLEET_STATES
    }
    devices = Device.objects.order_by()
    if label is None:
        counts = _counts(devices.aggregate(**states))
        return FleetBoard(None, counts, [], 0, None, keys, locked is not None)
    # The key as one path element: a key holding "__" is no lookup path.
    value = KeyTextTransform(label, "labels")
    grouped = devices.values(value=value).annotate(**states).order_by("-n_total", "value")
    rows = [FleetRow(group["value"], _counts(group)) for group in grouped]
    totals = sum((row.counts for row in rows), FleetCounts())
    shown, rest = rows[:LABEL_VALUES_SHOWN], rows[LABEL_VALUES_SHOWN:]
    other = sum((row.counts for row in rest), FleetCounts()) if rest else None
    return FleetBoard(label, totals, shown, len(rest), other, keys, locked is not None)


def _counts(row: Mapping[str, Any]) -> FleetCounts:
    return FleetCounts(**{state: row[f"n_{state}"] for state in FLEET_STATES})


# --- runs by status over time ------------------------------------------------------------------


@dataclass(frozen=True)
class StatusBucket:
    """Runs created in [start, start + width), by their status now."""

    start: datetime
    counts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@dataclass(frozen=True)
class RunsChart:
    hours: list[StatusBucket]  # the last CHART_HOURS hours, oldest first, the current one last
    days: list[StatusBucket]  # the last CHART_DAYS days (local time), today last


def _midnight(day: date) -> datetime:
    return timezone.make_aware(datetime.combine(day, time.min))


def runs_by_status(*, now: datetime | None = None) -> RunsChart:
    """Runs by status per hour over the last day and per day over the last week: one query,
    runs of the last week by hour (through the created_at index), summed up by day here."""
    now = timezone.localtime(now)
    this_hour = now.replace(minute=0, second=0, microsecond=0)
    today = now.replace(hour=0, minute=0, second=0, microsecond=0)
    first_day = _midnight(today.date() - timedelta(days=CHART_DAYS - 1))
    first_hour = this_hour - timedelta(hours=CHART_HOURS - 1)
    since = min(first_day, first_hour)
    rows = (
        JobRun.objects.filter(created_at__gte=since)
        .annotate(hour=TruncHour("created_at"))
        .values_list("hour", "status")
        .annotate(n=Count("pk"))
        .order_by()
    )
    by_hour: dict[datetime, Counter] = {}
    for hour, status, n in rows:
        by_hour.setdefault(timezone.localtime(hour), Counter())[status] += n
    hours = [
        StatusBucket(start, dict(by_hour.get(start, Counter())))
        for start in (first_hour + timedelta(hours=h) for h in range(CHART_HOURS))
    ]
    by_day: dict[date, Counter] = {}
    for hour, counts in by_hour.items():
        by_day.setdefault(hour.date(), Counter()).update(counts)
    days = []
    for d in range(CHART_DAYS):
        day = first_day.date() + timedelta(days=d)
        days.append(StatusBucket(_midnight(day), dict(by_day.get(day, Counter()))))
    return RunsChart(hours, days)


# --- active rollouts ---------------------------------------------------------------------------


@dataclass(frozen=True)
class AbortGauge:
    """One abort criterion and how close the rollout is to it."""

    cause: str
    threshold_percent: float
    min_executed: int
    count: int  # finished devices that count against it
    executed: int  # finished devices (skipped aside)
    percent: float  # count / executed, in %

    @property
    def armed(self) -> bool:
        """Tested at all: enough devices finished (the criterion waits for min_executed)."""
        return self.executed >= max(1, self.min_executed)

    @property
    def closeness(self) -> float:
        """How far towards tripping, 0..1 (1: the next failure may trip it)."""
        if self.threshold_percent <= 0:
            return 1.0 if self.count else 0.0
        return min(1.0, self.percent / self.threshold_percent)


@dataclass(frozen=True)
class Rollout:
    run: JobRun
    index: int
    action: str
    target: str
    by_status: Mapping[str, int]
    started_last_minute: int  # devices started (queued) within the rate window
    rate_per_minute: int  # what the ramp allows now; 0 = no limit
    eta: timedelta | None  # until the last pending device is started; None: unknown
    gauges: list[AbortGauge] = field(default_factory=list)
    waves: WavesRollout | None = None  # a fan-out in waves: where its rollout stands

    @property
    def halted(self) -> bool:
        """A rollout in waves that starts no device now: paused, soaking or at a gate."""
        return self.waves is not None and self.waves.state not in (RolloutState.RUNNING, RolloutState.ENDED)

    @property
    def total(self) -> int:
        return sum(self.by_status.values())

    @property
    def succeeded(self) -> int:
        return self.by_status.get(StepStatus.SUCCEEDED, 0)

    @property
    def failed(self) -> int:
        """Devices that failed, were refused, timed out or were canceled."""
        return sum(self.by_status.get(s, 0) for s in CAUSE_STATUSES[AbortCause.ANY])

    @property
    def in_flight(self) -> int:
        return sum(self.by_status.get(s, 0) for s in STEP_AT_WORK)

    @property
    def pending(self) -> int:
        return self.by_status.get(StepStatus.PENDING, 0)

    @property
    def skipped(self) -> int:
        return self.by_status.get(StepStatus.SKIPPED, 0)

    @property
    def done_percent(self) -> float:
        """Devices finished (succeeded, failed or skipped), in % of all."""
        done = self.total - self.in_flight - self.pending
        return round(done * 100 / self.total, 1) if self.total else 0.0


def rollout_eta(
    *,
    pending: int,
    counted: int,
    base: int,
    factor: float,
    every: int,
    maximum: int,
    observed_per_minute: float = 0.0,
) -> timedelta | None:
    """How long until the last of `pending` devices is started, by the ramp of
    jobs/engine/rollout_pace.py: `base` devices a minute, times `factor` after each `every`
    counted devices, at most `maximum` (0: none); `counted` so far.

    It assumes each device started counts towards the next step-up at once (it succeeds, or
    the ramp counts notified devices): an estimate, early by the time devices take. With no
    rate limit (`base` 0) the pace is what was observed over the last minute, and None
    (unknown) when nothing started in it.
    """
    if pending <= 0:
        return timedelta(0)
    if not base:
        if observed_per_minute <= 0:
            return None
        return timedelta(minutes=pending / observed_per_minute)
    minutes = 0.0
    ramped = factor > 1 and every > 0
    while pending > 0:
        rate = rollout_rate(base=base, factor=factor, every=every, counted=counted, maximum=maximum)
        at_top = not ramped or (maximum and rate >= maximum) or counted // every >= RAMP_MAX_STEPS
        batch = pending if at_top else min(pending, every - counted % every)
        minutes += batch / rate
        pending -= batch
        counted += batch
    return timedelta(minutes=minutes)


def _fanout_at_cursor() -> RawSQL:
    """True for a run whose current step fans out (its plan entry at `cursor` targets a
    group, labels, a selector or devices_from): read in SQL, so plans of other running runs
    never leave the database."""
    if connection.vendor == "postgresql":
        entry = "(jobs_jobrun.plan -> jobs_jobrun.cursor::int)"
        sql = (
            f"(coalesce({entry} ->> 'group', '') <> '' OR coalesce({entry} -> 'labels', '{{}}') <> '{{}}' "
            f"OR coalesce({entry} ->> 'selector', '') <> '' "
            f"OR coalesce({entry} -> 'devices_from', '{{}}') <> '{{}}')"
        )
    else:
        entry = "'$[' || jobs_jobrun.cursor || ']'"
        sql = (
            f"(coalesce(json_extract(jobs_jobrun.plan, {entry} || '.group'), '') <> '' "
            f"OR coalesce(json_extract(jobs_jobrun.plan, {entry} || '.labels'), '{{}}') <> '{{}}' "
            f"OR coalesce(json_extract(jobs_jobrun.plan, {entry} || '.selector'), '') <> '' "
            f"OR coalesce(json_extract(jobs_jobrun.plan, {entry} || '.devices_from'), '{{}}') <> '{{}}')"
        )
    return RawSQL(sql, [], output_field=BooleanField())


def _target(spec: Mapping[str, Any]) -> str:
    """A fan-out's devices, for people: its group, labels, selector or earlier step's outcome."""
    if spec.get("devices_from"):
        return devices_from_text(spec["devices_from"])
    if spec.get("group"):
        return _("group %(group)s") % {"group": spec["group"]}
    if spec.get("labels"):
        labels = ",".join(f"{k}={v}" for k, v in spec["labels"].items())
        return _("labels %(labels)s") % {"labels": labels}
    return _("selector %(selector)s") % {"selector": spec.get("selector", "")}


def rollouts_active(*, now: datetime | None = None, limit: int = ROLLOUTS_SHOWN) -> list[Rollout]:
    """Running runs whose current step is a fan-out, newest first, with their rows by status,
    pace, ETA and abort margins: two queries whatever the number of devices."""
    now = now or timezone.now()
    runs = list(
        JobRun.objects.filter(_fanout_at_cursor(), status=RunStatus.RUNNING)
        .select_related("template")
        .order_by("-created_at")[:limit]
    )
    runs = [run for run in runs if spec_is_fanout(run.plan[run.cursor])]
    if not runs:
        return []
    at_cursor = Q()
    for run in runs:
        at_cursor |= Q(run_id=run.pk, index=run.cursor)
    rows = (
        StepRun.objects.filter(at_cursor, phase=Phase.FORWARD)
        .values_list("run_id", "status")
        .annotate(n=Count("pk"), recent=Count("pk", filter=Q(queued_at__gt=now - RATE_WINDOW)))
        .order_by()
    )
    by_run: dict[Any, Counter] = {}
    recent: Counter = Counter()
    for run_id, status, n, started in rows:
        by_run.setdefault(run_id, Counter())[status] = n
        recent[run_id] += started
    # Fan-outs in waves: where each rollout stands (one query, only when one is shown).
    waved = Q()
    for run in runs:
        if run.plan[run.cursor].get("waves"):
            waved |= Q(run_id=run.pk, index=run.cursor)
    waves = {rollout.run_id: rollout for rollout in WavesRollout.objects.filter(waved)} if waved else {}
    return [
        rollout_summary(
            run=run,
            by_status=by_run.get(run.pk, Counter()),
            started_last_minute=recent[run.pk],
            waves=waves.get(run.pk),
        )
        for run in runs
    ]


def rollout_summary(
    *,
    run: JobRun,
    by_status: Mapping[str, int],
    started_last_minute: int,
    waves: WavesRollout | None = None,
) -> Rollout:
    """A running fan-out at the run's cursor, from its rows by status and how many started
    within the rate window (and, in waves, its `Rollout` row): pure, no query."""
    by_status = Counter(by_status)
    spec = run.plan[run.cursor]
    base = spec.get("rollout_per_minute") or 0
    factor = spec.get("rollout_increment_factor") or 1.0
    every = spec.get("rollout_increment_every") or 0
    maximum = spec.get("rollout_max_per_minute") or 0
    if spec.get("rollout_increment_on") == RolloutIncrementOn.NOTIFIED:
        counted = sum(by_status.values()) - by_status[StepStatus.PENDING] - by_status[StepStatus.SKIPPED]
    else:
        counted = by_status[StepStatus.SUCCEEDED]
    rate = rollout_rate(base=base, factor=factor, every=every, counted=counted, maximum=maximum)
    eta = rollout_eta(
        pending=by_status[StepStatus.PENDING],
        counted=counted,
        base=base,
        factor=factor,
        every=every,
        maximum=maximum,
        observed_per_minute=started_last_minute * (timedelta(minutes=1) / RATE_WINDOW),
    )
    executed = sum(by_status[s] for s in STEP_TERMINAL if s != StepStatus.SKIPPED)
    gauges = []
    for criterion in abort_criteria(spec):
        count = sum(by_status[s] for s in CAUSE_STATUSES[criterion["cause"]])
        gauges.append(
            AbortGauge(
                cause=criterion["cause"],
                threshold_percent=criterion["threshold_percent"],
                min_executed=criterion.get("min_executed") or 0,
                count=count,
                executed=executed,
                percent=round(count * 100 / executed, 1) if executed else 0.0,
            )
        )
    return Rollout(
        run=run,
        index=run.cursor,
        action=spec.get("action", ""),
        target=_target(spec),
        by_status=dict(by_status),
        started_last_minute=started_last_minute,
        rate_per_minute=rate,
        eta=eta,
        gauges=gauges,
        waves=waves,
    )


# --- recent failures ---------------------------------------------------------------------------


def runs_failed_recent(*, limit: int = FAILURES_SHOWN) -> list[JobRun]:
    """The newest runs that failed, timed out or were rolled back, with their error.

    One query per status, each the newest `limit` through `jobrun_status_created` (status,
    created_at) read backwards, merged here: a single query with `status IN (...)` walks the
    runs by creation time instead and reads the whole history when failures are rare.
    """
    found = []
    for status in FAILED_RUN_STATUSES:
        found += (
            JobRun.objects.filter(status=status)
            .select_related("template")
            .only("id", "status", "error", "created_at", "finished_at", "cursor", "template__name")
            .order_by("-created_at")[:limit]
        )
    return sorted(found, key=lambda run: run.created_at, reverse=True)[:limit]
