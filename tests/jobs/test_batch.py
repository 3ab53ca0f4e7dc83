"""What batching could break: replies applied together (jobs/engine/batch.py) and the
engine's inbox (jobs/inbox.py) — against the real Redis, broker, worker, bridge and beat.

A batch is driven here by calling the engine's batch entry point in the test process (the
same code a worker runs), so that its contents and the moment of a fault are chosen
exactly; the run around it is started and continued by the real stack.
"""

import json
import logging

import pytest
from django.db import OperationalError, connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from devices.locks import device_lock_extend, device_lock_state
from devices.protocol import Reply
from iotqueue import workstream
from iotqueue.redis_conn import lock_redis_connection, redis_connection
from jobs import inbox
from jobs.cancel import run_cancel
from jobs.deadlines import Deadline, deadlines_key, deadlines_set
from jobs.engine import batch as engine_batch
from jobs.events import EventLog, lifecycle_events
from jobs.limits import limits_enabled
from jobs.models import JobRun, RunEvent, RunStatus, StepRun, StepStatus
from jobs.services import run_start
from tests.conftest import wait_for
from tests.factories import DeviceFactory, template_with_steps

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


def done(command_id: str, ok: bool = True) -> Reply:
    return Reply(kind="done", command_id=command_id, ok=ok, result={"ok": ok})


def two_steps_on_one_device(manual_device):
    """A run of two steps on one hand-driven device, its first command received."""
    device = DeviceFactory()
    hand = manual_device(device.name)
    run, _ = run_start(template=template_with_steps((device, "first", {}), (device, "second", {})))
    first = hand.next_command()
    assert first["step"] == 0
    return device, hand, run, first


def kinds(run: JobRun) -> list[str]:
    return list(RunEvent.objects.filter(run=run).order_by("id").values_list("kind", flat=True))


def test_two_replies_for_one_device_in_one_batch_apply_once(stack, manual_device):
    # given a step in flight on a device
    device, hand, run, first = two_steps_on_one_device(manual_device)

    # when its ack, its done and the same done again arrive in one batch
    ack = Reply(kind="ack", command_id=first["id"])
    engine_batch.transition_apply(
        replies=[(device.name, ack), (device.name, done(first["id"])), (device.name, done(first["id"]))]
    )

    # then the attempt went in progress and ended once, the copy is recorded as stale,
    # and the same device got the next step under a newer fencing token
    step0 = StepRun.objects.get(run=run, index=0)
    assert step0.status == StepStatus.SUCCEEDED and step0.acked_at is not None
    events = kinds(run)
    assert events.count("step.in_progress") == 1 and events.count("step.succeeded") == 1
    assert RunEvent.objects.filter(kind="reply.stale", step_run=step0).count() == 1
    second = hand.next_command()
    step1 = StepRun.objects.get(run=run, index=1)
    assert (second["step"], second["id"], step1.status) == (1, step1.command_id, StepStatus.DISPATCHED)
    assert second["token"] > first["token"]
    assert device_lock_state(device.name).holder == f"step:{step1.pk}"

    # and the run finishes when the device answers the second command
    hand.done(second["id"])
    wait_for(lambda: JobRun.objects.get(pk=run.pk).status == RunStatus.SUCCEEDED, what="the run to succeed")


def test_a_cancel_between_reading_and_writing_a_batch_wins(stack, manual_device, monkeypatch):
    # given a step in flight, and a cancel that lands after the batch read its row
    device, hand, run, first = two_steps_on_one_device(manual_device)
    real_init = engine_batch.Executor.__init__

    def cancel_after_read(self, rows):
        real_init(self, rows)
        if rows:  # the reply batch's read (the cancel is a transition of its own, rows {})
            run_cancel(run=JobRun.objects.get(pk=run.pk), by="tester")

    monkeypatch.setattr(engine_batch.Executor, "__init__", cancel_after_read)

    # when the device's done for that step is applied
    engine_batch.transition_apply(replies=[(device.name, done(first["id"]))])

    # then the cancel stands: nothing of the batch was half applied, the late done is
    # recorded as stale, no next step exists, and the device lock was handed on (free)
    run.refresh_from_db()
    step0 = StepRun.objects.get(run=run, index=0)
    assert (run.status, step0.status) == (RunStatus.CANCELED, StepStatus.CANCELED)
    assert not StepRun.objects.filter(run=run, index=1).exists()
    assert RunEvent.objects.filter(kind="reply.stale", step_run=step0).exists()
    assert device_lock_state(device.name).holder is None
    assert hand.next_command()["action"] == "cancel"


