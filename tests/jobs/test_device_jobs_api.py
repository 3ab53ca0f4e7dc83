"""The device's side of a job (protocol v1.1) on the real stack: jobs/get and jobs/current,
a `rejected` done, and `extend_seconds` in progress. The simulator's command log is the
oracle for "no second command"."""

import json
import threading

import pytest
from django.conf import settings

from devices import protocol
from devtools.simulator import DeviceBehaviour
from jobs.models import JobRun, RunEvent, RunStatus, StepRun, StepStatus
from jobs.services import run_start
from tests.conftest import wait_for
from tests.factories import DeviceFactory, template_with_steps
from tests.mqtt_device import COMMAND_WAIT_SECONDS

pytestmark = [pytest.mark.timeout(120), pytest.mark.django_db(transaction=True)]


def finished(run: JobRun) -> JobRun | None:
    run.refresh_from_db()
    return run if run.is_terminal else None


def one_step_run(device, action: str, **step_fields) -> JobRun:
    template = template_with_steps((device, action, {}))
    template.steps.update(**step_fields)
    run, _ = run_start(template=template)
    return run


def kinds(run: JobRun) -> list[str]:
    return list(RunEvent.objects.filter(run=run).values_list("kind", flat=True))


def test_a_device_that_reboots_mid_command_asks_and_finishes_the_same_attempt(stack, simulator):
    # given a device that loses its connection right after receiving a command, and a step
    # that would retry if the attempt timed out
    device = DeviceFactory()
    sim = simulator({device.name: DeviceBehaviour(reboots=True, latency_min_ms=100, latency_max_ms=200)})
    simulated = sim.devices[device.name]
    # A v1.1 device asks on every connect, boot included: wait for that first answer (nothing
    # to do yet), or it could be answered after the dispatch and name the command as well.
    booted = wait_for(lambda: list(simulated.jobs_current), what="the answer to the boot jobs/get")
    assert [a["command"] for a in booted] == [None]
    run = one_step_run(device, "flash", timeout_seconds=30, max_attempts=3)

    # when it reboots, asks with jobs/get and answers the command jobs/current names
    assert wait_for(lambda: finished(run)).status == RunStatus.SUCCEEDED

    # then the step succeeded on attempt 1: one command was ever sent, none again
    received = sim.received(device.name)
    assert [(c["action"], c["attempt"]) for c in received] == [("flash", 1)]
    step = StepRun.objects.get(run=run)
    assert (step.status, step.attempt, step.command_id) == (StepStatus.SUCCEEDED, 1, received[0]["id"])
    # the device rebooted once and learned its command from jobs/current, fence and all
    assert simulated.counts["reboots"] == 1
    resumed = [a["command"] for a in simulated.jobs_current if a["command"]]
    assert [(c["id"], c["token"], c["attempt"]) for c in resumed] == [(step.command_id, step.fence, 1)]
    assert "step.retrying" not in kinds(run)
    assert not sim.overlaps


def test_a_rejected_command_ends_the_step_rejected_without_a_retry(stack, simulator):
    # given a step with attempts to spare on a device that refuses its action
    device = DeviceFactory()
    sim = simulator({device.name: DeviceBehaviour(rejecting_actions=frozenset({"flash"}))})
    run = one_step_run(device, "flash", max_attempts=3, backoff_seconds=0.1)

    # when the device answers with "status": "rejected"
    assert wait_for(lambda: finished(run)).status == RunStatus.FAILED

    # then the step is rejected (not failed), on its first and only attempt
    step = StepRun.objects.get(run=run)
    assert (step.status, step.attempt, step.error) == (StepStatus.REJECTED, 1, "simulated refusal")
    assert len(sim.received(device.name)) == 1
    events = kinds(run)
    assert "step.rejected" in events and "step.retrying" not in events
    assert run.error.endswith("simulated refusal")


