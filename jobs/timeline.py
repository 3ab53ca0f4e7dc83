"""Reading a run's timeline for people: step rows with waits and durations, the latest events.

The admin's run page (and its live refresh) renders what `run_timeline` returns. It reads
with a fixed number of queries whatever the run's size, and caps what it shows, so a
rollout to thousands of devices still renders in a blink every refresh.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Count, Max, Min, Subquery
from django.db.models.functions import TruncMinute
from django.utils import timezone
from django.utils.translation import gettext as _
from redis import RedisError

from .choices import RolloutIncrementOn
from .engine.plan import spec_is_fanout
from .models import STEP_IN_FLIGHT, STEP_TERMINAL, JobRun, Phase, RunEvent, StepRun, StepStatus
from .services import plan_step_target
from .timeview import (
    MinuteCount,
    Ramp,
    RolloutChart,
    Span,
    StepGroup,
    TimeView,
    clock_ms,
    rollout_chart_build,
    timeview_build,
)
from .waiting import Waiting, event_is_offline_wait, runs_steps_waiting

log = logging.getLogger(__name__)

# A fan-out run has one row per device (scenario 4's rollout: ~2,000). The page lists this
# many; the plan overview still counts all of them and the step-run list has the rest.
STEP_ROWS_SHOWN = 500
# Every transition and every stray message is an event: a long rollout has thousands. The
# page shows the latest ones; the run-event list has all.
EVENTS_SHOWN = 500
# Results, arguments and errors share a table cell; longer ones are cut (full text on hover).
CELL_CHARS = 160
# Fan-out steps given a rollout chart (one grouped query each); a run rarely has more than one.
ROLLOUT_CHARTS_SHOWN = 3

# Messages the system refused or could not deliver, and operator or monitor interventions:
# what explains a surprising run. Highlighted on the run page.
ATTENTION_KINDS = frozenset(
    {
        "reply.stale",
        "reply.unknown",
        "message.dropped",
        "step.device_offline",
        "step.publish_failed",
        "step.extend_refused",
        "step.resent",
        "lock.force_released",
        "lock.reclaimed",
    }
)
FAILURE_SUFFIXES = (".failed", ".rejected", ".timed_out")


@dataclass(frozen=True)
class PlanLine:
    """One step of the run's plan and how its rows stand (a fan-out has many)."""

    index: int
    label: str
    target: str
    counts: list[tuple[str, str, int]]  # (status, its name for people, rows)
    current: bool
    undo: list[tuple[str, str, int]] = field(default_factory=list)  # its compensation rows, as counts


@dataclass(frozen=True)
class StepLine:
    row: StepRun
    max_attempts: int
    wait: str
    duration: str
    args: str
    result: str
    result_full: str
    error: str
    waiting: Waiting | None


@dataclass(frozen=True)
class EventLine:
    event: RunEvent
    tone: str
    offset: str
    clock: str  # to the millisecond: events milliseconds apart must read apart


@dataclass(frozen=True)
class Timeline:
    run: JobRun
    plan: list[PlanLine]
    steps: list[StepLine]
    steps_total: int
    events: list[EventLine]
    events_total: int
    elapsed: str
    retried_as: uuid.UUID | None
    now: datetime
    waiting: Waiting | None  # what the run waits for (its oldest unfinished step's reason)
    waiting_known: bool  # False when the lock Redis could not be read
    timeview: TimeView
    rollouts: list[RolloutChart]

    @property
    def steps_hidden(self) -> int:
        return self.steps_total - len(self.steps)

    @property
    def events_hidden(self) -> int:
        return self.events_total - len(self.events)


def run_timeline(run: JobRun) -> Timeline:
    """Everything the run page shows below the run's fields: six queries, and one more per
    fan-out step charted (at most ROLLOUT_CHARTS_SHOWN)."""
    now = timezone.now()
    counts, groups = _step_stats(run)
    rows = list(StepRun.objects.filter(run=run).select_related("device").order_by("id")[:STEP_ROWS_SHOWN])
    for row in rows:
        row.run = run  # the plan, for the reasons: no query
    events, events_total = _events_latest(run, now)
    run_waiting, steps_waiting, waiting_known = _waiting(run, rows, now)
    return Timeline(
        run=run,
        plan=_plan_lines(run, counts),
        steps=[_step_line(run, row, now, steps_waiting.get(row.pk)) for row in rows],
        steps_total=sum(counts.values()),
        events=[
            EventLine(
                event,
                event_tone(event.kind, event.message),
                duration_format(event.created_at - run.created_at),
                clock_ms(event.created_at),
            )
            for event in events
        ],
        events_total=events_total,
        elapsed=duration_format((run.finished_at or now) - (run.started_at or run.created_at)),
        retried_as=JobRun.objects.filter(retry_of=run).values_list("pk", flat=True).first(),
        now=now,
        waiting=run_waiting,
        waiting_known=waiting_known,
        timeview=timeview_build(
            spans=_spans_of(rows, events),
            groups=groups,
            start=run.created_at,
            end=run.finished_at or now,
            now=now,
        ),
        rollouts=_rollout_charts(run, counts, groups, now),
    )