def test_a_conflict_applies_the_batch_again_and_the_other_replies_still_go_together(
    stack, manual_device, monkeypatch
):
    # given two runs with a step in flight each, and a cancel of the second run that lands
    # after the batch read its rows (the first read only)
    device_a, hand_a, run_a, first_a = two_steps_on_one_device(manual_device)
    device_b, _, run_b, first_b = two_steps_on_one_device(manual_device)
    real_init = engine_batch.Executor.__init__
    reads = []

    def cancel_after_first_read(self, rows):
        real_init(self, rows)
        if not rows:
            return  # the cancel's own transition
        reads.append(set(rows))
        if len(reads) == 1:
            run_cancel(run=JobRun.objects.get(pk=run_b.pk), by="tester")

    monkeypatch.setattr(engine_batch.Executor, "__init__", cancel_after_first_read)

    # when both devices' dones arrive in one batch
    engine_batch.transition_apply(
        replies=[(device_a.name, done(first_a["id"])), (device_b.name, done(first_b["id"]))]
    )

    # then the batch was read twice; the canceled run's done is stale and it has no next step
    assert len(reads) == 2
    step_b = StepRun.objects.get(run=run_b, index=0)
    assert (JobRun.objects.get(pk=run_b.pk).status, step_b.status) == (
        RunStatus.CANCELED,
        StepStatus.CANCELED,
    )
    assert RunEvent.objects.filter(kind="reply.stale", step_run=step_b).exists()
    assert not StepRun.objects.filter(run=run_b, index=1).exists()
    # and the other run moved on in the second batch, its end and its next dispatch in
    # one transition (a batch's events share one time)
    step_a0, step_a1 = StepRun.objects.get(run=run_a, index=0), StepRun.objects.get(run=run_a, index=1)
    assert step_a0.status == StepStatus.SUCCEEDED
    ended = RunEvent.objects.get(kind="step.succeeded", step_run=step_a0)
    dispatched = RunEvent.objects.get(kind="step.dispatched", step_run=step_a1)
    assert ended.created_at == dispatched.created_at
    second = hand_a.next_command()
    assert (second["step"], second["id"]) == (1, step_a1.command_id)


def test_a_batch_that_keeps_conflicting_is_applied_as_batches_of_one(stack, manual_device, monkeypatch):
    # given a step in flight, and batches that find a row moved under them twice
    device, hand, run, first = two_steps_on_one_device(manual_device)
    conflicts = []
    runs_continue = engine_batch.planner.runs_continue

    def moved_twice(plan):
        if len(conflicts) < 1 + engine_batch.CONFLICT_RETRIES:
            conflicts.append(1)
            raise engine_batch.BatchConflict("a run moved meanwhile (injected)")
        runs_continue(plan)

    monkeypatch.setattr(engine_batch.planner, "runs_continue", moved_twice)

    # when the device's ack and done come in one batch, for a caller that sends the last
    # writes itself (the inbox, with its acknowledgement)
    last = engine_batch.LastWrites()
    ack = Reply(kind="ack", command_id=first["id"])
    engine_batch.transition_apply(replies=[(device.name, ack), (device.name, done(first["id"]))], last=last)

    # then, the batch and its retry rolled back, each reply was applied as a batch of its
    # own, in order: the step went in progress, then succeeded, and the next command left
    assert len(conflicts) == 1 + engine_batch.CONFLICT_RETRIES
    step0 = StepRun.objects.get(run=run, index=0)
    assert step0.status == StepStatus.SUCCEEDED
    kinds = list(RunEvent.objects.filter(step_run=step0).order_by("id").values_list("kind", flat=True))
    assert kinds[-2:] == ["step.in_progress", "step.succeeded"], kinds
    second = hand.next_command()
    assert (second["step"], second["id"]) == (1, StepRun.objects.get(run=run, index=1).command_id)


