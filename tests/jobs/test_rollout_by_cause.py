"""Rollouts that ramp and abort by cause, and a run's max_duration, on the real stack."""

import itertools
import uuid

import pytest

from devices.protocol import CANCEL_ACTION
from devtools.simulator import DeviceBehaviour
from jobs.models import JobRun, OnFailure, Phase, RunEvent, RunStatus, StepRun, StepStatus
from jobs.services import run_start
from tests.conftest import wait_for
from tests.factories import DeviceFactory, JobStepFactory, JobTemplateFactory

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

ACTION = "firmware/check"
CAUSES = ("failed", "rejected", "timed_out")
# Simulated devices whose rows end with each cause (silent ones time out after the step's timeout).
CAUSE_BEHAVIOURS = {
    "failed": DeviceBehaviour(failing_actions=frozenset({ACTION})),
    "rejected": DeviceBehaviour(rejecting_actions=frozenset({ACTION})),
    "timed_out": DeviceBehaviour(silent=True),
    "succeeded": DeviceBehaviour(),
}


def finished(run: JobRun) -> JobRun | None:
    run.refresh_from_db()
    return run if run.is_terminal else None


def fleet_by_outcome(label: str, each: int) -> dict[str, DeviceBehaviour]:
    """`each` devices per outcome (failed, rejected, timed out, succeeded), labelled kind=label."""
    return {
        DeviceFactory(name=f"{label}-{outcome}-{i}", labels={"kind": label}).name: behaviour
        for outcome, behaviour in CAUSE_BEHAVIOURS.items()
        for i in range(each)
    }


@pytest.mark.parametrize("cause", [*CAUSES, "any"])
def test_each_abort_criterion_trips_on_its_own_cause_and_not_on_the_others(stack, simulator, cause):
    # given 2 devices that fail, 2 that reject, 2 that stay silent and 2 that succeed (25 % each),
    label = f"cause-{uuid.uuid4().hex[:6]}"
    simulator(fleet_by_outcome(label, each=2))
    # and a criterion per cause, tested once all 8 ended: 30 % for each single cause, 80 % for
    # any (none of them trips), except the cause under test: 20 % (70 % for any), tested last
    thresholds = {**dict.fromkeys(CAUSES, 30), "any": 80}
    thresholds[cause] = 70 if cause == "any" else 20
    order = [c for c in thresholds if c != cause] + [cause]
    criteria = [{"cause": c, "threshold_percent": thresholds[c], "min_executed": 8} for c in order]
    step = JobStepFactory(
        device=None, labels={"kind": label}, action=ACTION, timeout_seconds=2, abort_criteria=criteria
    )

    run, _ = run_start(template=step.template)

    # then the step fails by that criterion alone: a criterion counting another cause than its
    # own would have tripped first (25 % of each cause is past 20 %)
    assert wait_for(lambda: finished(run)).status == RunStatus.FAILED
    assert f"rollout aborted by criterion {cause}" in run.error
    aborted = RunEvent.objects.get(run=run, kind="step.aborted")
    expected_count = 6 if cause == "any" else 2
    criterion = aborted.data["criterion"]
    assert (criterion["cause"], criterion["count"], criterion["executed"]) == (cause, expected_count, 8)
    assert criterion["percent"] == expected_count * 100 / 8


def test_a_criterion_for_one_cause_ignores_the_others(stack, simulator):
    # given devices that fail, reject and stay silent (3 of 4 devices end badly) but none
    # that the criterion counts: it is for rejections, and no device rejects
    label = f"calm-{uuid.uuid4().hex[:6]}"
    rejecting = CAUSE_BEHAVIOURS["rejected"]
    behaviours = {name: b for name, b in fleet_by_outcome(label, each=2).items() if b is not rejecting}
    sim = simulator(behaviours)
    step = JobStepFactory(
        device=None,
        labels={"kind": label},
        action=ACTION,
        timeout_seconds=2,
        success_percent=0,
        abort_criteria=[{"cause": "rejected", "threshold_percent": 0, "min_executed": 1}],
    )

    run, _ = run_start(template=step.template)

    # then the rollout reaches every device and the step is decided by its success criterion
    assert wait_for(lambda: finished(run)).status == RunStatus.SUCCEEDED
    assert RunEvent.objects.filter(run=run, kind="step.fanout_done").exists()
    assert not RunEvent.objects.filter(run=run, kind="step.aborted").exists()
    assert all(sim.received(name) for name in behaviours)


