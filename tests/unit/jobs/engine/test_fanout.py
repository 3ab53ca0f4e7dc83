"""Fan-out arithmetic (jobs/engine/rollout_pace.py): how many devices start now, when a rollout
aborts, when the step succeeds, and how failures are grouped. Pumping rows needs the stack."""

from __future__ import annotations

from datetime import timedelta

import pytest

from jobs.engine.rollout_pace import (
    abort_criteria,
    abort_criterion_tripped,
    failure_reason,
    ramp_pace,
    rollout_aborted,
    rollout_rate,
    rollout_room,
    rollout_succeeded,
)


def room(rows=10, max_in_flight=0, in_flight=0, rollout_per_minute=0, started_in_window=0) -> int:
    return rollout_room(
        rows=rows,
        max_in_flight=max_in_flight,
        in_flight=in_flight,
        rollout_per_minute=rollout_per_minute,
        started_in_window=started_in_window,
    )


def test_without_limits_every_row_may_start():
    assert room(rows=10) == 10


def test_max_in_flight_leaves_room_for_what_is_not_at_work():
    # given at most 4 devices at work and 3 working now, then one more may start
    assert room(max_in_flight=4, in_flight=3) == 1


def test_the_rollout_rate_counts_what_started_within_the_window():
    # given 5 devices a minute and 2 started in the last minute, then 3 more may start
    assert room(rollout_per_minute=5, started_in_window=2) == 3


def test_the_tighter_limit_wins():
    assert room(max_in_flight=4, in_flight=0, rollout_per_minute=5, started_in_window=3) == 2
    assert room(rows=1, max_in_flight=4, rollout_per_minute=5) == 1


@pytest.mark.parametrize(
    "limits",
    [{"max_in_flight": 2, "in_flight": 5}, {"rollout_per_minute": 2, "started_in_window": 3}],
)
def test_room_is_never_negative(limits):
    # when more are at work (or started) than a limit that was lowered since allows, then none start
    assert room(**limits) == 0


@pytest.mark.parametrize(
    ("failed", "ended", "aborted"),
    [
        (2, 10, False),  # 20 % is the threshold itself, not past it
        (3, 10, True),
        (1, 1, True),  # one device that ended and failed is 100 %
        (0, 0, False),  # nothing ended yet
    ],
)
def test_a_rollout_aborts_past_the_failure_percent(failed, ended, aborted):
    assert (
        rollout_aborted(failed=failed, ended=ended, abort_failure_percent=20, abort_min_devices=0) is aborted
    )


def test_the_abort_waits_for_the_minimum_number_of_ended_devices():
    # given "abort past 10 %, but only once 5 devices ended"
    def aborted(failed: int, ended: int) -> bool:
        return rollout_aborted(failed=failed, ended=ended, abort_failure_percent=10, abort_min_devices=5)

    # then 4 failures out of 4 do not abort yet, 1 of 5 (20 %) does
    assert not aborted(4, 4)
    assert aborted(1, 5)


def test_without_a_threshold_a_rollout_never_aborts():
    assert not rollout_aborted(failed=10, ended=10, abort_failure_percent=None, abort_min_devices=0)


def test_zero_percent_aborts_on_the_first_failure():
    assert rollout_aborted(failed=1, ended=50, abort_failure_percent=0, abort_min_devices=0)
    assert not rollout_aborted(failed=0, ended=50, abort_failure_percent=0, abort_min_devices=0)


@pytest.mark.parametrize(
    ("succeeded", "total", "percent", "ok"),
    [(10, 10, 100, True), (9, 10, 100, False), (9, 10, 90, True), (8, 10, 90, False), (0, 3, 0, True)],
)
def test_the_step_succeeds_when_the_success_percent_of_all_devices_did(succeeded, total, percent, ok):
    assert rollout_succeeded(succeeded=succeeded, total=total, success_percent=percent) is ok