def test_a_batch_of_one_that_keeps_conflicting_is_raised_for_the_task_to_run_again(
    stack, manual_device, monkeypatch
):
    # given a step in flight, and batches that always find a row moved under them
    device, _hand, run, first = two_steps_on_one_device(manual_device)
    conflicts = []

    def always_moved(plan):
        conflicts.append(1)
        raise engine_batch.BatchConflict("a run moved meanwhile (injected)")

    monkeypatch.setattr(engine_batch.planner, "runs_continue", always_moved)

    # when the device's done is applied alone
    last = engine_batch.LastWrites()
    with pytest.raises(engine_batch.BatchRetry):
        engine_batch.transition_apply(replies=[(device.name, done(first["id"]))], last=last)

    # then it was tried 1 + CONFLICT_RETRIES times and raised (the inbox task runs again:
    # BatchRetry is TRANSIENT); the batches that rolled back left nothing written and the
    # caller nothing to send (no metrics of their events, no run deadlines)
    assert len(conflicts) == 1 + engine_batch.CONFLICT_RETRIES
    assert engine_batch.BatchRetry in engine_batch.TRANSIENT
    assert not last
    assert StepRun.objects.get(run=run, index=0).status == StepStatus.DISPATCHED


def test_a_done_that_starts_the_next_step_costs_three_texts_on_postgresql(stack, manual_device):
    # given a step in flight, its run's next step on the same (then free) device
    device, hand, run, first = two_steps_on_one_device(manual_device)
    limits_enabled()  # as a working process has: it reads the concurrency limits every few seconds

    # when its done is applied
    with CaptureQueriesContext(connection) as queries:
        engine_batch.transition_apply(replies=[(device.name, done(first["id"]))])

    # then the next command went out, and on PostgreSQL the batch sent the database three
    # texts (besides the BEGIN psycopg sends): the rows' read; the writes with the device's
    # read and the next row's id reserved; the next row, inserted dispatched, its events and
    # the COMMIT. Elsewhere each statement goes on its own.
    second = hand.next_command()
    assert (second["step"], second["id"]) == (1, StepRun.objects.get(run=run, index=1).command_id)
    # (Django lists its own BEGIN and COMMIT too; psycopg found nothing left to commit.)
    sql = [query["sql"] for query in queries.captured_queries if query["sql"] not in ("BEGIN", "COMMIT")]
    if connection.vendor == "postgresql":
        assert len(sql) == 3, sql
        assert "nextval" in sql[1]
        assert 'INSERT INTO "jobs_steprun"' in sql[2] and sql[2].rstrip().endswith("COMMIT")
        assert 'UPDATE "jobs_steprun"' not in sql[2]  # inserted whole, not updated after


def test_a_batch_whose_transaction_fails_is_undone_and_applies_again(stack, manual_device, monkeypatch):
    # given a step in flight, and a database failure right after the batch's lock call
    device, hand, run, first = two_steps_on_one_device(manual_device)
    step0 = StepRun.objects.get(run=run, index=0)
    real_insert = EventLog.insert
    failures = []

    def insert_failing_once(self, *args, **kwargs):
        if not failures:
            failures.append(1)
            raise OperationalError("disk I/O error (injected)")
        real_insert(self, *args, **kwargs)

    monkeypatch.setattr(EventLog, "insert", insert_failing_once)

    # when the device's done is applied, the transaction fails
    with pytest.raises(OperationalError):
        engine_batch.transition_apply(replies=[(device.name, done(first["id"]))])

    # then nothing is half applied: the attempt is still in flight, the run did not move,
    # no next row exists, and the lock the batch took for it was given back
    step0.refresh_from_db()
    assert (step0.status, step0.command_id) == (StepStatus.DISPATCHED, first["id"])
    assert JobRun.objects.get(pk=run.pk).cursor == 0
    assert not StepRun.objects.filter(run=run, index=1).exists()
    assert device_lock_state(device.name).holder is None

    # when the same reply is applied again (the task's retry)
    engine_batch.transition_apply(replies=[(device.name, done(first["id"]))])

    # then it applies once, and the only command the device got next is the committed one
    step0.refresh_from_db()
    step1 = StepRun.objects.get(run=run, index=1)
    assert step0.status == StepStatus.SUCCEEDED
    second = hand.next_command()
    assert (second["step"], second["id"]) == (1, step1.command_id)
    assert second["token"] > first["token"]
    assert device_lock_state(device.name).holder == f"step:{step1.pk}"


