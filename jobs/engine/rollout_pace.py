"""A fan-out's rollout arithmetic: how many rows may start now, the rate and its ramp, when
an abort criterion trips, whether the rollout succeeded. Pure: no query, no write.

The pump (jobs/engine/fanout.py) and a row's end (jobs/engine/fanout_progress.py) ask it
with what they counted; the dashboard, the preview's estimate and the time view ask it too
(jobs/dashboard.py, jobs/estimate.py, jobs/timeview.py), so they read a rollout as the
engine runs it.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from ..choices import AbortCause, RolloutIncrementOn
from ..models import StepStatus

# The window of the rollout rate.
RATE_WINDOW = timedelta(minutes=1)
# A ramp's shortest pacing window: the monitor claims due deadlines once a second, so a
# shorter window would be paced by the tick, not by the rate.
RAMP_SLICE = timedelta(seconds=1)
# Step-ups counted at most: 5 (the largest factor) to this power exceeds any fleet, and the
# bound keeps the power a small number.
RAMP_MAX_STEPS = 64
# Rows that ended without success (what abort criteria count).
FAILING = (StepStatus.FAILED, StepStatus.REJECTED, StepStatus.TIMED_OUT)
# The row statuses each abort cause counts (`any`: every row that ended other than succeeded).
CAUSE_STATUSES = {
    AbortCause.FAILED: (StepStatus.FAILED,),
    AbortCause.REJECTED: (StepStatus.REJECTED,),
    AbortCause.TIMED_OUT: (StepStatus.TIMED_OUT,),
    AbortCause.ANY: (StepStatus.FAILED, StepStatus.REJECTED, StepStatus.TIMED_OUT, StepStatus.CANCELED),
}


def rollout_room(
    *, rows: int, max_in_flight: int, in_flight: int, rollout_per_minute: int, started_in_window: int
) -> int:
    """How many more rows may start now: all of them, less what max-in-flight (rows at work)
    and the rollout rate (rows started within RATE_WINDOW) leave; 0 limits = none."""
    room = rows
    if max_in_flight:
        room = min(room, max_in_flight - in_flight)
    if rollout_per_minute:
        room = min(room, rollout_per_minute - started_in_window)
    return max(0, room)


def rollout_rate(*, base: int, factor: float, every: int, counted: int, maximum: int) -> int:
    """The rollout rate (devices per minute) after `counted` devices succeeded (or were
    notified): `base` times `factor` per `every` of them, at most `maximum` (0 = no maximum).
    A factor of 1 or no `every` is the fixed rate `base`; 0 stays "no limit"."""
    if not base or factor <= 1 or every <= 0:
        return base
    rate = int(base * factor ** min(counted // every, RAMP_MAX_STEPS))
    return min(rate, maximum) if maximum else rate


def ramp_pace(rate: int) -> tuple[int, timedelta]:
    """How a ramp paces `rate` devices a minute: (devices, window) with devices / window ==
    rate, the window no shorter than RAMP_SLICE, so devices go out spread over the minute and
    a step-up shows within seconds (a fixed rate admits its minute's devices at once)."""
    devices = max(1, rate * RAMP_SLICE // RATE_WINDOW)
    return devices, RATE_WINDOW * devices / rate


def rollout_aborted(
    *, failed: int, ended: int, abort_failure_percent: int | None, abort_min_devices: int
) -> bool:
    """One criterion's test: more than `abort_failure_percent` of the rows that ended (skipped
    ones aside) count against it (`failed`), once at least `abort_min_devices` (and one) ended."""
    return (
        abort_failure_percent is not None
        and ended >= max(1, abort_min_devices)
        and failed * 100 > abort_failure_percent * ended
    )


def abort_criteria(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A step's abort criteria in the order they are tested: its `abort_criteria`, then the
    older `abort_failure_percent` / `abort_min_devices` as an `any` criterion."""
    criteria = list(spec.get("abort_criteria") or [])
    if spec.get("abort_failure_percent") is not None:
        criteria.append(
            {
                "cause": AbortCause.ANY.value,
                "threshold_percent": spec["abort_failure_percent"],
                "min_executed": spec.get("abort_min_devices") or 0,
            }
        )
    return criteria


def abort_criterion_tripped(
    *, criteria: list[dict[str, Any]], by_status: Mapping[str, int], executed: int
) -> dict[str, Any] | None:
    """The first criterion past its threshold, with what it counted (`count`, `executed`,
    `percent`); None when the rollout goes on. `executed`: rows that ended, skipped aside."""
    for criterion in criteria:
        count = sum(by_status.get(status, 0) for status in CAUSE_STATUSES[criterion["cause"]])
        if rollout_aborted(
            failed=count,
            ended=executed,
            abort_failure_percent=criterion["threshold_percent"],
            abort_min_devices=criterion.get("min_executed") or 0,
        ):
            percent = round(count * 100 / executed, 1)
            return {**criterion, "count": count, "executed": executed, "percent": percent}
    return None


def rollout_succeeded(*, succeeded: int, total: int, success_percent: int) -> bool:
    """The success criterion, once every row ended: at least `success_percent` of all rows."""
    return succeeded * 100 >= success_percent * total


def failure_reason(error: str, device: str | None) -> str:
    """A row's error with its device name folded out, so one cause counts as one reason:
    "no done from pump-17 within 30s" and "... pump-18 ..." are both "... <device> ..."."""
    return error.replace(device, "<device>") if device else error


def rollout_ramped(spec: Mapping[str, Any]) -> bool:
    """Whether the step's rate steps up (a factor above 1 every so many devices)."""
    return (spec.get("rollout_increment_factor") or 1) > 1 and (spec.get("rollout_increment_every") or 0) > 0


def rollout_pace(spec: Mapping[str, Any], counted: int) -> tuple[int, timedelta]:
    """(devices, window) a step's rollout admits once `counted` devices count towards its
    ramp: the fixed rate per minute, or a ramp's current rate paced by ramp_pace. Pure: the
    pump and the preview's estimate (jobs/estimate.py) both ask it."""
    base = spec.get("rollout_per_minute") or 0
    if not base or not rollout_ramped(spec):
        return base, RATE_WINDOW
    rate = rollout_rate(
        base=base,
        factor=spec["rollout_increment_factor"],
        every=spec["rollout_increment_every"],
        counted=counted,
        maximum=spec.get("rollout_max_per_minute") or 0,
    )
    return ramp_pace(rate)


def rollout_counts_notified(spec: Mapping[str, Any]) -> bool:
    """Whether the ramp counts devices sent the command (else: devices that succeeded)."""
    return spec.get("rollout_increment_on") == RolloutIncrementOn.NOTIFIED
