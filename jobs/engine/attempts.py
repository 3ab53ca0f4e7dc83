"""Ending an attempt: success, failure, rejection, retry or timeout, decided once per attempt.

An attempt ends exactly once: the device's `done` (a refusal, `rejected`, is never
retried), a deadline (no ack / no done in time), an operator force-releasing the lock, or
the lock's lease running out. `attempt_outcome` decides how; the planner
(jobs/engine/planner.py `attempts_end`) writes it as a compare-and-set on the command id
while the step is in flight and releases the device lock to the next waiter. A failed
attempt with budget left goes to `retrying` with an exponential, jittered back-off held in
the deadline set (never a Celery countdown); otherwise the step row ends. While an attempt
is in flight its device may push its deadline out (`attempt_extension`), up to the step's
maximum.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from ..choices import DEFAULT_MAX_EXTEND_SECONDS
from ..deadlines import Deadline
from ..models import StepRun, StepStatus
from .kinds import row_behaviour
from .plan import LEASE_GRACE_SECONDS, step_spec

# Longest back-off between attempts, whatever the step's base and attempt count say.
BACKOFF_MAX_SECONDS = 3600.0
# Deadlines that guard an attempt in flight; all go when it ends.
ATTEMPT_DEADLINES = ("ack", "done", "send")


def backoff_seconds(base: float, attempt: int) -> float:
    """Exponential back-off with "equal jitter": between half and all of base * 2^(n-1)."""
    ceiling = min(BACKOFF_MAX_SECONDS, base * 2 ** max(0, attempt - 1))
    return ceiling / 2 + random.uniform(0, ceiling / 2)


@dataclass(frozen=True)
class Outcome:
    """How an attempt ends: the row's new fields, and whether another attempt follows."""

    status: str
    changes: dict[str, Any]
    retry: bool
    message: str


def attempt_outcome(
    step_run: StepRun,
    *,
    ok: bool,
    result: dict | None = None,
    error: str = "",
    retryable: bool = False,
    rejected: bool = False,
    timed_out: bool = False,
    now: datetime,
) -> Outcome:
    """Decide (without writing) how the in-flight attempt of `step_run` ends.

    `rejected`: the device refused the command; the step ends `rejected`, never retried.
    """
    spec = step_spec(step_run)
    retry = not ok and retryable and not rejected and step_run.attempt < spec["max_attempts"]
    if ok:
        status = StepStatus.SUCCEEDED
    elif rejected:
        status = StepStatus.REJECTED
    elif retry:
        status = StepStatus.RETRYING
    else:
        status = StepStatus.TIMED_OUT if timed_out else StepStatus.FAILED
    changes: dict[str, Any] = {"status": status, "error": error, "finished_at": None if retry else now}
    if ok:
        changes.update(result=result or {}, progress=100)
    if retry:
        changes["deadline"] = now + timedelta(
            seconds=backoff_seconds(spec["backoff_seconds"], step_run.attempt)
        )
    message = error if not retry else f"{error}; retry {step_run.attempt + 1} of {spec['max_attempts']}"
    return Outcome(status, changes, retry, message)


def attempt_deadlines(step_run: StepRun, outcome: Outcome) -> tuple[list[Deadline], dict[Deadline, datetime]]:
    """The deadlines an ended attempt clears, and the retry deadline it sets (if any)."""
    cleared = [Deadline.of(kind, step_run) for kind in ATTEMPT_DEADLINES]
    retry = {Deadline.of("retry", step_run): outcome.changes["deadline"]} if outcome.retry else {}
    return cleared, retry


@dataclass(frozen=True)
class Extension:
    """What a device's `extend_seconds` does to its in-flight attempt: the attempt's new
    `deadline` and the device lock's new `lease_seconds`, or why it is `refused`."""

    deadline: datetime | None = None
    lease_seconds: float = 0.0
    refused: str = ""
    maximum: float = 0.0


def attempt_extension(step_run: StepRun, *, seconds: float, now: datetime) -> Extension:
    """Decide (without writing) how `extend_seconds` moves the in-flight attempt's deadline:
    out to `seconds` from now, never earlier. Bounded per step: the deadline may end at most
    `max_extend_seconds` after the one the attempt was dispatched with; a request past that
    is refused and the deadline stays. The planner (jobs/engine/planner.py) writes it as a
    compare-and-set that requires the attempt still in flight, and moves the Redis `done`
    deadline and the lock's lease with it, so neither the monitor nor lease expiry ends the
    attempt early."""
    spec = step_spec(step_run)
    maximum = spec.get("max_extend_seconds", DEFAULT_MAX_EXTEND_SECONDS)
    original = step_run.dispatched_at + timedelta(seconds=spec["timeout_seconds"])
    deadline = max(step_run.deadline or now, now + timedelta(seconds=seconds))
    beyond = (deadline - original).total_seconds()
    refused = row_behaviour(step_run).extend_refused
    if refused or beyond > maximum:
        past = f"that is {beyond:.0f}s past the attempt's original deadline, the step allows {maximum}s"
        return Extension(refused=refused or past, maximum=maximum)
    lease = (deadline - now).total_seconds() + LEASE_GRACE_SECONDS
    return Extension(deadline=deadline, lease_seconds=lease, maximum=maximum)