def test_a_next_row_made_meanwhile_conflicts_after_the_lock_call_is_undone_and_applies_again(
    stack, manual_device, monkeypatch
):
    # given a step in flight, and the run's next row made by another transition after the
    # batch named its own next row and took that row's lock (made in the batch's own
    # transaction here, so that the batch's insert of its row finds it)
    device, hand, run, first = two_steps_on_one_device(manual_device)
    real_insert = EventLog.insert
    holders = []

    def next_row_made_meanwhile(self, *args, **kwargs):
        if not holders:
            holders.append(device_lock_state(device.name).holder)
            StepRun.objects.create(run=run, index=1, device=device, action="second", status=StepStatus.QUEUED)
        real_insert(self, *args, **kwargs)

    monkeypatch.setattr(EventLog, "insert", next_row_made_meanwhile)

    # when the device's done is applied
    engine_batch.transition_apply(replies=[(device.name, done(first["id"]))])

    # then the first try had the next row's lock before its row existed; the conflict
    # rolled both rows back, gave that lock back, and the batch applied again from a fresh
    # read: one next row, holding the lock, and the only command the device got next is its
    (holder,) = holders
    assert holder.startswith("step:") and holder != f"step:{StepRun.objects.get(run=run, index=0).pk}"
    step1 = StepRun.objects.get(run=run, index=1)
    assert StepRun.objects.get(run=run, index=0).status == StepStatus.SUCCEEDED
    assert step1.status == StepStatus.DISPATCHED
    assert device_lock_state(device.name).holder == f"step:{step1.pk}"
    second = hand.next_command()
    assert (second["step"], second["id"]) == (1, step1.command_id)
    assert second["token"] > first["token"]
    assert RunEvent.objects.filter(run=run, kind="step.dispatched", step_run=step1).count() == 1


def test_a_batch_logs_and_tells_out_its_events_only_once_committed(stack, manual_device, monkeypatch, caplog):
    # given a step in flight, a lifecycle receiver, and a database failure right after the
    # batch queued its events
    device, _hand, run, first = two_steps_on_one_device(manual_device)
    told = []

    def lifecycle(sender, events, **kwargs):
        told.append(([event.kind for event in events], connection.in_atomic_block))

    lifecycle_events.connect(lifecycle, dispatch_uid="test-batch-lifecycle")
    real_insert = EventLog.insert
    failures = []

    def insert_then_fail_once(self, *args, **kwargs):
        real_insert(self, *args, **kwargs)
        if not failures:
            failures.append(1)
            raise OperationalError("disk I/O error (injected)")

    monkeypatch.setattr(EventLog, "insert", insert_then_fail_once)
    try:
        with caplog.at_level(logging.INFO, logger="jobs.timeline"):
            caplog.clear()
            # when the device's done (failed, so the run fails) is applied and rolls back
            with pytest.raises(OperationalError):
                engine_batch.transition_apply(replies=[(device.name, done(first["id"], ok=False))])

            # then none of its events was logged or told out
            assert not [r for r in caplog.records if r.name == "jobs.timeline"]
            assert told == []

            # when it is applied again and commits
            engine_batch.transition_apply(replies=[(device.name, done(first["id"], ok=False))])
    finally:
        lifecycle_events.disconnect(dispatch_uid="test-batch-lifecycle")

    # then each event is logged once, and the lifecycle ones are told once, outside the
    # transaction
    logged = [(r.event, r.command_id) for r in caplog.records if r.name == "jobs.timeline"]
    assert logged.count(("step.failed", first["id"])) == 1
    assert ("run.failed", None) in logged
    assert told == [(["step.failed", "run.failed"], False)]
    assert JobRun.objects.get(pk=run.pk).status == RunStatus.FAILED


def test_a_lifecycle_receiver_that_fails_after_the_commit_is_logged_and_the_batch_goes_on(
    stack, manual_device, caplog
):
    # given a step in flight and a lifecycle receiver that raises
    device, _hand, run, first = two_steps_on_one_device(manual_device)

    def broken(sender, events, **kwargs):
        raise RuntimeError("receiver down (injected)")

    lifecycle_events.connect(broken, dispatch_uid="test-batch-broken")
    try:
        # when the device's failed done is applied (the run fails: lifecycle events)
        with caplog.at_level(logging.ERROR, logger="jobs.timeline"):
            engine_batch.transition_apply(replies=[(device.name, done(first["id"], ok=False))])
    finally:
        lifecycle_events.disconnect(dispatch_uid="test-batch-broken")

    # then the transition stands, and the failure is logged instead of raised
    assert JobRun.objects.get(pk=run.pk).status == RunStatus.FAILED
    assert StepRun.objects.get(run=run, index=0).status == StepStatus.FAILED
    errors = [r for r in caplog.records if r.name == "jobs.timeline" and r.levelno == logging.ERROR]
    assert any("receiver" in r.getMessage() and r.exc_info for r in errors)