def event_tone(kind: str, message: str = "") -> str:
    """'attention' for refused / undelivered messages, interventions and steps waiting for
    an offline device (as the event list's attention filter), 'failure', or ''."""
    if kind in ATTENTION_KINDS or event_is_offline_wait(kind, message):
        return "attention"
    if kind.endswith(FAILURE_SUFFIXES):
        return "failure"
    return ""


def duration_format(delta: timedelta | None) -> str:
    """Short human duration: '0.42 s', '12.3 s', '4 min 05 s', '2 h 03 min'."""
    if delta is None:
        return ""
    seconds = max(delta.total_seconds(), 0.0)
    if seconds < 10:
        return _("%(seconds).2f s") % {"seconds": seconds}
    if seconds < 60:
        return _("%(seconds).1f s") % {"seconds": seconds}
    minutes, seconds = divmod(int(seconds), 60)
    if minutes < 60:
        return _("%(minutes)d min %(seconds)02d s") % {"minutes": minutes, "seconds": seconds}
    hours, minutes = divmod(minutes, 60)
    return _("%(hours)d h %(minutes)02d min") % {"hours": hours, "minutes": minutes}


def json_compact(value: Any) -> str:
    if value is None or value == {}:
        return ""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def cell_cut(text: str) -> str:
    return text if len(text) <= CELL_CHARS else text[: CELL_CHARS - 1] + "…"


def _step_stats(run: JobRun) -> tuple[Counter, list[StepGroup]]:
    """Rows per (phase, index, status), and each step's rows as a whole (when the first was
    queued, the last finished), in one grouped query: a fan-out may have thousands."""
    counts: Counter = Counter()
    spans: dict[tuple[str, int], dict] = {}
    items = (
        StepRun.objects.filter(run=run)
        .values("phase", "index", "status")
        .annotate(n=Count("id"), first=Min("queued_at"), last=Max("finished_at"))
        .order_by()
    )
    for item in items:
        key = (item["phase"], item["index"])
        counts[(*key, item["status"])] = item["n"]
        step = spans.setdefault(key, {"started": 0, "first": None, "last": None, "active": False})
        if item["first"] is not None:
            step["started"] += item["n"]
            step["first"] = min(filter(None, (step["first"], item["first"])))
        if item["last"] is not None:
            step["last"] = max(filter(None, (step["last"], item["last"])))
        step["active"] |= item["status"] not in STEP_TERMINAL
    groups = [
        StepGroup(phase=phase, index=index, label=_step_label(run, index), **step)
        for (phase, index), step in sorted(
            spans.items(), key=lambda kv: (kv[0][0] != Phase.FORWARD, kv[0][1])
        )
    ]
    return counts, groups


def _step_label(run: JobRun, index: int) -> str:
    spec = run.plan[index] if index < len(run.plan) else {}
    return spec.get("name") or spec.get("action") or spec.get("kind", "")


def _spans_of(rows: list[StepRun], events: list[RunEvent]) -> list[Span]:
    """The time view's rows; earlier attempts' ends from the `step.retrying` events shown."""
    retried: dict[int, list[datetime]] = {}
    for event in events:
        if event.kind == f"step.{StepStatus.RETRYING}" and event.step_run_id:
            retried.setdefault(event.step_run_id, []).append(event.created_at)
    return [
        Span(
            step_id=row.pk,
            index=row.index,
            phase=row.phase,
            device=row.device.name if row.device_id else "",
            action=row.action,
            status=row.status,
            attempt=row.attempt,
            queued_at=row.queued_at,
            dispatched_at=row.dispatched_at,
            finished_at=row.finished_at,
            retried_at=tuple(retried.get(row.pk, ())),
        )
        for row in rows
    ]


def _rollout_charts(
    run: JobRun, counts: Counter, groups: list[StepGroup], now: datetime
) -> list[RolloutChart]:
    """A chart per fan-out step that has started, from its rows' finish times per minute."""
    charts = []
    for group in groups:
        spec = run.plan[group.index] if group.index < len(run.plan) else {}
        if group.phase != Phase.FORWARD or group.first is None or not spec_is_fanout(spec):
            continue
        if len(charts) == ROLLOUT_CHARTS_SHOWN:
            break
        minutes = _finished_per_minute(run, group.index)
        charts.append(
            rollout_chart_build(
                index=group.index,
                label=group.label,
                ramp=_ramp(spec),
                minutes=minutes,
                start=group.first,
                end=now if group.active or group.last is None else group.last,
                total=sum(
                    n
                    for (phase, i, _status), n in counts.items()
                    if phase == Phase.FORWARD and i == group.index
                ),
            )
        )
    return charts


