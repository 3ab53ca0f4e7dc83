"""The pure parts of a rollback: how failed compensations read on the run, a rollback's pace."""

from jobs.engine.fanout import fanout_pace
from jobs.engine.rollback import FAILURES_NAMED, compensation_failures
from jobs.engine.rollout_pace import RATE_WINDOW
from jobs.models import Phase

RAMP = {
    "rollout_per_minute": 10,
    "rollout_increment_factor": 2.0,
    "rollout_increment_every": 5,
    "compensation_per_minute": 20,
}


def test_a_step_undone_by_one_row_reads_as_before():
    failed = [(1, "mysql/clean_instance", "mysql-agent", "timed_out", "no done within 1800s")]

    assert compensation_failures(failed, {1: 1}) == [
        "step 1 mysql/clean_instance: timed_out no done within 1800s"
    ]


def test_a_fanouts_failed_rollbacks_name_their_devices_highest_step_first():
    # given a fan-out (step 2) rolled back on 5 devices, 2 of which failed, and step 0 that failed too
    failed = [
        (0, "retract", "hub", "failed", "boom"),
        (2, "firmware/rollback", "gw-09", "timed_out", "no done"),
        (2, "firmware/rollback", "gw-03", "failed", "disk full"),
    ]

    lines = compensation_failures(failed, {0: 1, 2: 5})

    assert lines == [
        "step 2 firmware/rollback: 2 of 5 devices not rolled back: "
        "gw-03 failed disk full; gw-09 timed_out no done",
        "step 0 retract: failed boom",
    ]


def test_a_long_list_of_failed_rollbacks_is_cut_and_counted():
    failed = [(1, "undo", f"gw-{i:03d}", "failed", "") for i in range(FAILURES_NAMED + 5)]

    (line,) = compensation_failures(failed, {1: 100})

    assert line.startswith(
        f"step 1 undo: {FAILURES_NAMED + 5} of 100 devices not rolled back: gw-000 failed;"
    )
    assert line.endswith("; and 5 more") and f"gw-{FAILURES_NAMED:03d}" not in line


def test_a_rollback_is_paced_by_its_own_rate_without_the_ramp():
    # the rollout ramps from 10 a minute; its rollback goes at a fixed 20 a minute
    assert fanout_pace(RAMP, None, Phase.COMPENSATION) == (20, RATE_WINDOW)
    assert fanout_pace({**RAMP, "compensation_per_minute": 0}, None, Phase.COMPENSATION) == (0, RATE_WINDOW)
