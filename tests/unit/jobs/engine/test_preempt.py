"""Urgent preemption's decisions (jobs/engine/preempt.py), carried out by the simulation's
in-memory executor (tests/unit/jobs/engine_world.py): who may preempt whom, and what one
preemption changes: the urgent row dispatched under a higher fence, the displaced row
queued again with a `cancel` for its command, its late `done` stale, then its turn again."""

from __future__ import annotations

import pytest

from jobs.engine.plan import step_holder, step_preempts
from jobs.engine.preempt import preempt_plan, preempt_refusal
from jobs.models import OnFailure, StepStatus

from ..engine_world import World, reply


@pytest.fixture(autouse=True)
def _preempt_from_priority_8(settings):
    settings.IOTQUEUE_PREEMPT_PRIORITY = 8


def run_on_d0(world: World, priority: int, *, urgent: bool = False):
    run = world.run_new([("d0", OnFailure.ABORT, 1)], priority)
    run.plan[0]["urgent"] = urgent
    world.start(run.pk)
    (pk,) = [pk for pk, row in world.rows.items() if row.run_id == run.pk]
    return run, pk


def test_only_an_urgent_step_of_a_run_at_or_above_the_setting_preempts(settings):
    world = World()
    _, low = run_on_d0(world, 2)
    _, urgent = run_on_d0(world, 9, urgent=True)
    _, high = run_on_d0(world, 9)
    _, urgent_low = run_on_d0(world, 7, urgent=True)
    assert [step_preempts(world.row_read(pk)) for pk in (low, urgent, high, urgent_low)] == [
        False,
        True,
        False,
        False,
    ]
    # a plan asked to preempt for the urgent row only, once, when it joined the queue
    assert world.preempts == [urgent]
    settings.IOTQUEUE_PREEMPT_PRIORITY = None
    assert not step_preempts(world.row_read(urgent))


def test_a_holder_of_the_same_or_a_higher_priority_is_not_preempted():
    world = World()
    _, holder = run_on_d0(world, 9)
    _, urgent = run_on_d0(world, 9, urgent=True)
    fence = world.locks.devices["d0"].fence
    assert "priority" in preempt_refusal(world.row_read(urgent), world.row_read(holder), fence)
    assert "in flight" in preempt_refusal(world.row_read(urgent), world.row_read(holder), fence + 1)


def test_a_preemption_dispatches_the_urgent_row_and_queues_the_displaced_one_again():
    # given a low-priority command in flight on d0, and an urgent row queued behind it
    world = World()
    _, low = run_on_d0(world, 2)
    _, urgent = run_on_d0(world, 9, urgent=True)
    first = world.inbox["d0"][0]
    fence = world.locks.devices["d0"].fence
    row, victim = world.row_read(urgent), world.row_read(low)
    assert preempt_refusal(row, victim, fence) == ""

    # when it preempts
    plan = world.transition(lambda plan: preempt_plan(plan, row, victim, fence))

    # then the displaced command gets a cancel (sent before the urgent command), its row is
    # queued again, and the urgent row holds d0 under a higher fence and was sent
    assert [r.pk for r in plan.cancels] == [low] and [r.pk for r in plan.dispatches] == [urgent]
    assert world.rows[low].status == StepStatus.QUEUED
    assert world.rows[urgent].status == StepStatus.DISPATCHED and world.rows[urgent].fence == fence + 1
    lock = world.locks.devices["d0"]
    assert (lock.holder, [h for _, h in lock.queue]) == (step_holder(row), [step_holder(victim)])
    kinds = [(e.kind, e.step_run.pk) for e in plan.events.events if e.kind == "step.preempted"]
    assert kinds == [("step.preempted", low), ("step.preempted", urgent)]

    # when the canceled command's done comes late: stale, the row stays queued
    world.replies_apply([("d0", reply("done", first["id"], ok=False, error="canceled"))])
    assert world.sampled[-1] == "reply.stale" and world.rows[low].status == StepStatus.QUEUED

    # when the urgent command ends, the displaced row runs again as its next attempt
    world.replies_apply([("d0", reply("done", world.rows[urgent].command_id, ok=True))])
    again = world.rows[low]
    assert again.status == StepStatus.DISPATCHED and again.attempt == 2 and again.fence == fence + 2
    world.replies_apply([("d0", reply("done", again.command_id, ok=True))])
    assert world.rows[low].status == StepStatus.SUCCEEDED