def _ramp(spec: dict[str, Any]) -> Ramp:
    return Ramp(
        per_minute=spec.get("rollout_per_minute") or 0,
        factor=spec.get("rollout_increment_factor") or 1.0,
        every=spec.get("rollout_increment_every") or 0,
        maximum=spec.get("rollout_max_per_minute") or 0,
        on_notified=spec.get("rollout_increment_on") == RolloutIncrementOn.NOTIFIED,
        max_in_flight=spec.get("max_in_flight") or 0,
    )


def _finished_per_minute(run: JobRun, index: int) -> list[MinuteCount]:
    """One grouped query: the step's rows that finished, per minute and outcome."""
    by_minute: dict[datetime, list[int]] = {}
    items = (
        StepRun.objects.filter(run=run, phase=Phase.FORWARD, index=index, finished_at__isnull=False)
        .exclude(status=StepStatus.SKIPPED)  # never started: the rollout was aborted
        .annotate(minute=TruncMinute("finished_at"))
        .values("minute", "status")
        .annotate(n=Count("id"))
        .order_by()
    )
    for item in items:
        counts = by_minute.setdefault(item["minute"], [0, 0])
        counts[0 if item["status"] == StepStatus.SUCCEEDED else 1] += item["n"]
    return [MinuteCount(minute, ok, bad) for minute, (ok, bad) in sorted(by_minute.items())]


def _plan_lines(run: JobRun, counts: Counter) -> list[PlanLine]:
    lines = []
    for index, spec in enumerate(run.plan):
        by_status = sorted(
            (status, str(StepStatus(status).label).lower(), n)
            for (phase, i, status), n in counts.items()
            if phase == Phase.FORWARD and i == index
        )
        # A rollback's rows by status too: a fan-out's is undone on many devices.
        undo = sorted(
            (status, str(StepStatus(status).label).lower(), n)
            for (phase, i, status), n in counts.items()
            if phase == Phase.COMPENSATION and i == index
        )
        lines.append(
            PlanLine(
                index=index,
                label=_step_label(run, index),
                target=plan_step_target(spec),
                counts=by_status,
                undo=undo,
                current=not run.is_terminal and index == run.cursor,
            )
        )
    return lines


def _waiting(
    run: JobRun, rows: list[StepRun], now: datetime
) -> tuple[Waiting | None, dict[int, Waiting], bool]:
    """Why the run and each of its unfinished rows shown waits (from the rows already read
    and one Redis round trip); nothing, and False, when the lock Redis cannot be read."""
    try:
        by_run, by_row = runs_steps_waiting([run], rows, now=now)
    except RedisError as exc:
        log.warning("run %s shown without waiting reasons: %s", run.pk, exc)
        return None, {}, False
    return by_run.get(run.pk), by_row, True


def _step_line(run: JobRun, row: StepRun, now: datetime, waiting: Waiting | None) -> StepLine:
    spec = run.plan[row.index] if row.index < len(run.plan) else {}
    wait, duration = _spans(row, now)
    result = json_compact(row.result)
    return StepLine(
        row=row,
        max_attempts=spec.get("max_attempts", 1),
        wait=duration_format(wait),
        duration=duration_format(duration),
        args=cell_cut(json_compact(row.args)),
        result=cell_cut(result),
        result_full=result,
        error=cell_cut(row.error),
        waiting=waiting,
    )


def _spans(row: StepRun, now: datetime) -> tuple[timedelta | None, timedelta | None]:
    """(wait, duration) of the row's latest attempt: queued -> dispatched -> finished.

    A span still open counts up to now while the row is in it (waiting, or in flight).
    """
    dispatched = row.dispatched_at
    if dispatched and row.queued_at and dispatched < row.queued_at:
        dispatched = None  # queued again for a retry: that dispatch was an earlier attempt
    wait = duration = None
    if row.queued_at:
        end = dispatched or (now if row.status == StepStatus.QUEUED else row.finished_at)
        wait = end - row.queued_at if end else None
    if dispatched:
        end = row.finished_at or (now if row.status in STEP_IN_FLIGHT else None)
        duration = end - dispatched if end else None
    return wait, duration


def _events_latest(run: JobRun, now: datetime) -> tuple[list[RunEvent], int]:
    """The run's latest events, merged with what its devices sent that matched no run
    (dropped or unknown messages) while it ran; oldest first, and how many there are."""
    own = list(RunEvent.objects.filter(run=run).order_by("-id")[:EVENTS_SHOWN])
    total = run.events.count()
    devices = StepRun.objects.filter(run=run, device__isnull=False).values("device__name")
    strays = list(
        RunEvent.objects.filter(
            run__isnull=True,
            device__in=Subquery(devices),
            created_at__gte=run.created_at,
            created_at__lte=run.finished_at or now,
        ).order_by("-id")[:EVENTS_SHOWN]
    )
    merged = sorted(own + strays, key=lambda event: (event.created_at, event.id))[-EVENTS_SHOWN:]
    return merged, total + len(strays)
