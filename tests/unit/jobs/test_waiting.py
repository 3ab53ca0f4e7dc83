"""The waiting reasons as pure decisions: a row and what was read for it in, a Waiting out."""

import uuid
from datetime import UTC, datetime, timedelta

from devices.locks import LockState
from devices.models import Device
from jobs.engine.plan import step_holder
from jobs.models import JobRun, Phase, StepKind, StepRun, StepStatus
from jobs.waiting import REASONS, WaitFacts, Waiting, row_waiting, run_current_row

NOW = datetime(2026, 11, 26, 14, 10, 0, tzinfo=UTC)
SPEC = {"action": "on", "kind": StepKind.COMMAND, "timeout_seconds": 30, "max_attempts": 3}


def a_row(
    status: str, *, pk: int = 7, spec: dict | None = None, device: Device | None = None, **fields
) -> StepRun:
    run = JobRun(id=uuid.uuid4(), plan=[spec or SPEC], status="running")
    device = device if device is not None else Device(id=1, name="pump-3", online=True, enabled=True)
    row = StepRun(pk=pk, run=run, index=0, device=device, action="on", status=status, **fields)
    return row


def test_a_device_busy_with_another_run_names_it_and_the_queue_position():
    # given a queued row second in the queue behind a step of another run
    row = a_row(StepStatus.QUEUED, queued_at=NOW - timedelta(minutes=2))
    other_run = uuid.uuid4()
    lock = LockState("pump-3", "step:99", 12, None, None, ["step:50", step_holder(row)])
    facts = WaitFacts(locks={"pump-3": lock}, holders={99: (other_run, 1)})

    waiting = row_waiting(row, facts, NOW)

    assert waiting.reason == "device_busy"
    assert (waiting.blocking_run, waiting.blocking_step, waiting.queue_position) == (other_run, 1, 2)
    assert str(other_run)[:8] in waiting.message and "step #1" in waiting.message
    assert waiting.since == row.queued_at


def test_flow_control_says_when_the_next_command_may_go():
    row = a_row(StepStatus.QUEUED, queued_at=NOW)
    later = NOW + timedelta(seconds=20)
    lock = LockState("pump-3", step_holder(row), 3, None, None, [])
    facts = WaitFacts(locks={"pump-3": lock}, due={f"dispatch:{row.pk}:0": later})

    waiting = row_waiting(row, facts, NOW)

    assert (waiting.reason, waiting.until) == ("flow_control", later)


def test_an_offline_device_is_reported_since_it_went_offline():
    went = NOW - timedelta(minutes=8)
    device = Device(id=1, name="pump-3", online=False, enabled=True, last_seen=went)
    row = a_row(StepStatus.QUEUED, device=device, queued_at=NOW - timedelta(minutes=1))

    waiting = row_waiting(row, WaitFacts(), NOW)

    assert (waiting.reason, waiting.since, waiting.device) == ("device_offline", went, "pump-3")
    assert "offline since" in waiting.message


def test_a_device_without_presence_tracking_is_never_offline():
    device = Device(id=1, name="legacy", online=False, presence_required=False, enabled=True)
    row = a_row(StepStatus.QUEUED, device=device, queued_at=NOW)

    assert row_waiting(row, WaitFacts(), NOW).reason == "dispatching"


def test_a_fanout_device_waits_for_max_in_flight_then_for_the_rate():
    spec = {**SPEC, "labels": {"kind": "pump"}, "max_in_flight": 2, "rollout_per_minute": 10}
    row = a_row(StepStatus.PENDING, spec=spec)
    key = (row.run_id, Phase.FORWARD, 0)
    next_start = NOW + timedelta(seconds=6)

    full = row_waiting(row, WaitFacts(fanouts={key: (2, row.pk)}), NOW)
    paced = row_waiting(row, WaitFacts(fanouts={key: (1, row.pk)}, due={f"pump:{row.pk}:0": next_start}), NOW)

    assert full.reason == "rollout_in_flight"
    assert (paced.reason, paced.until) == ("rollout_rate", next_start)


def test_a_rolled_back_fanout_device_waits_for_the_rollbacks_own_rate():
    # given a fan-out's compensation row not started yet, its rollback paced at 2 a minute
    spec = {**SPEC, "labels": {"kind": "gw"}, "compensation_action": "undo", "compensation_per_minute": 2}
    row = a_row(StepStatus.PENDING, spec=spec, phase=Phase.COMPENSATION)
    next_start = NOW + timedelta(seconds=40)
    # the forward rows' counts are another key: they do not answer for it
    facts = WaitFacts(
        fanouts={(row.run_id, Phase.COMPENSATION, 0): (2, row.pk), (row.run_id, Phase.FORWARD, 0): (0, None)},
        due={f"pump:{row.pk}:0": next_start},
    )

    waiting = row_waiting(row, facts, NOW)

    assert (waiting.reason, waiting.until) == ("rollout_rate", next_start)
    assert waiting.message.startswith("Rollback rate")


def test_delay_backoff_working_and_task_steps_say_until_when():
    deadline = NOW + timedelta(minutes=10)
    delay = a_row(
        StepStatus.IN_PROGRESS, spec={"kind": StepKind.DELAY, "delay_seconds": 600}, deadline=deadline
    )
    delay.device = None
    backoff = a_row(StepStatus.RETRYING, attempt=1, deadline=deadline)
    working = a_row(StepStatus.DISPATCHED, attempt=1, dispatched_at=NOW, deadline=deadline)
    task = a_row(StepStatus.DISPATCHED, spec={**SPEC, "kind": StepKind.TASK}, attempt=1, deadline=deadline)

    told = {
        row_waiting(row, WaitFacts(), NOW).reason: row_waiting(row, WaitFacts(), NOW).until
        for row in (delay, backoff, working, task)
    }

    assert told == {
        "delay": deadline,
        "retry_backoff": deadline,
        "device_working": deadline,
        "task_step": deadline,
    }


def test_every_reason_has_a_meaning_and_the_dict_is_json_safe():
    waiting = Waiting(
        "device_busy", "m", device="d", since=NOW, blocking_run=uuid.UUID(int=1), queue_position=1
    )
    assert waiting.as_dict()["since"] == NOW.isoformat()
    assert waiting.as_dict()["blocking_run"] == str(uuid.UUID(int=1))
    assert all(REASONS.values())


def test_a_run_is_told_by_its_oldest_row_at_work_else_its_first_pending_row():
    old = a_row(StepStatus.QUEUED, pk=3, queued_at=NOW - timedelta(minutes=5))
    new = a_row(StepStatus.DISPATCHED, pk=2, queued_at=NOW - timedelta(minutes=1))
    pending = [a_row(StepStatus.PENDING, pk=9), a_row(StepStatus.PENDING, pk=8)]
    done = a_row(StepStatus.SUCCEEDED, pk=1, queued_at=NOW - timedelta(hours=1))

    assert run_current_row([new, old, done, *pending]) is old
    assert run_current_row([done, *pending]).pk == 8
    assert run_current_row([done]) is None
