"""A rollout on the dashboard (jobs/dashboard.py): the ETA from the ramp of
jobs/engine/rollout_pace.py, the counts and the abort criteria's margins."""

from __future__ import annotations

import itertools
from collections import Counter
from datetime import timedelta

import pytest

from jobs.dashboard import AbortGauge, rollout_eta, rollout_summary
from jobs.engine.rollout_pace import rollout_rate
from jobs.models import JobRun


def minutes(delta: timedelta | None) -> float | None:
    return None if delta is None else delta.total_seconds() / 60


def eta_device_by_device(
    *, pending: int, counted: int, base: int, factor: float, every: int, maximum: int
) -> float:
    """The same estimate the slow way: each device takes 1/rate minutes at the rate the ramp
    gives for the devices counted before it."""
    total = 0.0
    for i in range(pending):
        total += 1 / rollout_rate(base=base, factor=factor, every=every, counted=counted + i, maximum=maximum)
    return total


def test_nothing_pending_is_done_now():
    assert rollout_eta(pending=0, counted=10, base=5, factor=2, every=5, maximum=0) == timedelta(0)


def test_a_fixed_rate_takes_pending_over_rate_minutes():
    assert minutes(
        rollout_eta(pending=100, counted=7, base=50, factor=1, every=0, maximum=0)
    ) == pytest.approx(2)


def test_a_ramp_speeds_up_after_each_step():
    # given 10 a minute, doubled after each 10 devices: 10 at 10/min, 10 at 20/min, 10 at 40/min
    eta = rollout_eta(pending=30, counted=0, base=10, factor=2, every=10, maximum=0)
    assert minutes(eta) == pytest.approx(1 + 0.5 + 0.25)


def test_a_ramp_stops_at_its_maximum_and_starts_mid_level():
    # given 5 counted already (5 more at 10/min), then at most 15/min
    eta = rollout_eta(pending=25, counted=5, base=10, factor=2, every=10, maximum=15)
    assert minutes(eta) == pytest.approx(0.5 + 10 / 15 + 10 / 15)


@pytest.mark.parametrize(
    ("pending", "counted", "base", "factor", "every", "maximum"),
    list(itertools.product((1, 37, 400), (0, 3, 50), (1, 10), (1.0, 1.5, 3.0), (0, 1, 7), (0, 60))),
)
def test_the_estimate_is_the_ramp_device_by_device(pending, counted, base, factor, every, maximum):
    eta = rollout_eta(
        pending=pending, counted=counted, base=base, factor=factor, every=every, maximum=maximum
    )
    expected = eta_device_by_device(
        pending=pending, counted=counted, base=base, factor=factor, every=every, maximum=maximum
    )
    assert minutes(eta) == pytest.approx(expected, rel=1e-6, abs=1e-6)  # timedelta keeps microseconds


def test_a_steep_ramp_over_a_huge_fleet_is_worked_out_in_a_few_steps():
    eta = rollout_eta(pending=10**9, counted=0, base=1, factor=5, every=1, maximum=0)
    assert eta is not None and minutes(eta) < 2


def test_without_a_rate_limit_the_observed_pace_decides_or_nothing_is_known():
    assert (
        minutes(
            rollout_eta(pending=60, counted=0, base=0, factor=1, every=0, maximum=0, observed_per_minute=30)
        )
        == 2
    )
    assert rollout_eta(pending=60, counted=0, base=0, factor=1, every=0, maximum=0) is None


def test_a_gauge_is_armed_once_enough_devices_finished_and_full_at_its_threshold():
    gauge = AbortGauge(
        cause="any", threshold_percent=10, min_executed=100, count=5, executed=50, percent=10.0
    )
    assert not gauge.armed and gauge.closeness == 1.0
    calm = AbortGauge(cause="failed", threshold_percent=20, min_executed=0, count=1, executed=20, percent=5.0)
    assert calm.armed and calm.closeness == 0.25
    strict = AbortGauge(cause="failed", threshold_percent=0, min_executed=0, count=0, executed=3, percent=0.0)
    assert strict.closeness == 0.0


def test_a_rollout_counts_its_rows_and_measures_each_criterion():
    # given a ramped fan-out with two criteria, 40 succeeded, 6 failed, 2 rejected, 4 at work,
    # 48 pending
    spec = {
        "action": "firmware/check",
        "labels": {"site": "berlin"},
        "rollout_per_minute": 10,
        "rollout_increment_factor": 2.0,
        "rollout_increment_every": 20,
        "rollout_max_per_minute": 0,
        "abort_criteria": [{"cause": "failed", "threshold_percent": 25, "min_executed": 10}],
        "abort_failure_percent": 10,
        "abort_min_devices": 100,
    }
    run = JobRun(plan=[spec], cursor=0)
    by_status = Counter(succeeded=40, failed=6, rejected=2, dispatched=3, queued=1, pending=48)

    # when read for the dashboard
    rollout = rollout_summary(run=run, by_status=by_status, started_last_minute=12)

    # then its counts, its rate (40 succeeded: two step-ups, 40/min), its ETA, its criteria
    assert (rollout.total, rollout.succeeded, rollout.failed, rollout.in_flight, rollout.pending) == (
        100,
        40,
        8,
        4,
        48,
    )
    assert rollout.done_percent == 48.0
    assert rollout.rate_per_minute == 40
    assert minutes(rollout.eta) == pytest.approx(20 / 40 + 20 / 80 + 8 / 160)
    assert rollout.target == "labels site=berlin"
    failed, any_cause = rollout.gauges
    assert (failed.cause, failed.count, failed.executed, failed.percent, failed.armed) == (
        "failed",
        6,
        48,
        12.5,
        True,
    )
    assert failed.closeness == pytest.approx(0.5)
    assert (any_cause.cause, any_cause.count, any_cause.percent, any_cause.armed) == ("any", 8, 16.7, False)
