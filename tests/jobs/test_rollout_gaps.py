"""Gaps between waves and continuous fan-outs, on the real stack: a soak whose deadline Redis
lost and a webhook gate whose task was lost are found again by the monitor's sweep; a
continuous fan-out closes when its run ends; a device joining a continuous fan-out in waves
goes into the open wave."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.utils import timezone

from devtools.simulator import DeviceBehaviour
from jobs.cancel import run_cancel
from jobs.deadlines import Deadline, deadlines_clear
from jobs.engine.continuous import fanout_close
from jobs.engine.due import step_deadline
from jobs.models import ContinuousFanout, JobRun, Rollout, RunEvent, RunStatus, StepRun, StepStatus
from jobs.rollouts import rollout_act
from jobs.services import run_start
from tests.conftest import wait_for
from tests.factories import DeviceFactory, JobStepFactory
from tests.jobs.test_rollout_waves import ACTION, Gate, event, finished, fleet, in_state, rows_of_wave

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

# The monitor's sweep runs every IOTQUEUE_RECONCILE_SECONDS (3 s in the suite's stack).
SWEEP_SECONDS = 30


@pytest.fixture
def gate() -> Iterator[Gate]:
    server = Gate((200, {"approve": True}))
    yield server
    server.close()


def test_a_soak_whose_deadline_redis_lost_ends_by_the_monitors_sweep_and_only_once(stack, simulator):
    # given a canary that soaks an hour, then a wave behind an approval, then the rest
    label = f"gsoak-{uuid.uuid4().hex[:6]}"
    simulator(fleet(label, 4))
    waves = [{"count": 1, "soak_seconds": 3600}, {"count": 1, "gate": "approval"}, {"rest": True}]
    step = JobStepFactory(device=None, labels={"kind": label}, action=ACTION, waves=waves)
    run, _ = run_start(template=step.template)
    soaking = wait_for(lambda: in_state(run, "soaking", 1), what="the canary's soak")

    # when Redis loses the soak's deadline, and the soak has ended meanwhile
    anchor = rows_of_wave(run, 2).order_by("pk").first()
    lost = Deadline("soak", anchor.pk, 0)
    deadlines_clear([lost])
    Rollout.objects.filter(pk=soaking.pk).update(soak_until=timezone.now() - timedelta(hours=1))

    # then the monitor's sweep finds it: the canary's gate (auto) opens wave 2, which runs
    # and waits at its approval gate
    wait_for(
        lambda: in_state(run, "awaiting_approval", 2), timeout=SWEEP_SECONDS, what="the sweep to end the soak"
    )
    approved = RunEvent.objects.get(run=run, kind="rollout.approved")
    assert approved.data["by"] == "auto" and "wave 2 opens" in approved.message

    # when the lost deadline comes back late (it fires now, as a restored Redis would)
    step_deadline(deadline=lost)

    # then it decides nothing again: one approval, two waves started, still at wave 2's gate
    assert RunEvent.objects.filter(run=run, kind="rollout.approved").count() == 1
    assert RunEvent.objects.filter(run=run, kind="wave.started").count() == 2
    assert in_state(run, "awaiting_approval", 2) is not None

    rollout_act(run=run, action="approve", by="ops")
    assert wait_for(lambda: finished(run)).status == RunStatus.SUCCEEDED


def test_a_webhook_gate_whose_task_was_lost_is_asked_again_by_the_monitors_sweep(stack, simulator, gate):
    # given a canary that passed and waits at its gate
    label = f"gwhk-{uuid.uuid4().hex[:6]}"
    simulator(fleet(label, 3))
    waves = [{"count": 1, "gate": "approval"}, {"rest": True}]
    step = JobStepFactory(device=None, labels={"kind": label}, action=ACTION, waves=waves)
    run, _ = run_start(template=step.template)
    rollout = wait_for(lambda: in_state(run, "awaiting_approval", 1), what="the canary's gate")

    # when it awaits a webhook gate whose task was lost (the broker away when the wave
    # ended): the rollout waits for the webhook, and nothing asks it
    rollout.waves[0].update(gate="webhook", webhook_url=gate.url)
    Rollout.objects.filter(pk=rollout.pk).update(
        waves=rollout.waves, state="awaiting_webhook", updated_at=timezone.now() - timedelta(hours=1)
    )

    # then the monitor's sweep asks the webhook again; it approves, and the rest goes out
    assert wait_for(lambda: finished(run), timeout=SWEEP_SECONDS).status == RunStatus.SUCCEEDED
    again = RunEvent.objects.get(run=run, kind="rollout.gate_asked_again")
    assert again.data["by"] == "auto" and gate.url in again.message
    assert RunEvent.objects.get(run=run, kind="rollout.approved").data["by"] == "webhook"
    assert len(gate.asked) == 1 and gate.asked[0]["wave"] == 1


@pytest.mark.parametrize("ending", ["canceled", "timed_out"])
def test_a_continuous_fanout_closes_when_its_run_ends(stack, ending):
    # given a continuous fan-out open until closed by hand, its selector matching no device yet
    step = JobStepFactory(
        device=None, selector=f"site=gone-{uuid.uuid4().hex[:6]}", action=ACTION, continuous=True
    )
    if ending == "timed_out":
        step.template.max_duration = 2
        step.template.save(update_fields=["max_duration"])
    run, _ = run_start(template=step.template)
    wait_for(lambda: ContinuousFanout.objects.filter(run=run).exists(), what="the fan-out open")

    # when the run is canceled, or passes its max_duration
    if ending == "canceled":
        assert run_cancel(run=run, by="ops")
    assert wait_for(lambda: finished(run), timeout=30).status == ending

    # then the fan-out is closed at once (no device change needed), saying why
    opened = wait_for(
        lambda: ContinuousFanout.objects.filter(run=run, closed_at__isnull=False).first(),
        what="the fan-out closed",
    )
    assert opened.closed_by == ""
    closing = RunEvent.objects.get(run=run, kind="step.fanout_closed")
    assert closing.message.endswith(f"the run ended {ending}") and closing.data["run_ended"] == ending
    assert not ContinuousFanout.objects.filter(run=run, closed_at=None).exists()


def test_a_device_joining_a_continuous_fanout_in_waves_goes_into_the_open_wave(stack, simulator):
    # given a continuous fan-out in waves, its second wave done and waiting at its gate
    label = f"gjoin-{uuid.uuid4().hex[:6]}"
    sim = simulator(fleet(label, 4))
    waves = [{"count": 1}, {"count": 1, "gate": "approval"}, {"rest": True}]
    step = JobStepFactory(device=None, labels={"kind": label}, action=ACTION, waves=waves, continuous=True)
    run, _ = run_start(template=step.template)
    wait_for(lambda: in_state(run, "awaiting_approval", 2), what="wave 2's gate")

    # when a gateway is installed: it comes to match the open fan-out
    installed = DeviceFactory(name=f"{label}-zz-new", labels={"kind": label})
    sim.device_add(installed.name, DeviceBehaviour())

    # then it joins the open wave (wave 2, not the canary's), and waits with it at the gate
    wait_for(lambda: event(run, "step.fanout_joined"), what="the device to join")
    row = StepRun.objects.get(run=run, device=installed)
    assert (row.wave, row.status) == (1, StepStatus.PENDING)
    rollout = Rollout.objects.get(run=run)
    assert [w["size"] for w in rollout.waves] == [1, 2, 2]

    # when wave 3 is approved, it starts with the rest; closing the fan-out ends the run
    rollout_act(run=run, action="approve", by="ops")
    wait_for(
        lambda: not StepRun.objects.filter(run=run).exclude(status=StepStatus.SUCCEEDED).exists(),
        what="every device done",
    )
    assert fanout_close(run=run, by="ops") == 0
    assert wait_for(lambda: finished(run)).status == RunStatus.SUCCEEDED
    assert [a["action"] for a in sim.received(installed.name)] == [ACTION]
    assert JobRun.objects.get(pk=run.pk).status == RunStatus.SUCCEEDED