def test_a_run_past_its_max_duration_times_out_and_its_command_is_canceled(stack, simulator):
    # given a run of at most 2 s whose only step waits on a silent device for up to 60 s
    device = DeviceFactory()
    sim = simulator({device.name: DeviceBehaviour(silent=True)})
    template = JobTemplateFactory(max_duration=2)
    JobStepFactory(template=template, device=device, action=ACTION, timeout_seconds=60)

    run, _ = run_start(template=template)

    # then the run ends timed_out, its step too, and the device is told to cancel the command
    assert wait_for(lambda: finished(run)).status == RunStatus.TIMED_OUT
    assert "max_duration (2s)" in run.error
    row = StepRun.objects.get(run=run)
    assert row.status == StepStatus.TIMED_OUT
    cancel = wait_for(
        lambda: [c for c in sim.received(device.name) if c["action"] == CANCEL_ACTION], what="cancel"
    )
    assert cancel[0]["args"] == {"id": row.command_id}
    assert run.max_duration == 2 and run.deadline is not None


def test_a_run_past_its_max_duration_rolls_back_when_its_policy_says_so(stack, simulator):
    # given a rollback job: a step that succeeds (and has an undo), then a device that never answers
    agent, stuck = DeviceFactory(), DeviceFactory()
    sim = simulator({agent.name: DeviceBehaviour(), stuck.name: DeviceBehaviour(silent=True)})
    template = JobTemplateFactory(max_duration=3)
    for position, device in enumerate((agent, stuck)):
        JobStepFactory(
            template=template,
            position=position,
            device=device,
            action=ACTION,
            timeout_seconds=60,
            on_failure=OnFailure.ROLLBACK,
            compensation_action="firmware/restore" if device is agent else "",
        )

    run, _ = run_start(template=template)

    # then the stuck command is canceled and the first step is undone: the run is compensated
    assert wait_for(lambda: finished(run)).status == RunStatus.COMPENSATED
    assert "max_duration (3s)" in run.error
    assert [c["action"] for c in sim.received(agent.name)] == [ACTION, "firmware/restore"]
    assert wait_for(lambda: [c for c in sim.received(stuck.name) if c["action"] == CANCEL_ACTION])
    undo = StepRun.objects.get(run=run, phase=Phase.COMPENSATION)
    assert (undo.index, undo.status) == (0, StepStatus.SUCCEEDED)


def test_an_exponential_rollout_starts_at_its_base_rate_and_steps_up_as_devices_succeed(stack, simulator):
    # given 60 devices and a ramp: 120 a minute (2 a second), doubled after every 10 successes
    label = f"ramp-{uuid.uuid4().hex[:6]}"
    fleet = [DeviceFactory(name=f"{label}-{i:02d}", labels={"kind": label}) for i in range(60)]
    sim = simulator({d.name: DeviceBehaviour() for d in fleet})
    step = JobStepFactory(
        device=None,
        labels={"kind": label},
        action=ACTION,
        rollout_per_minute=120,
        rollout_increment_factor=2.0,
        rollout_increment_every=10,
    )

    run, _ = run_start(template=step.template)

    assert wait_for(lambda: finished(run), timeout=60).status == RunStatus.SUCCEEDED
    # when: the times the devices received their command, as the simulator measured them
    times = sorted(sim.received(d.name)[0]["received_at"] for d in fleet)
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    # then the first 10 went out at about the base rate (4.5 s at 2 a second, not at once)
    assert times[9] - times[0] >= 2.5
    # and later commands come faster: the last 20 gaps average under half the first 9's
    first, last = sum(gaps[:9]) / 9, sum(gaps[-20:]) / 20
    assert last < first / 2, (first, last)
    assert RunEvent.objects.filter(run=run, kind="step.fanout_done", message__startswith="60 of 60").exists()


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"abort_criteria": [{"cause": "melted", "threshold_percent": 5}]}, "abort_criteria", "cause is one"),
        ({"abort_criteria": [{"cause": "any", "threshold_percent": 101}]}, "abort_criteria", "0 to 100"),
        ({"abort_criteria": {"cause": "any"}}, "abort_criteria", "JSON list"),
        ({"rollout_increment_factor": 2, "rollout_increment_every": 10}, "rollout_per_minute", "base rate"),
        ({"rollout_increment_factor": 2, "rollout_per_minute": 60}, "rollout_increment_every", "steps up"),
    ],
)
def test_bad_rollout_settings_are_refused_naming_the_field(admin_api, fields, field, message):
    step = {"position": 0, "labels": {"kind": "pump"}, "action": ACTION, **fields}
    response = admin_api.post("/api/templates/", {"name": "Ramp", "steps": [step]}, format="json")
    assert response.status_code == 400
    assert message in response.json()["steps"]["0"][field][0]


def test_max_duration_is_part_of_the_version_and_the_run(admin_api):
    step = {"position": 0, "labels": {"kind": "pump"}, "action": ACTION}
    body = {"name": "Timed", "max_duration": 600, "steps": [step]}
    assert admin_api.post("/api/templates/", body, format="json").status_code == 201
    assert admin_api.patch("/api/templates/Timed/", {"max_duration": 900}, format="json").status_code == 200
    versions = admin_api.get("/api/templates/Timed/versions/").json()["results"]
    assert [(v["number"], v["max_duration"]) for v in versions] == [(2, 900), (1, 600)]