def test_a_batch_taken_by_a_worker_that_died_is_reclaimed_and_applied(stack, manual_device):
    # given a step in flight, and its done taken from the inbox by a worker that then died
    # (read under its consumer name, never acknowledged)
    device, hand, run, first = two_steps_on_one_device(manual_device)
    conn = redis_connection()
    inbox.INBOX.group_ensure(conn)
    reply = done(first["id"]).as_task_payload()
    with conn.pipeline(transaction=True) as pipe:  # atomic: no live worker can take it first
        pipe.xadd(inbox.INBOX.key(), {"r": json.dumps([[device.name, reply]])})
        pipe.xreadgroup(inbox.GROUP, "worker-that-died", {inbox.INBOX.key(): ">"}, count=10)
        _, taken = pipe.execute()
    assert taken and taken[0][1], "the dead worker's read took the entry"

    # then the monitor takes the entry over once it has been pending long enough, and
    # the run moves on exactly once
    second = hand.next_command(timeout=workstream.RECLAIM_IDLE_SECONDS + 15)
    assert second["step"] == 1
    step0 = StepRun.objects.get(run=run, index=0)
    assert step0.status == StepStatus.SUCCEEDED
    assert kinds(run).count("step.succeeded") == 1
    wait_for(
        lambda: conn.xpending(inbox.INBOX.key(), inbox.GROUP)["pending"] == 0, what="the entry acknowledged"
    )


def send_pending(step: StepRun) -> bool:
    """Whether the step's current attempt still has its `send` deadline (publish unconfirmed)."""
    deadline = Deadline.of("send", step)
    return lock_redis_connection().zscore(deadlines_key(deadline.shard), deadline.member) is not None


def test_published_commands_have_their_send_deadlines_cleared_by_task_and_by_direct_call(
    stack, manual_device
):
    # given a run's first command, published by the worker's drain task (a run start)
    device, hand, run, first = two_steps_on_one_device(manual_device)
    step0 = StepRun.objects.get(run=run, index=0)

    # then the broker's PUBACK cleared its `send` deadline (before the task returned)
    wait_for(lambda: not send_pending(step0), what="the first command's send deadline cleared")

    # when its done is applied by a direct call, outside any task, and publishes the next
    engine_batch.transition_apply(replies=[(device.name, done(first["id"]))])

    # then the next command's `send` deadline is cleared too: the transition's own
    # Publications waited for its PUBACK; nothing was re-sent
    second = hand.next_command()
    step1 = StepRun.objects.get(run=run, index=1)
    assert second["id"] == step1.command_id
    assert not send_pending(step1)
    assert "step.resent" not in kinds(run)


def test_a_start_of_a_running_run_resumes_its_step_once(stack, manual_device):
    # given a run whose step waits queued behind another run's step on a busy device
    device, hand, blocking_run, first = two_steps_on_one_device(manual_device)
    run, _ = run_start(template=template_with_steps((device, "later", {})))
    queued = wait_for(
        lambda: StepRun.objects.filter(run=run, index=0, status=StepStatus.QUEUED).first(),
        what="the second run's step queued",
    )
    assert device_lock_state(device.name).queue == [f"step:{queued.pk}"]

    # when its start is applied again, twice (a redelivered start, the monitor's sweep)
    engine_batch.transition_apply(starts=[str(run.pk)])
    engine_batch.transition_apply(starts=[str(run.pk)])

    # then it is still one row, queued once in the device's queue
    assert list(StepRun.objects.filter(run=run).values_list("pk", "status")) == [
        (queued.pk, StepStatus.QUEUED)
    ]
    assert device_lock_state(device.name).queue == [f"step:{queued.pk}"]
    assert kinds(run).count("run.started") == 1

    # and once the device is free it is dispatched once, ahead of the first run's next
    # step, which queued after it
    engine_batch.transition_apply(replies=[(device.name, done(first["id"]))])
    later = hand.next_command()
    assert (later["run"], later["step"]) == (str(run.pk), 0)
    engine_batch.transition_apply(replies=[(device.name, done(later["id"]))])
    assert JobRun.objects.get(pk=run.pk).status == RunStatus.SUCCEEDED
    assert kinds(run).count("step.dispatched") == 1
    assert hand.next_command()["run"] == str(blocking_run.pk)


