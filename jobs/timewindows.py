"""Time windows, as pure arithmetic: maintenance windows (cron + duration + time zone), a
device's quiet hours in its own time zone, and when a command held by them may go.

Nothing here reads the database or a clock: every function takes `now` (an aware
datetime) and the windows as plain values (`WindowSpec`, what a run keeps of a
`MaintenanceWindow`), so the engine asks it without I/O (jobs/engine/holds.py) and the
unit tier tests it directly (tests/unit/jobs/test_timewindows.py).

Reading rules (docs/orchestration.md "Time windows" says them for operators):

- A window opens at every local time its cron expression names in its time zone and stays
  open `minutes` of elapsed time. Day of month and day of week must both match, as Celery's
  crontab (and so django-celery-beat's schedules) reads them.
- A start in the hour a DST change skips opens as much later (02:30 on the spring-forward
  night opens at 03:30); a start in the hour a DST change repeats opens once, the first time.
- Windows that overlap (a duration longer than the gap between two starts) keep it open
  from the first start to the last one's end.
- Quiet hours `start` to `end` are local wall-clock times; `start` later than `end` crosses
  midnight (22:00 to 06:00); equal times mean no quiet hours.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from functools import lru_cache
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from celery.schedules import crontab

# A window longer than a week is no window: the search for its latest start looks back this far.
WINDOW_MAX_MINUTES = 7 * 24 * 60
# How far ahead a window's next opening is searched: eight years covers 29 February on a
# given weekday; a cron that names no date within it (31 February) is refused when saved.
OPENING_SEARCH_DAYS = 8 * 366
# Quiet hours and windows that exclude each other are looked at this many times before
# the engine gives the command the last time found (it is looked at again then).
HOLD_ROUNDS = 16


@dataclass(frozen=True)
class WindowSpec:
    """A maintenance window as a run keeps it: `group` / `label` say which devices it is for
    ("" / None: every device of the run; a template's windows are for all of its runs)."""

    name: str
    cron: str
    minutes: int
    tz: str
    group: str = ""
    label: tuple[str, str] | None = None

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "cron": self.cron,
            "minutes": self.minutes,
            "tz": self.tz,
            "group": self.group,
            "label": list(self.label) if self.label else None,
        }

    @classmethod
    def from_dict(cls, data: dict) -> WindowSpec:
        label = data.get("label")
        return cls(
            data["name"],
            data["cron"],
            int(data["minutes"]),
            data["tz"],
            data.get("group") or "",
            tuple(label) if label else None,
        )


@dataclass(frozen=True)
class QuietHours:
    start: time
    end: time
    tz: str


@dataclass(frozen=True)
class Hold:
    """Why a command waits and until when: `window` names the maintenance window it waits
    for (empty for quiet hours)."""

    until: datetime
    reason: str  # "window" or "quiet_hours"
    window: str = ""


@dataclass(frozen=True)
class Cron:
    """The sets a five-field cron expression names (celery's crontab parses them)."""

    minutes: tuple[int, ...]
    hours: tuple[int, ...]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 = Sunday, as cron

    def day_matches(self, day: date) -> bool:
        return day.month in self.months and day.day in self.days and (day.weekday() + 1) % 7 in self.weekdays


@lru_cache(maxsize=256)
def cron_parse(expression: str) -> Cron:
    """The five fields of `expression` (minute hour day-of-month month day-of-week);
    ValueError saying what is wrong."""
    fields = expression.split()
    if len(fields) != 5:
        raise ValueError(f"a cron expression has 5 fields (minute hour day month weekday), not {len(fields)}")
    minute, hour, day, month, weekday = fields
    parsed = crontab(minute=minute, hour=hour, day_of_month=day, month_of_year=month, day_of_week=weekday)
    return Cron(
        tuple(sorted(parsed.minute)),
        tuple(sorted(parsed.hour)),
        frozenset(parsed.day_of_month),
        frozenset(parsed.month_of_year),
        frozenset(parsed.day_of_week),
    )


