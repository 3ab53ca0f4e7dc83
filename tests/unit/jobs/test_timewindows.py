"""The time windows' arithmetic (jobs/timewindows.py): maintenance windows, quiet hours."""

from datetime import UTC, datetime, time, timedelta
from zoneinfo import ZoneInfo

import pytest

from jobs.timewindows import (
    Hold,
    QuietHours,
    WindowSpec,
    cron_parse,
    hold_until,
    quiet_wait,
    window_next_start,
    window_open,
    windows_wait,
    zone,
)

BERLIN = ZoneInfo("Europe/Berlin")


def at(*args, tz=BERLIN) -> datetime:
    return datetime(*args, tzinfo=tz)


def test_a_window_is_open_from_its_start_for_its_duration():
    # given a window every night at 02:00 Berlin time for 3 hours
    nightly = WindowSpec("nightly", "0 2 * * *", 180, "Europe/Berlin")

    # then it is open from 02:00 to 05:00 local, closed before and after
    assert window_open(nightly, at(2026, 6, 10, 2, 0)) == at(2026, 6, 10, 5, 0)
    assert window_open(nightly, at(2026, 6, 10, 4, 59)) == at(2026, 6, 10, 5, 0)
    assert window_open(nightly, at(2026, 6, 10, 5, 0)) is None
    assert window_open(nightly, at(2026, 6, 10, 1, 59)) is None
    # and closed, the next opening is tonight's or tomorrow's 02:00
    assert window_next_start(nightly, at(2026, 6, 10, 1, 0)) == at(2026, 6, 10, 2, 0)
    assert window_next_start(nightly, at(2026, 6, 10, 12, 0)) == at(2026, 6, 11, 2, 0)


def test_a_window_crossing_midnight_is_open_on_both_sides():
    # given a window from 22:00 for 8 hours (until 06:00 the next morning)
    night = WindowSpec("night", "0 22 * * *", 8 * 60, "Europe/Berlin")

    # then it is open at 23:30 and at 05:30, closed at 06:00
    assert window_open(night, at(2026, 6, 10, 23, 30)) == at(2026, 6, 11, 6, 0)
    assert window_open(night, at(2026, 6, 11, 5, 30)) == at(2026, 6, 11, 6, 0)
    assert window_open(night, at(2026, 6, 11, 6, 0)) is None
    assert windows_wait([night], at(2026, 6, 11, 6, 0)) == Hold(at(2026, 6, 11, 22, 0), "window", "night")


def test_a_duration_longer_than_the_gap_keeps_the_window_open():
    # given a window opening every hour and lasting 90 minutes (overlapping the next)
    overlapping = WindowSpec("overlap", "0 * * * *", 90, "UTC")

    # then it is open at every moment, each start keeping it open 90 minutes
    for minute in range(0, 24 * 60, 7):
        now = datetime(2026, 6, 10, tzinfo=UTC) + timedelta(minutes=minute)
        assert window_open(overlapping, now) is not None
    assert windows_wait([overlapping], datetime(2026, 6, 10, 3, 45, tzinfo=UTC)) is None


def test_the_spring_forward_gap_opens_as_much_later():
    # given a window at 02:30 Berlin time; on 29 March 2026 clocks jump from 02:00 to 03:00
    window = WindowSpec("gap", "30 2 * * *", 60, "Europe/Berlin")

    # then that night it opens at 03:30 local (01:30 UTC), still for one hour
    start = window_next_start(window, at(2026, 3, 29, 0, 0))
    assert start == datetime(2026, 3, 29, 1, 30, tzinfo=UTC)
    assert start.astimezone(BERLIN).hour == 3
    assert window_open(window, datetime(2026, 3, 29, 2, 29, tzinfo=UTC)) is not None
    assert window_open(window, datetime(2026, 3, 29, 2, 30, tzinfo=UTC)) is None


def test_the_repeated_hour_of_fall_back_opens_once():
    # given a window at 02:30 Berlin time; on 25 October 2026 02:00-03:00 occurs twice
    window = WindowSpec("fold", "30 2 * * *", 30, "Europe/Berlin")

    # then it opens once, the first time (00:30 UTC), and next on the 26th
    first = window_next_start(window, at(2026, 10, 25, 0, 0))
    assert first == datetime(2026, 10, 25, 0, 30, tzinfo=UTC)
    assert window_next_start(window, first) == datetime(2026, 10, 26, 1, 30, tzinfo=UTC)
    # and its duration is elapsed time: 30 minutes after the first 02:30 it is closed
    assert window_open(window, datetime(2026, 10, 25, 1, 0, tzinfo=UTC)) is None


