"""The engine under contention and misbehaving devices: FIFO, priority, retries, timeouts,
stale replies, cancel and offline devices — real worker, bridge, beat, Redis and broker."""

import pytest

from devices.locks import (
    Grant,
    device_lock_acquire,
    device_lock_handoff,
    device_lock_release,
    device_lock_state,
)
from devtools.simulator import DeviceBehaviour
from jobs.models import JobRun, RunEvent, RunStatus, StepRun, StepStatus
from jobs.services import run_start
from jobs.tasks import run_cancel_task
from tests.conftest import wait_for
from tests.factories import DeviceFactory, JobStepFactory, template_with_steps

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]


def finished(run: JobRun) -> JobRun | None:
    run.refresh_from_db()
    return run if run.is_terminal else None


def step_of(run: JobRun, index: int = 0) -> StepRun | None:
    return StepRun.objects.filter(run=run, index=index).first()


def test_fifty_runs_on_one_device_never_overlap_and_are_served_in_priority_then_fifo_order(stack, simulator):
    # given a device held by someone else, and 50 runs queued on it one after the other
    device = DeviceFactory()
    sim = simulator({device.name: DeviceBehaviour(latency_min_ms=5, latency_max_ms=15)})
    template = template_with_steps((device, "work", {}))
    blocker = device_lock_acquire(device.name, holder="test:blocker", priority=5, lease_seconds=60)
    assert isinstance(blocker, Grant)
    runs = []
    for n in range(50):
        run, _ = run_start(template=template, priority=9 if n % 10 == 3 else 5)
        runs.append(run)
        wait_for(lambda n=n: len(device_lock_state(device.name).queue) == n + 1, what=f"run {n} to queue")

    # when the device is released
    device_lock_handoff(
        device.name, device_lock_release(device.name, holder="test:blocker", fence=blocker.fence)
    )
    for run in runs:
        wait_for(lambda run=run: finished(run), what="every run to finish")

    # then every run succeeded, one command at a time, urgent ones first, FIFO otherwise
    assert {r.status for r in runs} == {RunStatus.SUCCEEDED}
    assert sim.stats()["totals"]["overlaps"] == 0
    assert sim.stats()["totals"]["token_regressions"] == 0
    expected = [r for r in runs if r.priority == 9] + [r for r in runs if r.priority == 5]
    assert [c["run"] for c in sim.received(device.name)] == [str(r.pk) for r in expected]


def test_silent_device_times_out_retries_then_fails_and_lock_passes_on(stack, simulator):
    # given a device that never answers, a step with 2 attempts, and a second run waiting
    device = DeviceFactory()
    sim = simulator({device.name: DeviceBehaviour(silent=True)})
    template = template_with_steps((device, "ping", {}))
    template.steps.update(timeout_seconds=1, max_attempts=2, backoff_seconds=0.2)
    first, _ = run_start(template=template)
    wait_for(
        lambda: step_of(first) and step_of(first).status == StepStatus.DISPATCHED, what="first dispatched"
    )
    second, _ = run_start(template=template)

    # when the attempts run out
    wait_for(lambda: finished(first), what="first run to end")

    # then the step was tried twice with new command ids and the run timed out
    step = step_of(first)
    assert (first.status, step.status, step.attempt) == (RunStatus.TIMED_OUT, StepStatus.TIMED_OUT, 2)
    kinds = list(RunEvent.objects.filter(step_run=step).values_list("kind", flat=True))
    assert kinds.count("step.dispatched") == 2 and "step.retrying" in kinds
    ids = [c["id"] for c in sim.received(device.name) if c["run"] == str(first.pk)]
    assert len(set(ids)) == 2
    # and the lock went to the waiting run, which got its command
    wait_for(lambda: any(c["run"] == str(second.pk) for c in sim.received(device.name)), what="hand-off")
    assert sim.stats()["totals"]["overlaps"] == 0


def test_duplicate_late_and_out_of_order_replies_change_nothing(stack, manual_device):
    # given a step with two attempts on a hand-driven device
    device = DeviceFactory()
    hand = manual_device(device.name)
    template = template_with_steps((device, "measure", {}))
    template.steps.update(timeout_seconds=1, max_attempts=2, backoff_seconds=0.1)
    run, _ = run_start(template=template)

    # when attempt 1 goes unanswered and times out, and attempt 2 arrives
    first = hand.next_command()
    second = hand.next_command()
    assert (first["attempt"], second["attempt"]) == (1, 2) and second["token"] > first["token"]

    # then a late done for attempt 1 is stale and changes nothing
    hand.done(first["id"], result={"v": "late"})
    wait_for(
        lambda: RunEvent.objects.filter(kind="reply.stale", data__reply_id=first["id"]).exists(), what="stale"
    )
    assert step_of(run).status == StepStatus.DISPATCHED

    # and done before ack is fine; the ack, progress and a duplicate done after it are stale
    hand.done(second["id"], result={"v": 2})
    wait_for(lambda: finished(run), what="run to end")
    hand.reply("ack", {"id": second["id"]})
    hand.reply("progress", {"id": second["id"], "progress": 50})
    hand.done(second["id"], ok=False, error="dup")
    wait_for(
        lambda: RunEvent.objects.filter(step_run=step_of(run), kind="reply.stale").count() >= 4, what="stales"
    )
    step = step_of(run)
    assert (run.status, step.status, step.result, step.progress) == (
        RunStatus.SUCCEEDED,
        "succeeded",
        {"v": 2},
        100,
    )