@lru_cache(maxsize=256)
def zone(name: str) -> ZoneInfo:
    """The IANA time zone `name`; ValueError when there is none."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"unknown time zone {name!r} (an IANA name such as Europe/Berlin)") from None


def _day_starts(cron: Cron, tz: ZoneInfo, day: date) -> list[datetime]:
    """The window's starts on a local date, in UTC and in order."""
    if not cron.day_matches(day):
        return []
    # fold=0: a skipped local time is read with the offset before the change (it opens as
    # much later), a repeated one the first time it occurs.
    starts = [
        datetime(day.year, day.month, day.day, h, m, tzinfo=tz).astimezone(UTC)
        for h in cron.hours
        for m in cron.minutes
    ]
    return sorted(starts)


def window_open(window: WindowSpec, now: datetime) -> datetime | None:
    """When the opening of `window` that holds `now` closes (the latest start's: a later
    start that overlaps it keeps the window open longer), or None when it is closed."""
    cron, tz = cron_parse(window.cron), zone(window.tz)
    length = timedelta(minutes=window.minutes)
    local = now.astimezone(tz).date()
    latest = None
    day = local
    # The latest start at or before now; starts before now - length cannot hold now.
    while day >= (now - length).astimezone(tz).date() - timedelta(days=1):
        earlier = [start for start in _day_starts(cron, tz, day) if start <= now]
        if earlier:
            latest = earlier[-1]
            break
        day -= timedelta(days=1)
    if latest is None or latest + length <= now:
        return None
    return latest + length


def window_next_start(window: WindowSpec, after: datetime) -> datetime | None:
    """The first start of `window` later than `after`, or None within OPENING_SEARCH_DAYS."""
    cron, tz = cron_parse(window.cron), zone(window.tz)
    day = after.astimezone(tz).date() - timedelta(days=1)  # a DST shift may move a start across midnight
    for _ in range(OPENING_SEARCH_DAYS):
        for start in _day_starts(cron, tz, day):
            if start > after:
                return start
        day += timedelta(days=1)
    return None


def windows_wait(windows: list[WindowSpec], now: datetime) -> Hold | None:
    """None when one of `windows` is open now (or there are none); else the earliest next
    opening, naming its window."""
    if not windows:
        return None
    openings = []
    for window in windows:
        if window_open(window, now) is not None:
            return None
        start = window_next_start(window, now)
        if start is not None:
            openings.append((start, window.name))
    if not openings:
        # A window that never opens again holds its commands for good; they time out in the queue.
        return Hold(now + timedelta(days=OPENING_SEARCH_DAYS), "window", windows[0].name)
    start, name = min(openings)
    return Hold(start, "window", name)


def quiet_wait(quiet: QuietHours | None, now: datetime) -> Hold | None:
    """When `now` is in the quiet hours, the end of them; else None."""
    if quiet is None or quiet.start == quiet.end:
        return None
    tz = zone(quiet.tz)
    local = now.astimezone(tz)
    clock = local.time().replace(tzinfo=None)
    if quiet.start < quiet.end:
        inside = quiet.start <= clock < quiet.end
    else:
        inside = clock >= quiet.start or clock < quiet.end
    if not inside:
        return None
    day = local.date() if clock < quiet.end else local.date() + timedelta(days=1)
    until = datetime.combine(day, quiet.end, tzinfo=tz).astimezone(UTC)
    while until <= now:  # a DST change moved the local end before now
        day += timedelta(days=1)
        until = datetime.combine(day, quiet.end, tzinfo=tz).astimezone(UTC)
    return Hold(until, "quiet_hours")


def hold_until(windows: list[WindowSpec], quiet: QuietHours | None, now: datetime) -> Hold | None:
    """Whether a command may go now: None, or the first time at which it is outside its
    quiet hours and inside one of its windows (the reason is what holds it now)."""
    first = quiet_wait(quiet, now) or windows_wait(windows, now)
    if first is None:
        return None
    at = first.until
    for _ in range(HOLD_ROUNDS):
        later = quiet_wait(quiet, at) or windows_wait(windows, at)
        if later is None:
            break
        at = later.until
    return Hold(at, first.reason, first.window)
