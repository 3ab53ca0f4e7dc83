"""Continuous fan-outs on the real stack: devices that come to match an open fan-out join
it (created through REST, relabelled through REST), once each; it closes by hand through
REST or at its end-by, and then the success criterion decides the step and the run."""

import io
import uuid

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from devtools.simulator import DeviceBehaviour
from jobs.models import ContinuousFanout, JobRun, RunEvent, RunStatus, StepRun, StepStatus
from jobs.services import run_start
from jobs.waiting import runs_waiting
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
    # and stays open: its step does not end when its rows have; the run says why it waits
    assert RunEvent.objects.filter(run=run, kind="step.fanout_opened").exists()
    run.refresh_from_db()
    assert runs_waiting([run])[run.pk].reason == "fanout_open"

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


def test_the_run_page_shows_an_open_fanout_and_closes_it_and_so_does_the_cli(stack, admin_client):
    # given two runs whose continuous fan-outs are open, closed by hand only
    runs = []
    for _ in range(2):
        step = JobStepFactory(
            device=None, selector=f"site=later-{uuid.uuid4().hex[:6]}", action=ACTION, continuous=True
        )
        run, _ = run_start(template=step.template)
        runs.append(run)
    for run in runs:
        wait_for(lambda run=run: ContinuousFanout.objects.filter(run=run).exists(), what="the fan-out open")
    by_page, by_cli = runs

    # when the run page is shown, it says so and offers to close it
    page = admin_client.get(f"/admin/jobs/jobrun/{by_page.pk}/change/").content.decode()
    assert "open until closed by hand" in page and "Close fan-out" in page
    # and its Close button (the runs list's action) closes it
    admin_client.post(
        "/admin/jobs/jobrun/", {"action": "close_fanouts", "_selected_action": [str(by_page.pk)]}
    )
    # and the command line closes the other
    out = io.StringIO()
    call_command("fanout_close", str(by_cli.pk)[:8], "--by", "ops", stdout=out)
    assert "closed" in out.getvalue()

    # then both runs end, each recording who closed it; nothing is open any more
    for run, who in ((by_page, "admin"), (by_cli, "ops")):
        assert wait_for(lambda run=run: finished(run), timeout=30).status == RunStatus.SUCCEEDED
        assert RunEvent.objects.get(run=run, kind="step.fanout_closed").data["by"] == who
    with pytest.raises(CommandError, match="no open continuous fan-out"):
        call_command("fanout_close", str(by_cli.pk), stdout=io.StringIO())


def test_a_device_back_online_after_its_row_timed_out_in_the_queue_gets_a_new_try(
    stack, simulator, admin_api
):
    # given a matching gateway that is offline when the open fan-out starts, with a short queue timeout
    site = f"store-{uuid.uuid4().hex[:6]}"
    late = DeviceFactory(name=f"{site}-gw-late", labels={"site": site}, online=False)
    step = JobStepFactory(
        device=None, selector=f"site={site}", action=ACTION, continuous=True, queue_timeout_seconds=1
    )
    run, _ = run_start(template=step.template)
    row = StepRun.objects.filter(run=run, device=late)
    wait_for(lambda: row.filter(status=StepStatus.TIMED_OUT).exists(), what="its row timed out in the queue")
    assert finished(run) is None  # the fan-out is open: its step is not decided

    # when the gateway comes online while the fan-out is open
    sim = simulator({late.name: DeviceBehaviour()})

    # then its row is queued again and the command goes out once
    wait_for(lambda: succeeded_on(run, late.name), what="the late gateway's row succeeded")
    assert [c["action"] for c in sim.received(late.name)] == [ACTION]
    joined = RunEvent.objects.get(run=run, kind="step.fanout_joined")
    assert joined.data["devices"] == [late.name] and "back online" in joined.message
    assert (
        admin_api.post(f"/api/runs/{run.pk}/fanout/close/", {"step": "0"}, format="json").status_code == 200
    )
    assert wait_for(lambda: finished(run), timeout=30).status == RunStatus.SUCCEEDED
