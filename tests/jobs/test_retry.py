"""Retry from the failed step: earlier steps carried over, not re-sent; a fan-out re-runs
only its devices that did not succeed; what cannot be retried says why."""

import uuid

import pytest
from rest_framework.test import APIClient

from devtools.simulator import DeviceBehaviour
from jobs.models import JobRun, Phase, RunEvent, RunStatus, StepRun, StepStatus
from jobs.retry import RetryError, run_retry
from jobs.services import run_start, template_plan
from tests.conftest import wait_for
from tests.factories import DeviceFactory, JobStepFactory, template_with_steps

pytestmark = pytest.mark.timeout(180)


def finished(run: JobRun) -> JobRun | None:
    run.refresh_from_db()
    return run if run.is_terminal else None


def actions(sim, device, action: str) -> int:
    return sum(1 for command in sim.received(device.name) if command["action"] == action)


@pytest.mark.django_db(transaction=True)
def test_retry_carries_earlier_steps_and_resumes_at_the_failed_one(stack, simulator, admin_api):
    # given read_info -> register (broken on the registry, uses the serial) -> finish
    agent, registry = DeviceFactory(), DeviceFactory()
    sim = simulator(
        {
            agent.name: DeviceBehaviour(),
            registry.name: DeviceBehaviour(failing_actions=frozenset({"register"})),
        }
    )
    template = template_with_steps(
        (agent, "read_info", {}),
        (registry, "register", {"serial": "{{ steps.info.result.serial }}"}),
        (agent, "finish", {}),
    )
    template.steps.filter(position=0).update(name="info")
    failed, _ = run_start(template=template)
    assert wait_for(lambda: finished(failed)).status == RunStatus.FAILED
    assert failed.cursor == 1

    # when the registry is repaired and the operator retries over REST
    sim.devices[registry.name].behaviour = DeviceBehaviour()
    api = admin_api
    response = api.post(f"/api/runs/{failed.pk}/retry/")
    assert response.status_code == 201, response.content
    retry = JobRun.objects.get(pk=response.json()["id"])

    # then the retry succeeds without sending step 0 again, and step 1 still gets its serial
    assert wait_for(lambda: finished(retry)).status == RunStatus.SUCCEEDED
    assert response.json()["retry_of"] == str(failed.pk)
    assert actions(sim, agent, "read_info") == 1
    assert actions(sim, registry, "register") == 2
    assert sim.received(registry.name)[-1]["args"] == {"serial": f"SN-{agent.name}"}
    carried = StepRun.objects.get(run=retry, index=0)
    assert (carried.status, carried.command_id) == (StepStatus.SUCCEEDED, None)
    assert carried.result == StepRun.objects.get(run=failed, index=0).result
    # the failed run stays as it ended, and its timeline says where it went
    failed.refresh_from_db()
    assert failed.status == RunStatus.FAILED
    assert RunEvent.objects.filter(run=failed, kind="run.retried", data__retry=str(retry.pk)).exists()
    assert not sim.overlaps

    # and a run is retried once: the retry is what to retry next
    again = api.post(f"/api/runs/{failed.pk}/retry/")
    assert again.status_code == 409 and "already retried" in again.json()["detail"]
    assert api.post(f"/api/runs/{retry.pk}/retry/").status_code == 409  # it succeeded


@pytest.mark.django_db(transaction=True)
def test_retry_of_a_fanout_reruns_only_the_devices_that_failed(stack, simulator):
    label = f"retry-{uuid.uuid4().hex[:6]}"
    fleet = [DeviceFactory(name=f"{label}-{i}", labels={"kind": label}) for i in range(4)]
    broken = fleet[2]
    behaviours = {d.name: DeviceBehaviour() for d in fleet}
    behaviours[broken.name] = DeviceBehaviour(failing_actions=frozenset({"firmware/update"}))
    sim = simulator(behaviours)
    step = JobStepFactory(device=None, labels={"kind": label}, action="firmware/update")
    failed, _ = run_start(template=step.template)
    assert wait_for(lambda: finished(failed)).status == RunStatus.FAILED

    sim.devices[broken.name].behaviour = DeviceBehaviour()
    retry = run_retry(run=failed, by="ops")

    assert wait_for(lambda: finished(retry)).status == RunStatus.SUCCEEDED
    assert {d.name: actions(sim, d, "firmware/update") for d in fleet} == {
        d.name: 2 if d == broken else 1 for d in fleet
    }
    rows = StepRun.objects.filter(run=retry)
    assert rows.count() == 4 and set(rows.values_list("status", flat=True)) == {StepStatus.SUCCEEDED}


@pytest.mark.django_db
def test_what_cannot_be_retried_says_why():
    device = DeviceFactory()
    template = template_with_steps((device, "on", {}))
    plan = template_plan(template)

    def run_with(status: str) -> JobRun:
        return JobRun.objects.create(template=template, plan=plan, status=status)

    with pytest.raises(RetryError, match="this one is running"):
        run_retry(run=run_with(RunStatus.RUNNING), by="ops")
    with pytest.raises(RetryError, match="rolled back"):
        run_retry(run=run_with(RunStatus.COMPENSATED), by="ops")
    partly = run_with(RunStatus.FAILED)
    StepRun.objects.create(run=partly, index=0, phase=Phase.COMPENSATION, device=device, action="off")
    with pytest.raises(RetryError, match="rolled back"):
        run_retry(run=partly, by="ops")
    assert JobRun.objects.filter(retry_of__isnull=False).count() == 0


@pytest.mark.django_db
def test_retry_over_rest_needs_permission_and_an_existing_run(reader_api):
    device = DeviceFactory()
    template = template_with_steps((device, "on", {}))
    failed = JobRun.objects.create(template=template, plan=template_plan(template), status=RunStatus.FAILED)
    assert reader_api.post(f"/api/runs/{failed.pk}/retry/").status_code == 403
    assert reader_api.post(f"/api/runs/{uuid.uuid4()}/retry/").status_code == 404
    assert APIClient().post(f"/api/runs/{failed.pk}/retry/").status_code in (401, 403)
    assert not JobRun.objects.filter(retry_of=failed).exists()
