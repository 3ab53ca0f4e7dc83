"""The preview's estimate arithmetic (jobs/estimate.py): a fan-out's pumps replayed with the
engine's rate, ramp and max-in-flight rules, and a step's typical duration."""

import pytest

from jobs.engine.rollout_pace import ramp_pace, rollout_rate
from jobs.estimate import (
    DEFAULT_STEP_SECONDS,
    TICK_PHASES,
    RowTiming,
    fanout_expected_seconds,
    fanout_finish_seconds,
    row_timing,
    typical_seconds,
)

RAMP = {"rollout_per_minute": 10, "rollout_increment_factor": 2, "rollout_increment_every": 5}


def rows(n: int, seconds: float = 2.0) -> list[RowTiming]:
    return [RowTiming(seconds)] * n


def test_without_limits_every_row_starts_at_once():
    assert fanout_finish_seconds({}, rows(100)) == 2.0


def test_a_fixed_rate_starts_its_minutes_devices_together_each_minute():
    # 30 a minute: 100 devices go out at 0, 60, 120 and 180 s; the last ends 2 s later.
    assert fanout_finish_seconds({"rollout_per_minute": 30}, rows(100)) == 182.0


def test_max_in_flight_starts_the_next_row_as_one_ends():
    assert fanout_finish_seconds({"max_in_flight": 10}, rows(100)) == 20.0
    assert fanout_finish_seconds({"max_in_flight": 1}, rows(3, seconds=5)) == 15.0


def test_a_ramp_goes_faster_than_its_base_rate_and_never_faster_than_its_maximum():
    base_only = fanout_finish_seconds({"rollout_per_minute": 10}, rows(100))
    ramped = fanout_finish_seconds(RAMP, rows(100))
    capped = fanout_finish_seconds({**RAMP, "rollout_max_per_minute": 20}, rows(100))
    assert ramped < capped < base_only
    # At the maximum of 20 a minute paced by ramp_pace, 100 devices need at least 4 minutes.
    assert capped >= (100 - 20) * 60 / 20


def test_a_ramp_on_notified_devices_does_not_wait_for_successes():
    slow = rows(50, seconds=30)
    notified = fanout_finish_seconds({**RAMP, "rollout_increment_on": "notified"}, slow)
    succeeded = fanout_finish_seconds(RAMP, slow)
    assert notified < succeeded


def test_rows_that_time_out_do_not_step_a_ramp_up():
    ok = fanout_finish_seconds(RAMP, rows(40))
    failing = fanout_finish_seconds(RAMP, [RowTiming(2.0, succeeds=False)] * 40)
    assert failing > ok


def test_the_replay_paces_as_the_pump_does():
    # The first window admits what ramp_pace admits at the base rate.
    devices, window = ramp_pace(rollout_rate(base=10, factor=2, every=5, counted=0, maximum=0))
    assert (devices, window.total_seconds()) == (1, 6.0)
    assert fanout_finish_seconds(RAMP, rows(2, seconds=0.5)) == pytest.approx(6.5)


def test_a_big_fleet_is_estimated_quickly_and_at_all():
    spec = {**RAMP, "rollout_per_minute": 600, "rollout_max_per_minute": 20_000, "max_in_flight": 500}
    # 500 at work, 2 s each: 250 a second at most once ramped up.
    assert 400 <= fanout_finish_seconds(spec, rows(100_000)) <= 480


def test_the_typical_duration_is_the_recent_median_within_the_timeout():
    assert typical_seconds([1.0, 9.0, 3.0], timeout_seconds=30) == (3.0, "recent_median")
    assert typical_seconds([], timeout_seconds=30) == (DEFAULT_STEP_SECONDS, "default")
    assert typical_seconds([100.0], timeout_seconds=30) == (30.0, "recent_median")


def test_a_row_waits_for_whats_ahead_and_an_unreachable_one_times_out():
    assert row_timing(ahead=2, reachable=True, typical=3.0, queue_timeout=60) == RowTiming(9.0)
    assert row_timing(ahead=0, reachable=False, typical=3.0, queue_timeout=60) == RowTiming(60.0, False)
    assert row_timing(ahead=30, reachable=True, typical=3.0, queue_timeout=60) == RowTiming(60.0, False)


def test_a_pump_waiting_for_its_window_runs_late_by_the_monitors_tick():
    on_time = fanout_finish_seconds(RAMP, rows(3, seconds=0.5))
    late = fanout_finish_seconds(RAMP, rows(3, seconds=0.5), deadline_lateness=0.5)
    assert late == pytest.approx(on_time + 2 * 0.5)  # two waits for a window, each half a tick late


def test_the_expected_finish_is_the_mean_over_where_the_monitors_tick_falls():
    # Given pumps late by 1/8, 3/8, 5/8 and 7/8 of a 1-s tick: the mean of those replays
    on_time = fanout_finish_seconds(RAMP, rows(3, seconds=0.5))
    finishes = [
        fanout_finish_seconds(RAMP, rows(3, seconds=0.5), deadline_lateness=(i + 0.5) / TICK_PHASES)
        for i in range(TICK_PHASES)
    ]
    assert fanout_expected_seconds(RAMP, rows(3, seconds=0.5), tick=1.0) == pytest.approx(sum(finishes) / 4)
    # Two waits for a window, each half a tick late on average; no tick: pumps on time.
    assert fanout_expected_seconds(RAMP, rows(3, seconds=0.5), tick=1.0) == pytest.approx(on_time + 1.0)
    assert fanout_expected_seconds(RAMP, rows(3, seconds=0.5)) == on_time


# bench/preview_eta.py's ramp: 2 a second at first, 1-s windows (ramp_pace), to 20 a second.
BENCH_RAMP = {
    "rollout_per_minute": 120,
    "rollout_increment_factor": 2,
    "rollout_increment_every": 50,
    "rollout_max_per_minute": 1200,
}


def test_a_typical_duration_of_two_windows_does_not_resonate_with_the_replay():
    # Given the default 2 s per command, two of the ramp's 1-s windows, and a hair either side
    replay = {
        s: fanout_finish_seconds(BENCH_RAMP, rows(500, s), deadline_lateness=0.5) for s in (1.99, 2.0, 2.01)
    }
    expected = {s: fanout_expected_seconds(BENCH_RAMP, rows(500, s), tick=1.0) for s in (1.99, 2.0, 2.01)}
    # Then one replay at half a tick late finishes far sooner at exactly 2 s (every row's end
    # meets its window freed at that instant, a tie the engine's pumps never meet) ...
    assert replay[2.0] < 0.9 * min(replay[1.99], replay[2.01])
    # ... and the mean over the tick does not jump there
    assert max(expected.values()) - min(expected.values()) < 0.01 * expected[2.0]