def test_cancel_queued_and_in_flight_runs(stack, simulator):
    # given a silent device with one run in flight and one queued behind it
    device = DeviceFactory()
    sim = simulator({device.name: DeviceBehaviour(silent=True)})
    template = template_with_steps((device, "hold", {}))
    in_flight, _ = run_start(template=template)
    wait_for(
        lambda: step_of(in_flight) and step_of(in_flight).status == StepStatus.DISPATCHED, what="dispatch"
    )
    queued, _ = run_start(template=template)
    third, _ = run_start(template=template)
    wait_for(lambda: len(device_lock_state(device.name).queue) == 2, what="two waiting")

    # when the queued run is canceled, then the in-flight one
    run_cancel_task.delay(str(queued.pk), "tester")
    wait_for(lambda: finished(queued), what="queued run canceled")
    assert device_lock_state(device.name).queue == [f"step:{step_of(third).pk}"]
    run_cancel_task.delay(str(in_flight.pk), "tester")
    wait_for(lambda: finished(in_flight), what="in-flight run canceled")

    # then both ended canceled, the device got a cancel for the in-flight command,
    # and the lock went to the third run
    assert (queued.status, step_of(queued).status) == (RunStatus.CANCELED, StepStatus.CANCELED)
    assert (in_flight.status, step_of(in_flight).status) == (RunStatus.CANCELED, StepStatus.CANCELED)
    wait_for(lambda: any(c["run"] == str(third.pk) for c in sim.received(device.name)), what="hand-off")
    cancels = [c for c in sim.received(device.name) if c["action"] == "cancel"]
    assert cancels and cancels[0]["args"]["id"] == step_of(in_flight).command_id
    assert sim.stats()["totals"]["overlaps"] == 0


def test_offline_device_waits_until_online(stack, simulator):
    # given a device that is offline when the run starts
    device = DeviceFactory(online=False)
    template = template_with_steps((device, "wake", {}))
    run, _ = run_start(template=template)
    wait_for(
        lambda: RunEvent.objects.filter(step_run__run=run, message__contains="offline").exists(), what="wait"
    )
    assert step_of(run).status == StepStatus.QUEUED

    # when it comes online (retained status via the bridge)
    simulator({device.name: DeviceBehaviour()})

    # then the step runs
    assert wait_for(lambda: finished(run), what="run to end").status == RunStatus.SUCCEEDED


def test_offline_device_beyond_queue_timeout_fails_the_step_with_the_reason(stack):
    device = DeviceFactory(online=False)
    template = template_with_steps((device, "wake", {}))
    template.steps.update(queue_timeout_seconds=1)
    run, _ = run_start(template=template)
    wait_for(lambda: finished(run), what="run to end")
    assert run.status == RunStatus.TIMED_OUT
    assert "offline" in step_of(run).error


def test_device_dropping_offline_mid_step_is_retried_when_back(stack, simulator):
    # given a slow device executing a step with a retry budget
    device = DeviceFactory()
    sim = simulator({device.name: DeviceBehaviour(latency_min_ms=1500, latency_max_ms=1500)})
    template = template_with_steps((device, "flash", {}))
    template.steps.update(max_attempts=3, backoff_seconds=0.1, timeout_seconds=3)
    run, _ = run_start(template=template)
    wait_for(lambda: sim.received(device.name), what="command received")

    # when the device drops off (its last will says offline) and comes back
    sim.kill(device.name)
    wait_for(lambda: RunEvent.objects.filter(kind="step.device_offline").exists(), what="offline recorded")
    assert step_of(run).status in (StepStatus.DISPATCHED, StepStatus.IN_PROGRESS)  # not handed on
    sim.restart(device.name)

    # then the step is retried and the run succeeds
    assert wait_for(lambda: finished(run), what="run to end").status == RunStatus.SUCCEEDED
    assert step_of(run).attempt == 2
    assert RunEvent.objects.filter(step_run=step_of(run), kind="step.retrying").exists()


def test_step_on_missing_device_fails_the_run(stack):
    device = DeviceFactory()
    template = template_with_steps((device, "x", {}))
    JobStepFactory(template=template, position=1, device=device, action="y")
    device.enabled = False
    device.save()
    run, _ = run_start(template=template)
    assert wait_for(lambda: finished(run)).status == RunStatus.FAILED
    assert "disabled" in run.error


