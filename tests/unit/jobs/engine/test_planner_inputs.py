"""The planner's inputs one by one (jobs/engine/planner.py), carried out by the simulation's
in-memory executor (tests/unit/jobs/engine_world.py): a start of a running run, replies that
answer nothing current, an extension, flow control's waits and a due `dispatch`."""

from __future__ import annotations

from datetime import timedelta

from devices import protocol
from devices.locks import Grant
from jobs.deadlines import Deadline
from jobs.engine import effects, planner, planner_locks
from jobs.engine.plan import step_holder
from jobs.models import OnFailure, StepStatus

from ..engine_world import World, reply


def one_step_run(world: World, device: str = "d0", priority: int = 5):
    return world.run_new([(device, OnFailure.ABORT, 1)], priority)


def queued_behind(world: World):
    """Two one-step runs on d0, both started: the first's step holds d0, the second's
    waits in its queue. Returns the second run and its row's id."""
    first, second = one_step_run(world), one_step_run(world)
    world.start(first.pk)
    world.start(second.pk)
    (pk,) = [pk for pk, row in world.rows.items() if row.run_id == second.pk]
    return second, pk


def test_a_start_of_a_running_run_changes_nothing_while_its_step_is_in_flight():
    # given a run whose step was dispatched
    world = World()
    run = one_step_run(world)
    world.start(run.pk)
    rows_before = dict(world.rows)

    # when its start comes again (a redelivered task, the monitor's sweep)
    world.start(run.pk)

    # then no row and no command was added
    assert world.rows.keys() == rows_before.keys()
    assert len(world.inbox["d0"]) == 1


def test_a_start_of_a_running_run_asks_again_for_the_lock_of_its_queued_step_keeping_its_place():
    # given two runs on one device: the second's step waits in the device's queue
    world = World()
    second, waiting = queued_behind(world)
    assert world.locks.devices["d0"].queue[0][1] == f"step:{waiting}"

    # when the second's start comes again
    world.start(second.pk)

    # then it is still queued once, and still nothing was sent for it
    assert [holder for _, holder in world.locks.devices["d0"].queue] == [f"step:{waiting}"]
    assert world.rows[waiting].status == StepStatus.QUEUED
    assert len(world.inbox["d0"]) == 1


def test_replies_that_answer_nothing_current_are_sampled_events_by_kind():
    # given a step in flight on d0
    world = World()
    run = one_step_run(world)
    world.start(run.pk)
    command = world.inbox["d0"][0]

    # when d1 answers d0's command, someone answers a command nobody sent, and d0 answers
    # it twice (the second after the first ended it)
    plan = world.transition(
        lambda plan: (
            planner.replies_plan(
                plan,
                world.by_command({command["id"]}),
                [
                    ("d1", reply("done", command["id"], ok=True)),
                    ("d0", reply("done", "nope-1", ok=True)),
                    ("d0", reply("done", command["id"], ok=True)),
                    ("d0", reply("ack", command["id"])),
                ],
            ),
            planner.runs_continue(plan),
        )
    )

    # then the step ended once, and the rest are sampled events naming what they were
    kinds = [kind for kind, _, _ in plan.events.sampled]
    assert kinds == ["reply.foreign_device", "reply.unknown", "reply.stale"]
    assert world.rows[command["pk"]].status == StepStatus.SUCCEEDED


def test_a_reply_for_an_earlier_attempt_is_stale_for_its_own_device_only():
    world = World()
    run = one_step_run(world)
    world.start(run.pk)
    row = world.row_read(world.inbox["d0"][0]["pk"])
    earlier = f"{row.pk}-0-cafebabe"  # the id an earlier attempt of this row would carry

    plan = effects.Plan(now=world.now)
    planner.replies_plan(
        plan,
        {},
        [("d0", reply("done", earlier, ok=True)), ("d1", reply("done", earlier, ok=True))],
        {row.pk: row},
    )

    assert [kind for kind, _, _ in plan.events.sampled] == ["reply.stale", "reply.unknown"]
    assert not plan.writes and not plan.locks.ops


def extend(command_id: str, seconds: float) -> protocol.Reply:
    return protocol.Reply(kind="progress", command_id=command_id, progress=10, extend_seconds=seconds)


def test_an_extension_moves_the_row_deadline_the_done_deadline_and_the_lease_and_is_bounded():
    # given a step in flight (timeout 30 s), 10 s into its attempt
    world = World()
    run = one_step_run(world)
    world.start(run.pk)
    command = world.inbox["d0"][0]
    world.now += timedelta(seconds=10)
    dispatched = world.rows[command["pk"]].deadline

    # when the device asks for 100 s more
    plan = world.transition(
        lambda plan: planner.replies_plan(
            plan, world.by_command({command["id"]}), [("d0", extend(command["id"], 100))]
        )
    )

    # then its deadline is 100 s from now on the row and in the deadline set, with the
    # lease extended in the same lock call
    row = world.rows[command["pk"]]
    assert row.deadline == world.now + timedelta(seconds=100) > dispatched
    done = Deadline.of("done", row)
    assert world.locks.zset[done.member] == int(row.deadline.timestamp() * 1000)
    assert [op["o"] for op in plan.locks.ops] == ["e"]
    assert [kind for kind, _, _ in plan.events.sampled] == ["step.extended"]

    # when it asks for more than the step's maximum (3600 s past the original deadline)
    plan = world.transition(
        lambda plan: planner.replies_plan(
            plan, world.by_command({command["id"]}), [("d0", extend(command["id"], 10_000))]
        )
    )

    # then it is refused and nothing moved
    assert world.rows[command["pk"]].deadline == row.deadline
    assert [kind for kind, _, _ in plan.events.sampled] == ["step.extend_refused"]
    assert not plan.locks.ops


