"""Per-device flow control arithmetic (devices/flow.py): how long the next command waits.

The send times come from Redis in the engine (stack tier); here they are given, newest first.
"""

from __future__ import annotations

import pytest

from devices.flow import WINDOW_SECONDS, device_flow_wait, flow_wait
from devices.models import Device

NOW = 1_000.0


def wait(sent: list[float], *, min_interval_seconds: float = 0, max_per_minute: int = 0) -> float:
    return flow_wait(sent, min_interval_seconds=min_interval_seconds, max_per_minute=max_per_minute, now=NOW)


def test_a_device_that_was_never_sent_to_may_get_a_command_now():
    assert wait([], min_interval_seconds=5, max_per_minute=3) == 0.0


def test_the_minimum_interval_counts_from_the_newest_send():
    # given a 5 s interval and a command sent 2 s ago (and one long before)
    delay = wait([NOW - 2, NOW - 30], min_interval_seconds=5)

    # then the next waits the remaining 3 s
    assert delay == pytest.approx(3.0)


def test_once_the_interval_passed_there_is_no_wait():
    assert wait([NOW - 5.5], min_interval_seconds=5) == 0.0


def test_a_full_minute_waits_until_its_oldest_send_leaves_the_window():
    # given 3 a minute, sent 10 s, 20 s and 45 s ago
    delay = wait([NOW - 10, NOW - 20, NOW - 45], max_per_minute=3)

    # then the next goes when the one from 45 s ago is a minute old
    assert delay == pytest.approx(WINDOW_SECONDS - 45)


def test_fewer_sends_than_the_per_minute_limit_do_not_wait():
    assert wait([NOW - 1, NOW - 2], max_per_minute=3) == 0.0


def test_the_longer_of_both_limits_applies():
    # given 1 s apart and 2 a minute, with sends 0.5 s and 59.8 s ago
    sent = [NOW - 0.5, NOW - 59.8]

    # then the interval (0.5 s more) outlasts the window (0.2 s more)
    assert wait(sent, min_interval_seconds=1, max_per_minute=2) == pytest.approx(0.5)
    assert wait(sent, min_interval_seconds=0.6, max_per_minute=2) == pytest.approx(0.2)


def test_a_device_without_limits_is_not_looked_up_at_all():
    # given a device that declares no limits, when the engine asks, then it answers 0 without Redis
    # (the fast tier refuses every network connection, so reaching Redis would fail this test)
    assert device_flow_wait(Device(name="lamp-1")) == 0.0