def test_deadline_lost_from_redis_is_refound_in_the_database(stack, simulator):
    # given a step in flight on a silent device whose Redis deadlines were lost
    from jobs.deadlines import Deadline, deadlines_clear

    device = DeviceFactory()
    simulator({device.name: DeviceBehaviour(silent=True)})
    template = template_with_steps((device, "ping", {}))
    template.steps.update(timeout_seconds=1)
    run, _ = run_start(template=template)
    wait_for(lambda: step_of(run) and step_of(run).status == StepStatus.DISPATCHED, what="dispatch")
    step = step_of(run)
    deadlines_clear([Deadline("done", step.pk, 1, device.name), Deadline("send", step.pk, 1, device.name)])

    # then the database sweep still times it out
    assert wait_for(lambda: finished(run), what="run to end").status == RunStatus.TIMED_OUT


def test_runs_left_behind_by_lost_tasks_are_moved_on_by_the_sweep(stack, simulator):
    # given what a killed worker leaves: a run whose start task was lost, and a run whose
    # first step ended but that never moved to its second step
    from datetime import timedelta

    from django.utils import timezone

    from jobs.services import template_plan

    device = DeviceFactory()
    simulator({device.name: DeviceBehaviour()})
    template = template_with_steps((device, "a", {}), (device, "b", {}))
    long_ago = timezone.now() - timedelta(minutes=5)
    unstarted = JobRun.objects.create(template=template, plan=template_plan(template))
    JobRun.objects.filter(pk=unstarted.pk).update(created_at=long_ago)
    stalled = JobRun.objects.create(
        template=template, plan=template_plan(template), status=RunStatus.RUNNING, started_at=long_ago
    )
    StepRun.objects.create(
        run=stalled,
        index=0,
        device=device,
        action="a",
        status=StepStatus.SUCCEEDED,
        attempt=1,
        finished_at=long_ago,
    )
    # ... and one that moved its cursor but died before creating the next step's row
    moved = JobRun.objects.create(
        template=template,
        plan=template_plan(template),
        status=RunStatus.RUNNING,
        started_at=long_ago,
        cursor=1,
    )
    StepRun.objects.create(
        run=moved,
        index=0,
        device=device,
        action="a",
        status=StepStatus.SUCCEEDED,
        attempt=1,
        finished_at=long_ago,
    )

    # then the monitor's database sweep finishes both
    assert wait_for(lambda: finished(unstarted), what="unstarted run").status == RunStatus.SUCCEEDED
    assert wait_for(lambda: finished(stalled), what="stalled run").status == RunStatus.SUCCEEDED
    assert step_of(stalled, 1).status == StepStatus.SUCCEEDED
    assert wait_for(lambda: finished(moved), what="run whose next row was lost").status == RunStatus.SUCCEEDED


def test_legacy_device_with_fixed_topics_and_no_presence(stack, simulator):
    # given a face terminal with fixed firmware topics that never reports presence
    device = DeviceFactory(online=False, presence_required=False)
    device.command_topic = f"dev/face/{device.name}"
    device.reply_topic = f"dev/face/{device.name}/Ack"
    device.save()
    sim = simulator(
        {device.name: DeviceBehaviour(command_topic=device.command_topic, reply_topic=device.reply_topic)}
    )
    template = template_with_steps((device, "add_person", {"person": "{{ params.person }}"}))
    # The bridge picks up new reply topics within its refresh period; retries cover a
    # reply that arrives before it subscribed.
    template.steps.update(timeout_seconds=3, max_attempts=3, backoff_seconds=0.1)

    run, _ = run_start(template=template, parameters={"person": "P-17"})

    assert wait_for(lambda: finished(run), what="run to end").status == RunStatus.SUCCEEDED
    command = sim.received(device.name)[-1]
    assert (command["topic"], command["args"]) == (device.command_topic, {"person": "P-17"})


def test_queued_step_whose_lock_request_was_lost_is_resumed_by_the_sweep(stack, simulator):
    # given a step row committed as queued by a worker that died before asking for the lock
    from datetime import timedelta

    from django.utils import timezone

    from jobs.services import template_plan

    device = DeviceFactory()
    simulator({device.name: DeviceBehaviour()})
    template = template_with_steps((device, "a", {}))
    long_ago = timezone.now() - timedelta(minutes=5)
    run = JobRun.objects.create(
        template=template, plan=template_plan(template), status=RunStatus.RUNNING, started_at=long_ago
    )
    StepRun.objects.create(
        run=run,
        index=0,
        device=device,
        action="a",
        status=StepStatus.QUEUED,
        queued_at=long_ago,
        deadline=timezone.now() + timedelta(minutes=10),
    )

    # then the sweep asks for the lock again and the run finishes
    assert wait_for(lambda: finished(run), what="stranded step resumed").status == RunStatus.SUCCEEDED