def test_an_extension_in_a_batch_moves_the_deadline_and_the_lease(stack, manual_device):
    # given a step in flight on a device
    device, _hand, run, first = two_steps_on_one_device(manual_device)
    row = StepRun.objects.get(command_id=first["id"])
    lease_before = device_lock_state(device.name).lease_until_ms

    # when the device asks for 300 s more, and then for far more than the step allows
    extend = Reply(kind="progress", command_id=first["id"], progress=10, extend_seconds=300)
    engine_batch.transition_apply(replies=[(device.name, extend)])
    moved = StepRun.objects.get(pk=row.pk)
    too_much = Reply(kind="progress", command_id=first["id"], progress=20, extend_seconds=100_000)
    engine_batch.transition_apply(replies=[(device.name, too_much)])

    # then the first moved the row's deadline, its `done` deadline and the lock's lease out
    # to about 300 s from now; the second was refused and changed nothing
    assert (moved.deadline - row.deadline).total_seconds() > 200
    due = Deadline.of("done", row)
    score = lock_redis_connection().zscore(deadlines_key(due.shard), due.member)
    assert abs(score / 1000 - moved.deadline.timestamp()) < 1
    assert device_lock_state(device.name).lease_until_ms > lease_before + 200_000
    assert StepRun.objects.get(pk=row.pk).deadline == moved.deadline
    assert kinds(run).count("step.extended") == 1
    assert kinds(run).count("step.extend_refused") == 1


def test_a_lease_that_runs_out_ends_the_attempt_as_one_transition(stack, manual_device):
    # given a step in flight with a second attempt allowed, whose lock lease is cut short
    device = DeviceFactory()
    hand = manual_device(device.name)
    template = template_with_steps((device, "slow", {}))
    template.steps.update(max_attempts=2, backoff_seconds=0.1)
    run, _ = run_start(template=template)
    first = hand.next_command()
    row = StepRun.objects.get(command_id=first["id"])
    assert device_lock_extend(device.name, holder=f"step:{row.pk}", fence=row.fence, lease_seconds=0.2)

    # when the monitor finds the lease expired, the attempt ends timed out and is retried:
    # the device gets the second attempt under a new fence
    second = hand.next_command(timeout=30)
    assert (second["attempt"], second["step"]) == (2, 0)
    assert second["token"] > first["token"]
    retrying = RunEvent.objects.get(step_run=row, kind="step.retrying")
    assert "device lock lease expired" in retrying.message

    # and the run goes on as usual
    engine_batch.transition_apply(replies=[(device.name, done(second["id"]))])
    assert JobRun.objects.get(pk=run.pk).status == RunStatus.SUCCEEDED


def test_undoing_a_batch_whose_acquire_found_its_row_holding_the_lock_leaves_the_lock_alone(
    stack, manual_device, monkeypatch
):
    # given a step dispatched and in flight on a device, and a batch that read its row
    # while it was still queued (the pump or a device coming online, racing the hand-off)
    device, hand, _run, first = two_steps_on_one_device(manual_device)
    row = StepRun.objects.select_related("run", "device").get(command_id=first["id"])
    held = device_lock_state(device.name)
    stale = StepRun.objects.select_related("run", "device").get(pk=row.pk)
    stale.status, stale.attempt = StepStatus.QUEUED, 0

    # when that batch asks for the lock (a re-acquire: granted, taking nothing), its
    # dispatch finds the row moved, and it is undone
    with monkeypatch.context() as patched:
        patched.setattr(engine_batch, "rows_select", lambda *args, **kwargs: [stale])
        engine_batch.rows_start([row.pk])

    # then the step in flight keeps its lock and fence: nobody else was handed the device
    after = device_lock_state(device.name)
    assert (after.holder, after.fence) == (held.holder, held.fence) == (f"step:{row.pk}", row.fence)
    assert StepRun.objects.get(pk=row.pk).command_id == first["id"]
    engine_batch.transition_apply(replies=[(device.name, done(first["id"]))])
    second = hand.next_command()
    assert (second["step"], second["token"]) == (1, row.fence + 1)


