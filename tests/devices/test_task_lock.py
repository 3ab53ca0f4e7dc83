"""Locked plain Celery tasks (devices/task_lock.py): park, hand-off, release on error, lease
extension, sharing a device's queue with job steps — real worker, bridge, beat, Redis and
broker, with the simulated device as the oracle for overlaps and fencing tokens."""

import itertools

import pytest
from celery import chain

from devices.locks import (
    Grant,
    device_lock_acquire,
    device_lock_handoff,
    device_lock_release,
    device_lock_state,
    lock_epoch_keys,
)
from devices.task_lock import DeviceBusy, task_parked
from devtools.simulator import DeviceBehaviour
from iotqueue import celery_app
from iotqueue.redis_conn import lock_redis_connection, redis_key
from jobs.models import JobRun, RunEvent, RunStatus, StepRun
from jobs.services import run_start
from tests.conftest import wait_for
from tests.devices.lock_tasks import (
    device_command,
    failing_command,
    long_command,
    sentinel,
    task_ended,
    task_started,
)
from tests.factories import DeviceFactory, template_with_steps

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

SLOW = DeviceBehaviour(latency_min_ms=300, latency_max_ms=300)


def holder(result) -> str:
    return f"task:{result.id}"


def idle_after(sim, device: str, commands: int):
    """True once the device got `commands` commands and its lock is free again."""
    return len(sim.received(device)) >= commands and device_lock_state(device).holder is None


def ran(sim, device: str) -> list[str]:
    """Task ids (or run ids) of the commands the device received, in arrival order."""
    return [c["run"] for c in sim.received(device)]


def assert_serialized(sim, device: str, latency: float) -> None:
    commands = sim.received(device)
    assert sim.stats()["totals"]["overlaps"] == 0
    assert sim.stats()["totals"]["token_regressions"] == 0
    tokens = [c["token"] for c in commands]
    assert tokens == sorted(set(tokens)), "every holder gets a new, higher fencing token"
    gaps = [b["at"] - a["at"] for a, b in itertools.pairwise(commands)]
    assert all(gap >= latency * 0.95 for gap in gaps), gaps


def blocked(device: str) -> Grant:
    grant = device_lock_acquire(device, holder="test:blocker", priority=5, lease_seconds=60)
    assert isinstance(grant, Grant)
    return grant


def unblock(device: str, grant: Grant) -> None:
    nxt = device_lock_release(device, holder="test:blocker", fence=grant.fence)
    if nxt is not None:
        device_lock_handoff(device, nxt)


def test_tasks_sent_at_once_for_one_device_run_one_at_a_time(stack, simulator):
    # given a device that takes 300 ms per command
    device = DeviceFactory().name
    sim = simulator({device: SLOW})

    # when five locked tasks for it are sent at once (two worker processes)
    log_offset = stack.supervisor.log_size("worker")
    results = [device_command.delay(device, f"work-{n}") for n in range(5)]
    wait_for(lambda: idle_after(sim, device, 5), what="all five tasks to run")

    # then each ran exactly once, one after the other, each under a new fence
    assert sorted(ran(sim, device)) == sorted(r.id for r in results)
    assert_serialized(sim, device, latency=0.3)
    # and the ones that found the device busy were parked and handed the lock, not blocked
    worker_log = stack.supervisor.children["worker"].log_text()[log_offset:]
    parked = [line for line in worker_log.splitlines() if line.endswith(f"on {device}") and "parked" in line]
    handed = [line for line in worker_log.splitlines() if f"lock on {device} handed to task" in line]
    assert parked and len(handed) == len(parked)


def test_busy_device_parks_tasks_in_priority_then_fifo_order_and_hands_them_on(stack, simulator):
    # given a device whose lock someone else holds
    device = DeviceFactory().name
    sim = simulator({device: DeviceBehaviour(latency_min_ms=20, latency_max_ms=40)})
    grant = blocked(device)

    # when three tasks, then an urgent one, are sent for it
    results = []
    for n in range(3):
        results.append(device_command.delay(device, f"work-{n}"))
        wait_for(lambda n=n: len(device_lock_state(device).queue) == n + 1, what=f"task {n} to park")
    urgent = device_command.apply_async((device, "urgent"), lock_priority=9)
    wait_for(lambda: len(device_lock_state(device).queue) == 4, what="the urgent task to park")

    # then none ran: each is parked (stored to be sent again) in the device's queue
    state = device_lock_state(device)
    assert (state.holder, state.fence) == ("test:blocker", grant.fence)
    assert state.queue == [holder(urgent)] + [holder(r) for r in results]
    for result in [urgent, *results]:
        parked = task_parked(result.id)
        assert parked["device"] == device
        assert parked["signature"]["task"] == "tests.lock_tasks.device_command"
        assert parked["signature"]["options"]["task_id"] == result.id
    assert sim.received(device) == []

    # and when the lock is released, the hand-off runs them one by one in queue order
    unblock(device, grant)
    wait_for(lambda: idle_after(sim, device, 4), what="the parked tasks to run")
    assert ran(sim, device) == [urgent.id] + [r.id for r in results]
    assert all(c["token"] > grant.fence for c in sim.received(device))
    assert sim.stats()["totals"]["overlaps"] == 0
    assert all(task_parked(r.id) is None for r in [urgent, *results])