def test_extend_seconds_keeps_a_long_step_alive_and_is_refused_past_the_maximum(stack, simulator):
    # given two devices that each take 3.5 s and ask for 5 s more early on, and steps that
    # time out after 2 s: one allows an extension of an hour, the other of one second
    slow = DeviceBehaviour(latency_min_ms=3500, latency_max_ms=3500, extend_seconds=5)
    patient, strict = DeviceFactory(), DeviceFactory()
    simulator({patient.name: slow, strict.name: slow})
    extended = one_step_run(patient, "flash", timeout_seconds=2)
    refused = one_step_run(strict, "flash", timeout_seconds=2, max_extend_seconds=1)

    # then the extended step outlives its original deadline and succeeds
    assert wait_for(lambda: finished(extended)).status == RunStatus.SUCCEEDED
    step = StepRun.objects.get(run=extended)
    assert step.attempt == 1 and (step.finished_at - step.dispatched_at).total_seconds() > 2
    event = RunEvent.objects.get(run=extended, kind="step.extended")
    assert event.data["extend_seconds"] == 5
    progress = RunEvent.objects.get(run=extended, kind="step.progress")
    assert progress.data["detail"] == "working; asking for more time" and progress.data["progress"] == 10

    # and the request past the maximum is refused: its step times out at the original deadline
    assert wait_for(lambda: finished(refused)).status == RunStatus.TIMED_OUT
    assert StepRun.objects.get(run=refused).status == StepStatus.TIMED_OUT
    refusal = RunEvent.objects.get(run=refused, kind="step.extend_refused")
    assert "the step allows 1s" in refusal.message and "step.extended" not in kinds(refused)


def jobs_asker(hand):
    """Subscribe the hand-driven device to its jobs/current; returns ask() -> the answer."""
    current = f"{settings.IOTQUEUE_TOPIC_PREFIX}/{hand.name}/{protocol.JOBS_CURRENT}"
    subscribed = threading.Event()
    hand.client.on_subscribe = lambda *args: subscribed.set()
    hand.client.subscribe(current, qos=1)
    assert subscribed.wait(COMMAND_WAIT_SECONDS)

    def ask(payload: bytes) -> dict:
        get = f"{settings.IOTQUEUE_TOPIC_PREFIX}/{hand.name}/{protocol.JOBS_GET}"
        hand.client.publish(get, payload, qos=1).wait_for_publish(5)
        return hand.next_command()  # the device's one queue gets commands and answers alike

    return ask


def test_jobs_get_answers_null_when_idle_and_the_command_verbatim_with_the_queue(stack, manual_device):
    # given a hand-driven device with nothing to do
    device = DeviceFactory()
    hand = manual_device(device.name)
    raw = {}
    hand.client.on_message = lambda c, u, m: (
        raw.setdefault(m.topic, m.payload),
        hand.commands.put(json.loads(m.payload)),
    )
    ask = jobs_asker(hand)

    # when it asks (empty payload), it hears: no command, nobody waiting
    assert ask(b"") == {"command": None, "queued": 0}

    # when a command is in flight and a second run waits for the device's lock
    first = one_step_run(device, "flash", timeout_seconds=30)
    command = hand.next_command()
    second = one_step_run(device, "flash", timeout_seconds=30)
    wait_for(
        lambda: RunEvent.objects.filter(run=second, kind="step.waiting").exists(),
        what="the second run to queue for the device",
    )

    # then asking (twice, with {}) answers that same command, byte for byte, and one waiting
    command_topic = next(topic for topic in raw if "/cmd/" in topic)
    for _ in range(2):
        answer = ask(b"{}")
        assert answer == {"command": command, "queued": 1}
    assert json.dumps(answer["command"], separators=(",", ":")).encode() == raw[command_topic]

    # and after its done the device is handed the next command; asking answers that one
    hand.done(command["id"])
    assert wait_for(lambda: finished(first)).status == RunStatus.SUCCEEDED
    following = hand.next_command()
    assert following["run"] == str(second.pk)
    assert ask(b"") == {"command": following, "queued": 0}
    hand.done(following["id"])
    assert wait_for(lambda: finished(second)).status == RunStatus.SUCCEEDED
    assert ask(b"") == {"command": None, "queued": 0}
