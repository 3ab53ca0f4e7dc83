"""A run's time view: its steps as bars on device lanes over time, and each fan-out step's
rollout chart (devices finished per minute against the rate its ramp plans), as shapes for
an inline SVG (templates/admin/jobs/jobrun/timeview.html).

Pure functions from rows to geometry, no query and no server: jobs/timeline.py reads the
rows within its fixed handful of queries and the template only draws what comes out. Sizes
are bounded whatever the run's size: at most LANES_SHOWN device lanes (the rest of a
fan-out is drawn as one lane per step, and the view says so) and ROLLOUT_BARS_MAX bars.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.utils import timezone
from django.utils.translation import gettext as _
from django.utils.translation import ngettext

from .engine.rollout_pace import rollout_rate
from .models import STEP_IN_FLIGHT, Phase, StepStatus

# SVG user units; the drawing scales to the width of the page (CSS), so these are
# proportions: a 1100-unit view fills a 1280-px window's content column without scrolling.
WIDTH = 1100
# Lane names (device names are up to 128 characters: cut to LABEL_CHARS).
LABEL_WIDTH = 180
LABEL_CHARS = 26
RIGHT_PAD = 14
AXIS_HEIGHT = 22
LANE_HEIGHT = 20
BAR_HEIGHT = 12
# A segment shorter than this is widened to it, so an instant step is still seen.
MIN_SEGMENT = 2.0
# Device lanes drawn one by one; a fan-out to 2,000 devices would be a page of lanes. The
# rest is drawn as one lane per step, with how many devices it stands for.
LANES_SHOWN = 30
# About this many time ticks on an axis.
TICKS_WANTED = 8
# Tick steps in seconds, from a millisecond (steps milliseconds apart) to a day.
TICK_STEPS = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5,
    1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400,
)  # fmt: skip
# The rollout chart: at most this many bars (a six-hour rollout has 360 minutes; bars then
# stand for several minutes each, as the average per minute).
ROLLOUT_BARS_MAX = 120
CHART_HEIGHT = 150
CHART_LEFT = 48
CHART_TOP = 10
CHART_BOTTOM = 22
# Statuses in which a row still counts up to now.
OPEN_QUEUED = (StepStatus.PENDING, StepStatus.QUEUED)


@dataclass(frozen=True)
class Span:
    """What the time view needs of one step row: its latest attempt's times, and when its
    earlier attempts ended and were retried (from the run's `step.retrying` events)."""

    step_id: int
    index: int
    phase: str
    device: str  # "" for a step without a device (delay, task)
    action: str
    status: str
    attempt: int
    queued_at: datetime | None
    dispatched_at: datetime | None
    finished_at: datetime | None
    retried_at: tuple[datetime, ...] = ()


@dataclass(frozen=True)
class StepGroup:
    """All the rows of one step (a fan-out has one per device), counted by the database."""

    phase: str
    index: int
    label: str
    started: int  # rows that were queued at least once
    first: datetime | None  # the earliest queued_at
    last: datetime | None  # the latest finished_at
    active: bool  # rows still waiting or at work


@dataclass(frozen=True)
class Rect:
    x: float
    y: float
    width: float
    height: float
    cls: str
    title: str = ""


@dataclass(frozen=True)
class Mark:
    """A point event on a bar (a retry, a compensation's start): drawn as a small diamond."""

    x: float
    y: float
    cls: str
    title: str

    @property
    def points(self) -> str:
        h = BAR_HEIGHT / 2
        corners = ((self.x, self.y - h), (self.x + h, self.y), (self.x, self.y + h), (self.x - h, self.y))
        return " ".join(f"{x:.1f},{y:.1f}" for x, y in corners)


@dataclass(frozen=True)
class Tick:
    at: float  # x for a time axis, y for a value axis
    label: str


@dataclass(frozen=True)
class Lane:
    y: float
    label: str
    title: str
    cls: str = "tv-lane"


@dataclass(frozen=True)
class Bar:
    """One step row on its lane: its segments (queued, dispatched, backoff), its end cap
    and its marks."""

    step_id: int
    cls: str
    title: str
    segments: list[Rect]
    marks: list[Mark] = field(default_factory=list)


@dataclass(frozen=True)
class TimeView:
    width: float
    height: float
    plot_left: float
    plot_right: float
    lanes: list[Lane]
    bars: list[Bar]
    aggregates: list[Rect]
    ticks: list[Tick]
    now_x: float | None
    notes: list[str]


@dataclass(frozen=True)
class Ramp:
    """A fan-out step's pace, from its plan entry (see jobs/engine/rollout_pace.py)."""

    per_minute: int  # 0: no rate limit
    factor: float = 1.0
    every: int = 0
    maximum: int = 0
    on_notified: bool = False
    max_in_flight: int = 0


@dataclass(frozen=True)
class MinuteCount:
    """Rows of a fan-out step that finished within one minute (`minute` is its start)."""

    minute: datetime
    succeeded: int
    failed: int  # ended any other way


@dataclass(frozen=True)
class RolloutChart:
    index: int
    label: str
    width: float
    height: float
    plot_left: float
    plot_right: float
    plot_top: float
    plot_bottom: float
    bars: list[Rect]
    plan_points: str  # an SVG polyline; "" without a rate limit
    y_ticks: list[Tick]
    x_ticks: list[Tick]
    notes: list[str]


# --- the time axis ---------------------------------------------------------------------------


def tick_step(seconds: float, wanted: int = TICKS_WANTED) -> float:
    """The smallest of TICK_STEPS that puts at most `wanted` ticks on a range of `seconds`."""
    for step in TICK_STEPS:
        if seconds / step <= wanted:
            return step
    return TICK_STEPS[-1] * math.ceil(seconds / (TICK_STEPS[-1] * wanted))


def offset_label(seconds: float) -> str:
    """A tick's distance from the run's start: +250 ms, +1.5 s, +2 min, +1 h 30 min."""
    if seconds == 0:
        return "0"
    if seconds < 1:
        return _("+%(ms)d ms") % {"ms": round(seconds * 1000)}
    if seconds < 60:
        return _("+%(s)s s") % {"s": f"{seconds:g}"}
    minutes = int(seconds // 60)
    if minutes < 60:
        if seconds % 60:
            return _("+%(min)d min %(s)d s") % {"min": minutes, "s": int(seconds % 60)}
        return _("+%(min)d min") % {"min": minutes}
    hours, minutes = divmod(minutes, 60)
    if minutes:
        return _("+%(h)d h %(min)d min") % {"h": hours, "min": minutes}
    return _("+%(h)d h") % {"h": hours}


def clock_ms(moment: datetime) -> str:
    """A moment in the current time zone, to the millisecond: 17:08:04.120."""
    local = timezone.localtime(moment)
    return f"{local:%H:%M:%S}.{local.microsecond // 1000:03d}"


def seconds_ms(delta: timedelta) -> str:
    return _("%(s).3f s") % {"s": max(delta.total_seconds(), 0.0)}


class Axis:
    """Maps moments between `start` and `end` onto x from `left` to `right`."""

    def __init__(self, start: datetime, end: datetime, left: float, right: float) -> None:
        self.start = start
        self.seconds = max((end - start).total_seconds(), 0.001)
        self.left, self.right = left, right

    def x(self, moment: datetime) -> float:
        offset = (moment - self.start).total_seconds() / self.seconds
        return self.left + min(max(offset, 0.0), 1.0) * (self.right - self.left)

    def ticks(self) -> list[Tick]:
        step = tick_step(self.seconds)
        count = int(self.seconds // step) + 1
        width = self.right - self.left
        return [
            Tick(self.left + width * i * step / self.seconds, offset_label(i * step)) for i in range(count)
        ]


# --- the lanes -------------------------------------------------------------------------------


def lane_key(span: Span) -> str:
    """A device's lane; a step without a device has a lane of its own."""
    return span.device or f"#{span.index} {span.action}"


def status_name(status: str) -> str:
    """A step status in the active language, as in a sentence."""
    return str(StepStatus(status).label).lower() if status in StepStatus.values else status


def label_cut(text: str) -> str:
    return text if len(text) <= LABEL_CHARS else text[: LABEL_CHARS - 1] + "…"


def timeview_build(
    *,
    spans: Sequence[Span],
    groups: Sequence[StepGroup],
    start: datetime,
    end: datetime,
    now: datetime,
    lanes_shown: int = LANES_SHOWN,
) -> TimeView:
    """The time view of a run from `start` to `end` (now for a run still going).

    `spans` are the rows read one by one (they may be the first few hundred of a fan-out),
    `groups` every step's rows counted as a whole. Rows never queued have no bar. Lanes
    follow the order in which devices were first used; past `lanes_shown` lanes a step's
    other rows become one aggregate lane spanning them all.
    """
    started = sorted((s for s in spans if s.queued_at is not None), key=lambda s: (s.queued_at, s.step_id))
    end = max([end, *(t for s in started for t in (s.queued_at, s.dispatched_at, s.finished_at) if t)])
    axis = Axis(start, end, LABEL_WIDTH, WIDTH - RIGHT_PAD)
    order: dict[str, int] = {}
    for span in started:
        key = lane_key(span)
        if key not in order and len(order) < lanes_shown:
            order[key] = len(order)
    drawn = [s for s in started if lane_key(s) in order]
    lanes = [Lane(_lane_y(i), label_cut(key), key) for key, i in order.items()]
    bars = [_bar(span, _lane_y(order[lane_key(span)]), axis, now) for span in drawn]
    aggregates, notes = _aggregate_lanes(groups, drawn, axis, now, first_lane=len(order))
    for rect in aggregates:
        label = label_cut(rect.title)
        lanes.append(Lane(rect.y - (LANE_HEIGHT - BAR_HEIGHT) / 2, label, rect.title, "tv-lane tv-lane-agg"))
    height = _lane_y(len(lanes)) + (LANE_HEIGHT - BAR_HEIGHT)
    return TimeView(
        width=WIDTH,
        height=height,
        plot_left=axis.left,
        plot_right=axis.right,
        lanes=lanes,
        bars=bars,
        aggregates=aggregates,
        ticks=axis.ticks(),
        now_x=axis.x(now) if now <= end else None,
        notes=notes,
    )


def _lane_y(i: int) -> float:
    return AXIS_HEIGHT + i * LANE_HEIGHT


def _aggregate_lanes(
    groups: Sequence[StepGroup], drawn: Sequence[Span], axis: Axis, now: datetime, *, first_lane: int
) -> tuple[list[Rect], list[str]]:
    """One lane per step whose started rows are not all drawn, spanning its first queue to
    its last finish (to now while some are still at work)."""
    drawn_per_step: dict[tuple[str, int], int] = {}
    for span in drawn:
        drawn_per_step[(span.phase, span.index)] = drawn_per_step.get((span.phase, span.index), 0) + 1
    rects, notes = [], []
    for group in groups:
        more = group.started - drawn_per_step.get((group.phase, group.index), 0)
        if more <= 0 or group.first is None:
            continue
        last = now if group.active or group.last is None else group.last
        x0, x1 = axis.x(group.first), axis.x(max(last, group.first))
        title = ngettext(
            "step %(index)s: %(count)s more device",
            "step %(index)s: %(count)s more devices",
            more,
        ) % {"index": group.index, "count": f"{more:,}"}
        y = _lane_y(first_lane + len(rects)) + (LANE_HEIGHT - BAR_HEIGHT) / 2
        cls = "tv-agg tv-compensation" if group.phase == Phase.COMPENSATION else "tv-agg"
        rects.append(Rect(x0, y, max(x1 - x0, MIN_SEGMENT), BAR_HEIGHT, cls, title))
    if rects:
        notes.append(
            _(
                "Only the first %(lanes)s device lanes are drawn one by one; "
                "the other devices of a step share one lane."
            )
            % {"lanes": first_lane}
        )
    return rects, notes


def _bar(span: Span, lane_y: float, axis: Axis, now: datetime) -> Bar:
    """A row's bar: queued (waiting for the device's lock or presence), then dispatched (at
    the device) or backing off before a retry, then an end cap coloured by its outcome."""
    y = lane_y + (LANE_HEIGHT - BAR_HEIGHT) / 2
    queued, dispatched, finished = span.queued_at, span.dispatched_at, span.finished_at
    if dispatched and queued and dispatched < queued:
        dispatched = None  # queued again for a retry: that dispatch was an earlier attempt
    retries = sorted(span.retried_at)
    segments: list[Rect] = []

    def segment(begin: datetime, until: datetime, kind: str, title: str) -> None:
        x0 = axis.x(begin)
        width = max(axis.x(until) - x0, MIN_SEGMENT)
        segments.append(Rect(x0, y, width, BAR_HEIGHT, f"tv-seg tv-seg-{kind}", title))

    if queued:
        waited = dispatched or finished or (now if span.status in OPEN_QUEUED else queued)
        took = {"at": clock_ms(queued), "took": seconds_ms(waited - queued)}
        segment(queued, waited, "queued", _("queued %(at)s, waited %(took)s") % took)
    if dispatched:
        if finished:
            until = finished
        elif span.status in STEP_IN_FLIGHT:
            until = now
        else:  # retrying: the attempt ended when it was retried
            until = max([dispatched, *(t for t in retries if t >= dispatched)])
        took = {"at": clock_ms(dispatched), "took": seconds_ms(until - dispatched)}
        segment(dispatched, until, "dispatched", _("dispatched %(at)s, at the device %(took)s") % took)
        if span.status == StepStatus.RETRYING:
            segment(until, now, "backoff", _("backing off before attempt %(n)s") % {"n": span.attempt + 1})
    if finished:
        ended = _("%(status)s at %(at)s") % {"status": status_name(span.status), "at": clock_ms(finished)}
        segments.append(
            Rect(axis.x(finished) - 1, y - 1, 2, BAR_HEIGHT + 2, f"tv-end tv-end-{span.status}", ended)
        )
    middle = y + BAR_HEIGHT / 2
    marks = []
    for n, at in enumerate(retries, start=1):
        retried = _("attempt %(n)s ended at %(at)s and was retried") % {"n": n, "at": clock_ms(at)}
        marks.append(Mark(axis.x(at), middle, "tv-mark tv-retry", retried))
    if span.phase == Phase.COMPENSATION and queued:
        undo = _("compensation of step %(index)s") % {"index": span.index}
        marks.append(Mark(axis.x(queued), middle, "tv-mark tv-undo", undo))
    cls = f"tv-bar tv-status-{span.status}"
    if span.phase == Phase.COMPENSATION:
        cls += " tv-compensation"
    if span.attempt > 1:
        cls += " tv-retried"
    title = _("step %(index)s %(action)s on %(lane)s: %(status)s, attempt %(attempt)s") % {
        "index": span.index,
        "action": span.action,
        "lane": span.device or "-",
        "status": status_name(span.status),
        "attempt": span.attempt,
    }
    return Bar(span.step_id, cls, title, segments, marks)


# --- the rollout chart -----------------------------------------------------------------------


def planned_rate(ramp: Ramp, counted: int) -> int:
    """Devices per minute the step's ramp allows after `counted` devices (0: no limit)."""
    return rollout_rate(
        base=ramp.per_minute, factor=ramp.factor, every=ramp.every, counted=counted, maximum=ramp.maximum
    )


# An axis maximum is one of these times a power of ten: quarters of it read as round numbers.
NICE_FACTORS = (1, 1.2, 1.6, 2, 2.4, 3, 4, 5, 6, 8, 10)


def nice_ceiling(value: float) -> float:
    """The smallest of NICE_FACTORS times a power of ten that is at least `value`."""
    if value <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    for factor in NICE_FACTORS:
        if factor * power >= value:
            return float(factor * power)
    return float(10 * power)


def rollout_chart_build(
    *,
    index: int,
    label: str,
    ramp: Ramp,
    minutes: Sequence[MinuteCount],
    start: datetime,
    end: datetime,
    total: int,
) -> RolloutChart:
    """Devices finished per minute (succeeded and otherwise, stacked) from `start` (the
    step's first queue) to `end`, against the rate the step's ramp planned given how many
    had succeeded (or been notified) before each minute. Past ROLLOUT_BARS_MAX minutes a bar
    stands for several minutes, as their average per minute."""
    first = start.replace(second=0, microsecond=0)
    count = max(1, int((end - first).total_seconds() // 60) + 1)
    per_bar = max(1, math.ceil(count / ROLLOUT_BARS_MAX))
    bins = math.ceil(count / per_bar)
    succeeded, failed = [0.0] * bins, [0.0] * bins
    for item in minutes:
        i = int((item.minute - first).total_seconds() // 60) // per_bar
        i = min(max(i, 0), bins - 1)
        succeeded[i] += item.succeeded / per_bar
        failed[i] += item.failed / per_bar
    rates, counted = [], 0.0
    for i in range(bins):
        rates.append(planned_rate(ramp, int(counted)) if ramp.per_minute else 0)
        counted += (succeeded[i] + (failed[i] if ramp.on_notified else 0)) * per_bar
    top = nice_ceiling(max([*(s + f for s, f in zip(succeeded, failed, strict=True)), *rates, 1]) * 1.1)
    left, right = CHART_LEFT, WIDTH - RIGHT_PAD
    plot_top, plot_bottom = CHART_TOP, CHART_HEIGHT - CHART_BOTTOM
    step = (right - left) / bins

    def y(value: float) -> float:
        return plot_bottom - (plot_bottom - plot_top) * value / top

    bars = []
    for i in range(bins):
        x, width = left + i * step + step * 0.1, step * 0.8
        at = clock_ms(first + timedelta(minutes=i * per_bar))[:5]
        ok, bad = succeeded[i], failed[i]
        if ok:
            title = _("%(at)s: %(n)s succeeded a minute") % {"at": at, "n": f"{ok:g}"}
            bars.append(Rect(x, y(ok), width, plot_bottom - y(ok), "tv-rate-bar tv-rate-ok", title))
        if bad:
            title = _("%(at)s: %(n)s failed a minute") % {"at": at, "n": f"{bad:g}"}
            bars.append(Rect(x, y(ok + bad), width, y(ok) - y(ok + bad), "tv-rate-bar tv-rate-failed", title))
    points = ""
    if ramp.per_minute:
        points = " ".join(
            f"{left + i * step + dx:.1f},{y(rate):.1f}" for i, rate in enumerate(rates) for dx in (0, step)
        )
    y_ticks = [Tick(y(top * k / 4), f"{top * k / 4:g}") for k in range(5)]
    x_ticks = _minute_ticks(first, bins * per_bar, left, right)
    notes = [_rollout_note(ramp, total, sum(m.succeeded + m.failed for m in minutes))]
    if per_bar > 1:
        notes.append(_("Each bar is %(n)s minutes, as the average per minute.") % {"n": per_bar})
    return RolloutChart(
        index=index,
        label=label,
        width=WIDTH,
        height=CHART_HEIGHT,
        plot_left=left,
        plot_right=right,
        plot_top=plot_top,
        plot_bottom=plot_bottom,
        bars=bars,
        plan_points=points,
        y_ticks=y_ticks,
        x_ticks=x_ticks,
        notes=notes,
    )


def _minute_ticks(first: datetime, minutes: int, left: float, right: float) -> list[Tick]:
    step = max(1, int(tick_step(minutes * 60) // 60))
    return [
        Tick(left + (right - left) * m / minutes, clock_ms(first + timedelta(minutes=m))[:5])
        for m in range(0, minutes, step)
    ]


def _rollout_note(ramp: Ramp, total: int, finished: int) -> str:
    done = _("%(finished)s of %(total)s devices finished.") % {
        "finished": f"{finished:,}",
        "total": f"{total:,}",
    }
    if not ramp.per_minute:
        return done + " " + _("No rate limit: the line of planned rate is left out.")
    if ramp.factor > 1 and ramp.every > 0:
        plan = _("Planned: %(base)s a minute, times %(factor)s every %(every)s devices, at most %(max)s.") % {
            "base": ramp.per_minute,
            "factor": f"{ramp.factor:g}",
            "every": ramp.every,
            "max": ramp.maximum or "∞",
        }
    else:
        plan = _("Planned: %(base)s a minute.") % {"base": ramp.per_minute}
    if ramp.max_in_flight:
        plan += " " + _("At most %(n)s at work at once.") % {"n": ramp.max_in_flight}
    return f"{done} {plan}"