def test_a_device_whose_next_command_is_not_due_keeps_the_lock_until_its_dispatch_deadline():
    # given a run whose device's flow control says: not for 2 s
    world = World()
    run = one_step_run(world)

    def start(plan):
        plan.waits["d0"] = 2.0
        planner.runs_begin(plan, {run.pk: world.run_read(run.pk)}, [str(run.pk)], {})

    # when it starts
    plan = world.transition(start)

    # then its row holds the lock, stays queued and has a dispatch deadline in 2 s; nothing
    # was sent
    (pk,) = world.rows
    row = world.rows[pk]
    assert world.locks.devices["d0"].holder == step_holder(row)
    assert row.status == StepStatus.QUEUED and not world.inbox["d0"]
    due = Deadline.of("dispatch", row)
    assert world.locks.zset[due.member] == int((world.now + timedelta(seconds=2)).timestamp() * 1000)
    assert [e.kind for e in plan.events.events][-1] == "step.spaced"

    # when the dispatch deadline is due and the row still holds the lock
    world.now += timedelta(seconds=2)
    lock = world.locks.devices["d0"]
    holders = {"d0": Grant(lock.holder, lock.fence)}
    world.transition(lambda plan: planner.dues_plan(plan, {pk: world.row_read(pk)}, [due], holders))

    # then it is dispatched once, under the fence it was granted
    assert world.rows[pk].status == StepStatus.DISPATCHED
    assert [c["token"] for c in world.inbox["d0"]] == [lock.fence]


def test_a_due_dispatch_of_a_row_that_does_not_hold_the_lock_changes_nothing():
    world = World()
    _, pk = queued_behind(world)
    row = world.row_read(pk)
    lock = world.locks.devices["d0"]

    plan = effects.Plan(now=world.now)
    planner.dues_plan(plan, {pk: row}, [Deadline.of("dispatch", row)], {"d0": Grant(lock.holder, lock.fence)})

    assert not plan.handed and not plan.writes and not plan.locks.ops


def test_a_queue_deadline_times_out_a_waiting_row_and_its_run_moves_on():
    # given a run waiting in d0's queue behind another
    world = World()
    second, pk = queued_behind(world)
    due = Deadline.of("queue", world.rows[pk])

    # when its queue deadline is due and it holds nothing
    lock = world.locks.devices["d0"]
    holders = {"d0": Grant(lock.holder, lock.fence)}
    world.transition(
        lambda plan: (
            planner.dues_plan(plan, {pk: world.row_read(pk)}, [due], holders),
            planner.runs_continue(plan),
        )
    )

    # then it timed out, left the queue, and its run ended timed out
    assert world.rows[pk].status == StepStatus.TIMED_OUT
    assert "busy" in world.rows[pk].error
    assert world.locks.devices["d0"].queue == []
    assert world.runs[second.pk].status == "timed_out"


def test_a_queue_deadline_of_a_row_that_holds_its_lock_dispatches_it():
    # given a row granted its lock whose dispatch was lost (it is still queued)
    world = World()
    run = one_step_run(world)

    def spaced(plan):
        plan.waits["d0"] = 5.0  # granted, but held back: queued and holding the lock
        planner.runs_begin(plan, {run.pk: world.run_read(run.pk)}, [str(run.pk)], {})

    world.transition(spaced)
    (pk,) = world.rows
    lock = world.locks.devices["d0"]
    assert lock.holder == f"step:{pk}" and world.rows[pk].status == StepStatus.QUEUED

    # when its queue deadline comes first
    due = Deadline.of("queue", world.rows[pk])
    world.transition(
        lambda plan: planner.dues_plan(
            plan, {pk: world.row_read(pk)}, [due], {"d0": Grant(lock.holder, lock.fence)}
        )
    )

    # then it is dispatched under the fence it holds, not timed out
    assert world.rows[pk].status == StepStatus.DISPATCHED
    assert [c["token"] for c in world.inbox["d0"]] == [lock.fence]


def test_a_hand_off_to_a_row_not_committed_yet_is_looked_at_again_by_the_hand_off_writes():
    # given a release that handed d0 to a step whose row is not readable yet (another
    # transition is still creating it)
    world = World()
    plan = effects.Plan(now=world.now)
    plan.handed.append(("d0", Grant("step:77", 4)))

    # when the hand-offs are planned (after the plan's own lock call was made)
    writes = planner_locks.handed_plan(plan, {})

    # then the dispatch deadline that looks at it again is in the writes the executor
    # applies next, not in the lock call already sent
    retry = Deadline("dispatch", 77, 0, "d0")
    due = world.now + timedelta(seconds=planner_locks.UNCOMMITTED_ROW_RETRY_SECONDS)
    assert writes.writes[retry.shard]["zadd"] == {retry.member: int(due.timestamp() * 1000)}
    assert not plan.locks.writes and not plan.later
