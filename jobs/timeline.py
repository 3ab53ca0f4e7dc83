"""Reading a run's timeline for people: step rows with waits and durations, the latest events.

The admin's run page (and its live refresh) renders what `run_timeline` returns. It reads
with a fixed number of queries whatever the run's size, and caps what it shows, so a
rollout to thousands of devices still renders in a blink every refresh.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Count, Subquery
from django.utils import timezone

from .models import STEP_IN_FLIGHT, JobRun, Phase, RunEvent, StepRun, StepStatus
from .services import plan_step_target

# A fan-out run has one row per device (scenario 4's rollout: ~2,000). The page lists this
# many; the plan overview still counts all of them and the step-run list has the rest.
STEP_ROWS_SHOWN = 500
# Every transition and every stray message is an event: a long rollout has thousands. The
# page shows the latest ones; the run-event list has all.
EVENTS_SHOWN = 500
# Results, arguments and errors share a table cell; longer ones are cut (full text on hover).
CELL_CHARS = 160

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
    counts: list[tuple[str, int]]
    current: bool


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


@dataclass(frozen=True)
class EventLine:
    event: RunEvent
    tone: str
    offset: str


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

    @property
    def steps_hidden(self) -> int:
        return self.steps_total - len(self.steps)

    @property
    def events_hidden(self) -> int:
        return self.events_total - len(self.events)


def run_timeline(run: JobRun) -> Timeline:
    """Everything the run page shows below the run's fields, in six queries."""
    now = timezone.now()
    counts = _status_counts(run)
    rows = list(StepRun.objects.filter(run=run).select_related("device").order_by("id")[:STEP_ROWS_SHOWN])
    events, events_total = _events_latest(run, now)
    return Timeline(
        run=run,
        plan=_plan_lines(run, counts),
        steps=[_step_line(run, row, now) for row in rows],
        steps_total=sum(counts.values()),
        events=[
            EventLine(event, event_tone(event.kind), duration_format(event.created_at - run.created_at))
            for event in events
        ],
        events_total=events_total,
        elapsed=duration_format((run.finished_at or now) - (run.started_at or run.created_at)),
        retried_as=JobRun.objects.filter(retry_of=run).values_list("pk", flat=True).first(),
        now=now,
    )


def event_tone(kind: str) -> str:
    """'attention' for refused / undelivered messages and interventions, 'failure', or ''."""
    if kind in ATTENTION_KINDS:
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
        return f"{seconds:.2f} s"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, seconds = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def json_compact(value: Any) -> str:
    if value is None or value == {}:
        return ""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def cell_cut(text: str) -> str:
    return text if len(text) <= CELL_CHARS else text[: CELL_CHARS - 1] + "…"


def _status_counts(run: JobRun) -> Counter:
    """Rows per (phase, index, status), counted in the database: a fan-out may have thousands."""
    counts: Counter = Counter()
    for item in StepRun.objects.filter(run=run).values("phase", "index", "status").annotate(n=Count("id")):
        counts[(item["phase"], item["index"], item["status"])] = item["n"]
    return counts


def _plan_lines(run: JobRun, counts: Counter) -> list[PlanLine]:
    lines = []
    for index, spec in enumerate(run.plan):
        by_status = sorted(
            (status, n) for (phase, i, status), n in counts.items() if phase == Phase.FORWARD and i == index
        )
        undo = sum(n for (phase, i, _), n in counts.items() if phase == Phase.COMPENSATION and i == index)
        if undo:
            by_status.append(("compensations", undo))
        lines.append(
            PlanLine(
                index=index,
                label=spec.get("name") or spec.get("action") or spec.get("kind", ""),
                target=plan_step_target(spec),
                counts=by_status,
                current=not run.is_terminal and index == run.cursor,
            )
        )
    return lines


def _step_line(run: JobRun, row: StepRun, now: datetime) -> StepLine:
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
