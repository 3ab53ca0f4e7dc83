"""Continuous fan-outs on the real stack: devices that come to match an open fan-out join
it (created through REST, relabelled through REST), once each; it closes by hand through
REST or at its end-by, and then the success criterion decides the step and the run."""

import uuid

import pytest

from devtools.simulator import DeviceBehaviour
from jobs.models import ContinuousFanout, JobRun, RunEvent, RunStatus, StepRun, StepStatus
from jobs.services import run_start
from tests.conftest import wait_for
from tests.factories import DeviceFactory, JobStepFactory

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

ACTION = "firmware/flash"


def finished(run: JobRun) -> JobRun | None:
    run.refresh_from_db()
    return run if run.is_terminal else None


def succeeded_on(run: JobRun, name: str) -> bool:
    return StepRun.objects.filter(run=run, device__name=name, status=StepStatus.SUCCEEDED).exists()


def test_devices_that_come_to_match_an_open_fanout_get_the_step_once_and_closing_it_ends_the_run(
    stack, simulator, admin_api
):
    # given a gateway of the site and two that are not (yet), all online
    site = f"store-{uuid.uuid4().hex[:6]}"
    first = DeviceFactory(name=f"{site}-gw-1", labels={"site": site})
    moving = DeviceFactory(name=f"{site}-gw-moved", labels={"site": "elsewhere"})
    bystander = DeviceFactory(name=f"{site}-printer", labels={"site": "elsewhere"})
    sim = simulator({d.name: DeviceBehaviour() for d in (first, moving, bystander)})
    step = JobStepFactory(
        device=None, selector=f"site={site}", action=ACTION, continuous=True, rollout_per_minute=600
    )

    # when the continuous fan-out starts, it sends to the one gateway that matches
    run, _ = run_start(template=step.template)
    wait_for(lambda: succeeded_on(run, first.name), what="the first gateway's row succeeded")
    assert ContinuousFanout.objects.get(run=run, index=0).is_open
    # and stays open: its step does not end when its rows have
    assert RunEvent.objects.filter(run=run, kind="step.fanout_opened").exists()

    # when a gateway installed meanwhile is created through REST, matching
    installed = f"{site}-gw-new"
    created = admin_api.post("/api/devices/", {"name": installed, "labels": {"site": site}}, format="json")
    assert created.status_code == 201, created.content
    sim.device_add(installed, DeviceBehaviour())
    # and an existing gateway is relabelled to the site, the printer to a site that is not it
    for name, labels in ((moving.name, {"site": site}), (bystander.name, {"site": f"{site}-annex"})):
        response = admin_api.post("/api/devices/labels/", {"devices": [name], "set": labels}, format="json")
        assert response.status_code == 200, response.content

    # then both get the step and succeed
    wait_for(lambda: succeeded_on(run, installed), what="the installed gateway's row succeeded")
    wait_for(lambda: succeeded_on(run, moving.name), what="the relabelled gateway's row succeeded")
    assert finished(run) is None  # still open
    joined = RunEvent.objects.filter(run=run, kind="step.fanout_joined")
    assert {name for event in joined for name in event.data["devices"]} == {installed, moving.name}

    # when it is closed through REST
    closed = admin_api.post(f"/api/runs/{run.pk}/fanout/close/", {}, format="json")
    assert closed.status_code == 200, closed.content
    assert closed.json()["continuous_fanouts"][0]["closed_by"] == "admin"

    # then the success criterion decides over all its rows, and the run ends
    assert wait_for(lambda: finished(run), timeout=60).status == RunStatus.SUCCEEDED
    rows = StepRun.objects.filter(run=run)
    assert sorted(rows.values_list("device__name", flat=True)) == sorted([first.name, installed, moving.name])
    assert set(rows.values_list("status", flat=True)) == {StepStatus.SUCCEEDED}
    # each gateway got the command once; the printer, which never matched, got nothing
    for name in (first.name, installed, moving.name):
        assert [c["action"] for c in sim.received(name)] == [ACTION], name
    assert sim.received(bystander.name) == []
    closing = RunEvent.objects.get(run=run, kind="step.fanout_closed")
    assert closing.data["by"] == "admin"
    done = RunEvent.objects.get(run=run, kind="step.fanout_done")
    assert done.message.startswith("3 of 3 devices succeeded")
    # closing again: nothing is open
    again = admin_api.post(f"/api/runs/{run.pk}/fanout/close/", {"step": "0"}, format="json")
    assert again.status_code == 409


def test_an_open_fanout_closes_at_its_end_by_even_with_no_device_yet(stack):
    # given a continuous fan-out whose selector matches no device yet, open for 2 seconds
    step = JobStepFactory(
        device=None,
        selector=f"site=empty-{uuid.uuid4().hex[:6]}",
        action=ACTION,
        continuous=True,
        open_seconds=2,
    )

    # when it starts, it is not refused (devices may join), and its end-by closes it
    run, _ = run_start(template=step.template)

    # then the run ends by the success criterion over no rows, closed by no one
    assert wait_for(lambda: finished(run), timeout=30).status == RunStatus.SUCCEEDED
    opened = ContinuousFanout.objects.get(run=run, index=0)
    assert opened.closed_at is not None and opened.closed_at >= opened.closes_at
    assert opened.closed_by == ""
    closing = RunEvent.objects.get(run=run, kind="step.fanout_closed")
    assert closing.data["by"] is None and "end-by" in closing.message