def test_a_due_send_deadline_sends_the_command_again_once(stack, manual_device):
    # given a command whose publish was confirmed (its `send` deadline cleared)
    _device, hand, run, first = two_steps_on_one_device(manual_device)
    step0 = StepRun.objects.get(run=run, index=0)
    wait_for(lambda: not send_pending(step0), what="the first command's send deadline cleared")

    # when its `send` deadline comes due anyway (a confirmation the worker never saw)
    deadlines_set({Deadline.of("send", step0): timezone.now()})

    # then the monitor sends the same command again, under the same token, and says so
    again = hand.next_command()
    assert (again["id"], again["token"]) == (first["id"], first["token"])
    wait_for(lambda: "step.resent" in kinds(run), what="the re-send recorded")
    wait_for(lambda: not send_pending(step0), what="the re-send's deadline cleared")
    assert kinds(run).count("step.resent") == 1


def test_rows_asking_again_for_their_locks_keep_their_places_when_the_transition_is_undone(
    stack, manual_device, monkeypatch
):
    # given three runs' steps waiting, in order, behind a busy device
    device, _hand, _run, _first = two_steps_on_one_device(manual_device)
    waiting = []
    for _ in range(3):
        run, _ = run_start(template=template_with_steps((device, "later", {})))
        waiting.append(
            wait_for(
                lambda run=run: StepRun.objects.filter(run=run, index=0, status=StepStatus.QUEUED).first(),
                what="a step queued",
            )
        )
    places = [f"step:{row.pk}" for row in waiting]
    wait_for(lambda: device_lock_state(device.name).queue == places, what="all three queued in order")

    # when the monitor's sweep asks again for the last two's locks, and that transition
    # finds a row moved after its lock call, every time (it is undone each time)
    undone = []

    def moved_after_the_lock_call(plan):
        undone.append(1)
        raise engine_batch.BatchConflict("a row moved meanwhile (injected)")

    monkeypatch.setattr(engine_batch.planner_locks, "dispatches_writes", moved_after_the_lock_call)
    engine_batch.rows_start([waiting[1].pk, waiting[2].pk], quiet=True)

    # then the undo gave back nothing it had not taken: all three still wait in their order
    assert undone
    assert device_lock_state(device.name).queue == places


def test_a_row_a_kinds_start_asks_for_is_made_and_dispatched_in_one_transition_and_only_once(
    stack, manual_device
):
    # given a running run whose step at the cursor has no row yet (as when the general path
    # starts a step: a fan-out or a rollback moved the run on), its device free
    device = DeviceFactory()
    hand = manual_device(device.name)
    later = timezone.now() + timezone.timedelta(hours=1)
    run, _ = run_start(template=template_with_steps((device, "reboot", {})), not_before=later)
    JobRun.objects.filter(pk=run.pk).update(status=RunStatus.RUNNING, started_at=timezone.now())
    run.refresh_from_db()

    # when its kind's start asks for the row twice (a redelivered start)
    with CaptureQueriesContext(connection) as made:
        row = engine_batch.step_row_queue(run, 0)
    again = engine_batch.step_row_queue(run, 0)

    # then the row was inserted already dispatched, in the transaction that took its lock
    # (one insert, no update of it), and the second ask found the same row
    # (on PostgreSQL several statements travel in one text: count them in every text)
    texts = " ".join(q["sql"] for q in made.captured_queries)
    assert (texts.count('INSERT INTO "jobs_steprun"'), texts.count('UPDATE "jobs_steprun"')) == (1, 0)
    assert again.pk == row.pk and StepRun.objects.filter(run=run).count() == 1
    assert StepRun.objects.get(pk=row.pk).status == StepStatus.DISPATCHED

    # and the device got one command, and the run finishes when it answers
    command = hand.next_command()
    assert (command["run"], command["step"], command["id"]) == (str(run.pk), 0, row.command_id)
    assert kinds(run).count("step.queued") == 1 and kinds(run).count("step.dispatched") == 1
    hand.done(command["id"])
    wait_for(lambda: JobRun.objects.get(pk=run.pk).status == RunStatus.SUCCEEDED, what="the run to succeed")