def test_day_of_month_and_weekday_must_both_match():
    # given a window on weekdays at 09:00 in New York
    weekdays = WindowSpec("weekdays", "0 9 * * mon-fri", 60, "America/New_York")

    # then from a Friday afternoon (12 June 2026) it next opens on Monday 09:00 local
    friday = datetime(2026, 6, 12, 15, 0, tzinfo=ZoneInfo("America/New_York"))
    assert window_next_start(weekdays, friday) == datetime(
        2026, 6, 15, 9, 0, tzinfo=ZoneInfo("America/New_York")
    )


def test_the_earliest_opening_of_several_windows_is_named():
    # given two closed windows, one opening at 20:00 and one at 18:00 UTC
    now = datetime(2026, 6, 10, 12, 0, tzinfo=UTC)
    late = WindowSpec("late", "0 20 * * *", 60, "UTC")
    early = WindowSpec("early", "0 18 * * *", 60, "UTC")

    # then a command waits for the earlier one; one open window is enough
    assert windows_wait([late, early], now) == Hold(
        datetime(2026, 6, 10, 18, 0, tzinfo=UTC), "window", "early"
    )
    assert windows_wait([late, WindowSpec("now", "0 12 * * *", 5, "UTC")], now) is None
    assert windows_wait([], now) is None


def test_quiet_hours_in_the_devices_own_time_zone():
    # given a store in Tokyo quiet 08:00-21:00 local
    tokyo = QuietHours(time(8, 0), time(21, 0), "Asia/Tokyo")

    # then at 03:00 UTC (12:00 in Tokyo) it is quiet until 21:00 Tokyo (12:00 UTC)
    assert quiet_wait(tokyo, datetime(2026, 6, 10, 3, 0, tzinfo=UTC)) == Hold(
        datetime(2026, 6, 10, 12, 0, tzinfo=UTC), "quiet_hours"
    )
    # and at 13:00 UTC (22:00 in Tokyo) it is not
    assert quiet_wait(tokyo, datetime(2026, 6, 10, 13, 0, tzinfo=UTC)) is None


def test_quiet_hours_crossing_midnight():
    # given quiet hours 22:00-06:00 in Berlin
    night = QuietHours(time(22, 0), time(6, 0), "Europe/Berlin")

    # then 23:00 is quiet until 06:00 the next day, 05:00 until 06:00 that day, 12:00 is not
    assert quiet_wait(night, at(2026, 6, 10, 23, 0)).until == at(2026, 6, 11, 6, 0)
    assert quiet_wait(night, at(2026, 6, 11, 5, 0)).until == at(2026, 6, 11, 6, 0)
    assert quiet_wait(night, at(2026, 6, 11, 12, 0)) is None
    assert quiet_wait(QuietHours(time(8), time(8), "UTC"), at(2026, 6, 11, 8, 0)) is None


def test_a_command_goes_at_the_first_time_outside_quiet_hours_and_inside_a_window():
    # given quiet hours 08:00-21:00 and a window 20:00-23:00, both Berlin time
    quiet = QuietHours(time(8, 0), time(21, 0), "Europe/Berlin")
    evening = WindowSpec("evening", "0 20 * * *", 180, "Europe/Berlin")

    # then at noon it is held by the quiet hours until 21:00 (the window is open by then)
    assert hold_until([evening], quiet, at(2026, 6, 10, 12, 0)) == Hold(at(2026, 6, 10, 21, 0), "quiet_hours")
    # and at 23:30 by the window until 20:00 the next day, then by quiet hours until 21:00
    assert hold_until([evening], quiet, at(2026, 6, 10, 23, 30)) == Hold(
        at(2026, 6, 11, 21, 0), "window", "evening"
    )
    assert hold_until([evening], quiet, at(2026, 6, 10, 22, 0)) is None


@pytest.mark.parametrize(
    ("expression", "problem"),
    [("0 2 * *", "5 fields"), ("61 * * * *", "59"), ("0 2 * * funday", "weekday")],
)
def test_a_bad_cron_expression_says_what_is_wrong(expression, problem):
    with pytest.raises(ValueError, match=problem):
        cron_parse(expression)


def test_an_unknown_time_zone_is_refused():
    with pytest.raises(ValueError, match="unknown time zone"):
        zone("Mars/Olympus")