def test_a_parked_task_keeps_its_chain(stack, simulator):
    # given a blocked device and a chain of two locked tasks for it
    device = DeviceFactory().name
    sim = simulator({device: DeviceBehaviour()})
    grant = blocked(device)
    second = chain(device_command.si(device, "first"), device_command.si(device, "second")).apply_async()
    wait_for(lambda: len(device_lock_state(device).queue) == 1, what="the first link to park")

    # then parking did not start the next link. What proves it: the first link's run ended
    # (a run sends its chain's next link before it ends), then a task sent after that ran
    # (the worker takes messages in the order they were sent: a next link would have started)
    wait_for(lambda: task_ended(second.parent.id), what="the first link's run to end")
    after = sentinel.delay()
    wait_for(lambda: task_ended(after.id), what="a task sent after it to run")
    assert task_started(second.id) == 0
    assert device_lock_state(device).queue == [holder(second.parent)]
    assert sim.received(device) == []

    # and when the lock is released, the first link runs, then the second
    unblock(device, grant)
    wait_for(lambda: idle_after(sim, device, 2), what="both links to run")
    assert ran(sim, device) == [second.parent.id, second.id]


def test_a_task_whose_body_raises_releases_the_lock_to_the_waiting_task(stack, simulator):
    # given a failing task holding the device, and a task parked behind it
    device = DeviceFactory().name
    sim = simulator({device: DeviceBehaviour(latency_min_ms=800, latency_max_ms=800)})
    failing = failing_command.delay("fail", target=device)
    wait_for(lambda: device_lock_state(device).holder == holder(failing), what="the failing task to hold")
    waiting = device_command.delay(device, "after")
    wait_for(lambda: device_lock_state(device).queue == [holder(waiting)], what="the second task to park")

    # when the failing task's body raises after its command
    wait_for(lambda: idle_after(sim, device, 2), what="both tasks to run")

    # then the body did raise, and its lock went to the waiting task, which ran after it
    worker_log = stack.supervisor.children["worker"].log_text()
    assert f"{failing.id}] raised unexpected: RuntimeError" in worker_log
    assert ran(sim, device) == [failing.id, waiting.id]
    assert_serialized(sim, device, latency=0.8)


def test_the_lease_is_extended_while_the_body_runs(stack, simulator):
    # given a task with a 1.5 s lease on a device that answers after 4 s, and one waiting
    device = DeviceFactory().name
    sim = simulator({device: DeviceBehaviour(latency_min_ms=4000, latency_max_ms=4000)})
    first = long_command.delay(device, "long")
    wait_for(lambda: device_lock_state(device).holder == holder(first), what="the long task to hold")
    fence = device_lock_state(device).fence
    second = long_command.delay(device, "next")

    # when both have run (the monitor reclaims expired leases every 0.5 s meanwhile)
    wait_for(lambda: idle_after(sim, device, 2), what="both tasks to run")

    # then the first kept its lock throughout: no reclaim, no overlap
    assert ran(sim, device) == [first.id, second.id]
    assert sim.received(device)[0]["token"] == fence
    assert not RunEvent.objects.filter(kind="lock.reclaimed", device=device).exists()
    assert_serialized(sim, device, latency=4.0)