def test_failures_differing_only_by_device_are_one_reason():
    # when two devices time out alike and a row has no device
    reasons = {
        failure_reason("no done from pump-17 within 30s", "pump-17"),
        failure_reason("no done from pump-18 within 30s", "pump-18"),
    }

    # then the device is folded out, and an error without a device is kept as it is
    assert reasons == {"no done from <device> within 30s"}
    assert failure_reason("refused", None) == failure_reason("refused", "") == "refused"


def rate(counted: int, *, base=120, factor=2.0, every=10, maximum=0) -> int:
    return rollout_rate(base=base, factor=factor, every=every, counted=counted, maximum=maximum)


def test_a_ramp_starts_at_its_base_rate_and_steps_up_per_n_devices():
    # given base 120/min, factor 2, step-up after every 10 devices
    assert [rate(n) for n in (0, 9, 10, 19, 20, 35)] == [120, 120, 240, 240, 480, 960]


def test_a_ramp_is_capped_by_its_maximum_rate():
    assert rate(40, maximum=1000) == 1000
    assert rate(5, maximum=1000) == 120


def test_without_a_factor_or_a_step_the_rate_is_fixed():
    assert rate(50, factor=1.0) == 120
    assert rate(50, every=0) == 120
    assert rate(50, base=0) == 0  # no rate: no limit, whatever the ramp says


def test_a_ramp_never_overflows():
    assert rate(10**9, factor=5.0, every=1, maximum=10_000) == 10_000


@pytest.mark.parametrize(
    ("per_minute", "devices", "seconds"),
    [(120, 2, 1.0), (5, 1, 12.0), (90, 1, 60 / 90), (6000, 100, 1.0)],
)
def test_a_ramp_paces_its_rate_over_windows_of_a_second_or_more(per_minute, devices, seconds):
    assert ramp_pace(per_minute) == (devices, timedelta(seconds=seconds))


def test_the_old_threshold_is_an_any_criterion_after_the_new_ones():
    spec = {
        "abort_criteria": [{"cause": "rejected", "threshold_percent": 5, "min_executed": 10}],
        "abort_failure_percent": 20,
        "abort_min_devices": 4,
    }
    assert abort_criteria(spec) == [
        {"cause": "rejected", "threshold_percent": 5, "min_executed": 10},
        {"cause": "any", "threshold_percent": 20, "min_executed": 4},
    ]
    assert abort_criteria({"abort_failure_percent": None}) == []


def tripped(criteria, executed=10, **by_status):
    return abort_criterion_tripped(criteria=criteria, by_status=by_status, executed=executed)


@pytest.mark.parametrize("cause", ["failed", "rejected", "timed_out"])
def test_a_criterion_counts_only_its_own_cause(cause):
    # given a criterion "more than 20 % of 10 devices" for one cause, and 3 devices of each other cause
    criterion = [{"cause": cause, "threshold_percent": 20, "min_executed": 0}]
    others = {status: 3 for status in ("failed", "rejected", "timed_out") if status != cause}
    # then the others never trip it, 3 of its own do
    assert tripped(criterion, succeeded=4, **others) is None
    hit = tripped(criterion, **{cause: 3}, succeeded=7)
    assert (hit["cause"], hit["count"], hit["executed"], hit["percent"]) == (cause, 3, 10, 30.0)


def test_any_counts_every_cause_and_the_first_criterion_that_trips_is_reported():
    criteria = [
        {"cause": "rejected", "threshold_percent": 50, "min_executed": 0},
        {"cause": "any", "threshold_percent": 20, "min_executed": 0},
    ]
    hit = tripped(criteria, failed=1, rejected=1, timed_out=1, succeeded=7)
    assert (hit["cause"], hit["count"]) == ("any", 3)


def test_a_criterion_waits_for_its_minimum_of_executed_devices():
    criterion = [{"cause": "timed_out", "threshold_percent": 10, "min_executed": 5}]
    assert tripped(criterion, executed=4, timed_out=4) is None
    assert tripped(criterion, executed=5, timed_out=1, succeeded=4)["percent"] == 20.0
