"""The deadline set's members and scores (jobs/deadlines.py); claiming them needs Redis (stack tier)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from devices.locks import lock_shard
from jobs.deadlines import DEVICE_KINDS, KINDS, RUN_KINDS, Deadline, deadline_score


@pytest.mark.parametrize("kind", [kind for kind in KINDS if kind not in RUN_KINDS])
def test_a_member_names_kind_step_row_and_attempt_and_parses_back(kind):
    # given a deadline of any kind
    deadline = Deadline(kind, 1234, 3)

    # when it is written as a set member and read back
    member = deadline.member

    # then the member is "<kind>:<step_run_id>:<attempt>" and parses to an equal deadline
    assert member == f"{kind}:1234:3"
    assert Deadline.parse(member) == deadline


@pytest.mark.parametrize("kind", RUN_KINDS)
def test_a_run_deadline_names_the_run_by_its_uuid(kind):
    # given a run-level deadline (max_duration): its member names a run, not a step row
    deadline = Deadline(kind, "8f0c1b2a-0000-4000-8000-000000000001", 0)

    # then it parses back with the run's id as a string
    assert Deadline.parse(deadline.member) == deadline


def test_a_member_is_unique_per_attempt():
    # a retry's deadline never replaces (or is cleared with) the previous attempt's
    assert Deadline("done", 7, 1).member != Deadline("done", 7, 2).member


@pytest.mark.parametrize("member", ["done:7", "done:7:1:extra", "done:seven:1", "done:7:"])
def test_a_malformed_member_is_a_value_error(member):
    with pytest.raises(ValueError):
        Deadline.parse(member)


def test_the_score_is_the_due_time_in_milliseconds_since_the_epoch():
    # given one instant as seconds since the epoch and as datetimes in two time zones
    seconds = 1_700_000_000.1234
    utc = datetime.fromtimestamp(seconds, UTC)
    berlin = utc.astimezone(timezone(timedelta(hours=1)))

    # then each scores the same whole number of milliseconds, truncated
    assert deadline_score(seconds) == 1_700_000_000_123
    assert deadline_score(utc) == deadline_score(berlin) == 1_700_000_000_123


def test_later_due_times_score_higher():
    # the monitor claims the lowest scores first: earlier deadlines come out first
    now = datetime(2030, 1, 1, tzinfo=UTC)
    assert deadline_score(now) < deadline_score(now + timedelta(milliseconds=1))


@pytest.mark.parametrize("kind", DEVICE_KINDS)
def test_a_step_deadline_is_in_its_device_s_shard_and_the_device_is_not_part_of_it(kind):
    # the lock scripts write a step's deadlines in the call that grants its device's lock
    deadline = Deadline(kind, 7, 1, "lamp-2")
    assert deadline.shard == lock_shard("lamp-2")
    assert deadline == Deadline(kind, 7, 1) and deadline.member == f"{kind}:7:1"


@pytest.mark.parametrize("kind", [kind for kind in KINDS if kind not in DEVICE_KINDS])
def test_other_deadlines_are_in_the_shard_of_their_member(kind):
    deadline = Deadline(kind, 7, 0, "lamp-2")
    assert deadline.shard == lock_shard(deadline.member)