def test_steps_and_tasks_share_one_device_queue(stack, simulator):
    # given a task holding a device, then a job run and another task waiting for it
    device = DeviceFactory()
    sim = simulator({device.name: DeviceBehaviour(latency_min_ms=500, latency_max_ms=500)})
    before = device_command.delay(device.name, "task-before")
    wait_for(lambda: device_lock_state(device.name).holder == holder(before), what="the task to hold")
    run, _ = run_start(template=template_with_steps((device, "step-work", {})))
    wait_for(lambda: StepRun.objects.filter(run=run).exists(), what="the step to start")
    step_holder = f"step:{StepRun.objects.get(run=run).pk}"
    wait_for(lambda: device_lock_state(device.name).queue == [step_holder], what="the step to queue")
    after = device_command.delay(device.name, "task-after")
    wait_for(lambda: len(device_lock_state(device.name).queue) == 2, what="the second task to park")

    # when the first task ends
    wait_for(lambda: idle_after(sim, device.name, 3), what="the task, the step and the task to run")

    # then the run waited for the task, and the next task for the run (task -> step -> task)
    assert JobRun.objects.get(pk=run.pk).status == RunStatus.SUCCEEDED
    assert [c["action"] for c in sim.received(device.name)] == ["task-before", "step-work", "task-after"]
    assert ran(sim, device.name) == [before.id, str(run.pk), after.id]
    assert_serialized(sim, device.name, latency=0.5)


def test_a_queued_task_that_is_not_parked_is_passed_over(stack, simulator):
    # given a lock holder, then a waiter "task:ghost" with no parked entry, then a real task
    device = DeviceFactory().name
    sim = simulator({device: DeviceBehaviour()})
    grant = blocked(device)
    device_lock_acquire(device, holder="task:ghost", priority=5, lease_seconds=60)
    real = device_command.delay(device, "real")
    wait_for(lambda: len(device_lock_state(device).queue) == 2, what="the real task to park")

    # when the lock is released
    unblock(device, grant)

    # then the ghost's turn is skipped and the real task runs
    wait_for(lambda: idle_after(sim, device, 1), what="the real task to run")
    assert ran(sim, device) == [real.id]


def test_a_revoked_parked_task_does_not_stall_the_device(stack, simulator):
    # given two tasks parked behind a holder, the first of them revoked
    device = DeviceFactory().name
    sim = simulator({device: DeviceBehaviour()})
    grant = blocked(device)
    revoked = device_command.delay(device, "revoked")
    wait_for(lambda: len(device_lock_state(device).queue) == 1, what="the first task to park")
    kept = device_command.delay(device, "kept")
    wait_for(lambda: len(device_lock_state(device).queue) == 2, what="the second task to park")
    confirmed = celery_app.control.revoke(revoked.id, reply=True, limit=1, timeout=5)
    assert confirmed, "no worker confirmed the revoke"

    # when the lock is released (to the revoked task first)
    unblock(device, grant)

    # then the worker drops the revoked task, its lock goes on at once, and the other runs
    # (without the revoke handler the lock would wait out the task's 10 s lease)
    wait_for(lambda: idle_after(sim, device, 1), timeout=5, what="the kept task to run")
    assert ran(sim, device) == [kept.id]
    assert task_parked(revoked.id) is None


def test_tasks_wait_while_the_lock_state_is_rebuilt(stack, simulator):
    # given Redis lost the lock state, and the monitor cannot rebuild it for 2 s
    device = DeviceFactory().name
    sim = simulator({device: DeviceBehaviour()})
    conn = lock_redis_connection()
    conn.set(redis_key("lock-rebuild"), "1", ex=2)  # jobs/monitor.py's rebuild guard
    conn.delete(*lock_epoch_keys())
    log_offset = stack.supervisor.log_size("worker")

    # when a task is sent
    result = device_command.delay(device, "after-rebuild")

    # then it is sent again until the locks are rebuilt, then runs
    wait_for(lambda: idle_after(sim, device, 1), what="the task to run after the rebuild")
    assert ran(sim, device) == [result.id]
    worker_log = stack.supervisor.children["worker"].log_text()[log_offset:]
    assert f"device locks are being rebuilt; tests.lock_tasks.device_command[{result.id}]" in worker_log


def test_a_direct_call_runs_only_on_a_free_device(stack, simulator):
    # given a free device
    device = DeviceFactory().name
    sim = simulator({device: DeviceBehaviour()})

    # when the task is called in this process, then it runs under the lock and releases it
    reply = device_command(device, "inline")
    assert reply["ok"] is True and sim.received(device)[0]["run"] == "inline"
    assert device_lock_state(device).holder is None

    # and on a busy device it refuses (it could not be sent again) without queueing
    grant = blocked(device)
    with pytest.raises(DeviceBusy):
        device_command(device, "inline-busy")
    assert device_lock_state(device).queue == []
    assert len(sim.received(device)) == 1
    unblock(device, grant)
