"""How an attempt ends, decided before anything is written (jobs/engine/attempts.py): status,
retry back-off and the deadlines it clears and sets."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from jobs.deadlines import Deadline
from jobs.engine.attempts import (
    BACKOFF_MAX_SECONDS,
    attempt_deadlines,
    attempt_outcome,
    backoff_seconds,
)
from jobs.models import JobRun, StepRun, StepStatus

NOW = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)
DRAWS = 200


def in_flight(*, attempt: int, max_attempts: int = 3, backoff: float = 2.0) -> StepRun:
    """An unsaved step row in its `attempt`-th attempt of a one-step plan."""
    run = JobRun(plan=[{"max_attempts": max_attempts, "backoff_seconds": backoff}])
    return StepRun(pk=41, run=run, index=0, attempt=attempt, status=StepStatus.DISPATCHED)


@pytest.mark.parametrize(("attempt", "ceiling"), [(1, 2.0), (2, 4.0), (4, 16.0), (0, 2.0)])
def test_backoff_doubles_per_attempt_with_equal_jitter(attempt, ceiling):
    # when the back-off after an attempt is drawn many times
    delays = [backoff_seconds(2.0, attempt) for _ in range(DRAWS)]

    # then each lies between half and all of base * 2^(attempt-1), spread over that range
    assert all(ceiling / 2 <= delay <= ceiling for delay in delays)
    assert max(delays) - min(delays) > ceiling / 8


def test_backoff_never_exceeds_its_cap():
    delays = [backoff_seconds(1.0, 40) for _ in range(DRAWS)]

    assert all(BACKOFF_MAX_SECONDS / 2 <= delay <= BACKOFF_MAX_SECONDS for delay in delays)


def test_a_successful_attempt_ends_the_row_with_its_result():
    # when a device reports success
    outcome = attempt_outcome(in_flight(attempt=1), ok=True, result={"serial": "SN-1"}, now=NOW)

    # then the row succeeds, finished now, at 100 %, and no retry follows
    assert (outcome.status, outcome.retry) == (StepStatus.SUCCEEDED, False)
    assert outcome.changes == {
        "status": StepStatus.SUCCEEDED,
        "error": "",
        "finished_at": NOW,
        "result": {"serial": "SN-1"},
        "progress": 100,
    }


def test_a_retryable_failure_with_budget_left_retries_after_the_backoff():
    # when the second of three attempts fails retryably
    outcome = attempt_outcome(in_flight(attempt=2), ok=False, error="busy", retryable=True, now=NOW)

    # then the row waits for the third, due after 2 * 2^1 s with jitter, and is not finished
    assert (outcome.status, outcome.retry) == (StepStatus.RETRYING, True)
    assert outcome.changes["finished_at"] is None
    assert NOW + timedelta(seconds=2) <= outcome.changes["deadline"] <= NOW + timedelta(seconds=4)
    assert outcome.message == "busy; retry 3 of 3"


@pytest.mark.parametrize(
    ("attempt", "retryable", "timed_out", "status"),
    [
        (3, True, False, StepStatus.FAILED),  # budget spent
        (3, True, True, StepStatus.TIMED_OUT),
        (1, False, False, StepStatus.FAILED),  # the device said retrying is pointless
    ],
)
def test_a_failure_without_a_retry_ends_the_row(attempt, retryable, timed_out, status):
    outcome = attempt_outcome(
        in_flight(attempt=attempt),
        ok=False,
        error="no done",
        retryable=retryable,
        timed_out=timed_out,
        now=NOW,
    )

    assert (outcome.status, outcome.retry, outcome.message) == (status, False, "no done")
    assert outcome.changes["finished_at"] == NOW and "deadline" not in outcome.changes


def test_an_ended_attempt_clears_its_own_deadlines_and_sets_the_retry_one():
    # given an attempt that ends with a retry
    step_run = in_flight(attempt=2)
    outcome = attempt_outcome(step_run, ok=False, error="busy", retryable=True, now=NOW)

    # when its deadlines are worked out
    cleared, retry = attempt_deadlines(step_run, outcome)

    # then the ack, done and send deadlines of this attempt go, and the retry is due at the back-off
    assert cleared == [Deadline("ack", 41, 2), Deadline("done", 41, 2), Deadline("send", 41, 2)]
    assert retry == {Deadline("retry", 41, 2): outcome.changes["deadline"]}


def test_an_attempt_that_ended_for_good_sets_no_deadline():
    step_run = in_flight(attempt=1)

    _, retry = attempt_deadlines(step_run, attempt_outcome(step_run, ok=True, now=NOW))

    assert retry == {}
