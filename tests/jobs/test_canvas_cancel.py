"""A whole Celery canvas canceled by its root id, on the real stack: its running command's run
ends canceled, its chain goes no further, and a later device command of it starts no run."""

from __future__ import annotations

import uuid

import pytest
from celery import chain, group
from celery.result import AsyncResult
from django.contrib.auth.models import User
from django.core.management import call_command
from django.core.management.base import CommandError
from rest_framework.test import APIClient

from devtools.simulator import DeviceBehaviour
from jobs.cancel import CANVAS_CANCELED
from jobs.canvas import device_command
from jobs.models import CanvasLink, JobRun, RunEvent, RunStatus, Trigger
from tests.conftest import wait_for
from tests.factories import DeviceFactory
from tests.jobs.canvas_tasks import fetch_url, gate, gate_open, on_error, recorded, report

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


def key() -> str:
    return uuid.uuid4().hex[:8]


def running_canvas_run() -> JobRun | None:
    return JobRun.objects.filter(trigger=Trigger.CANVAS, status=RunStatus.RUNNING).first()


def root_of(run: JobRun) -> str:
    """The canvas's root id as an operator reads it: the run's `triggered_by` ("celery <root>")."""
    return run.triggered_by.split()[1]


def test_a_chain_canceled_by_its_root_id_ends_its_run_and_goes_no_further(
    stack, simulator, admin_api, reader_api
):
    # given a chain of two device commands whose first device takes the command and never answers
    held, next_device = DeviceFactory(), DeviceFactory()
    sim = simulator({held.name: DeviceBehaviour(silent=True), next_device.name: DeviceBehaviour()})
    k_after, k_error = key(), key()
    result = chain(
        device_command(held, "flash"), device_command(next_device, "reboot"), report.s(key=k_after)
    ).apply_async(link_error=on_error.s(key=k_error))
    run = wait_for(running_canvas_run, what="the first command's run")
    root = root_of(run)
    assert root == result.parent.parent.id  # the chain's first task is its root

    # when a reader tries, then an operator cancels the canvas by its root id
    refused = reader_api.post(f"/api/canvases/{root}/cancel/")
    response = admin_api.post(f"/api/canvases/{root}/cancel/")

    # then the reader may not, and the operator's cancel ended one run, canceled by them
    assert refused.status_code == 403
    assert response.status_code == 200, response.content
    assert response.json() == {"root_id": root, "canceled": 1}
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELED
    assert RunEvent.objects.filter(run=run, message__contains="canceled by admin").exists()

    # and the chain failed there: its errback ran, the next command never started a run
    errors = wait_for(lambda: recorded(k_error), what="the errback")
    assert "canceled" in errors[0]["error"]
    assert CanvasLink.objects.count() == 1 and JobRun.objects.filter(trigger=Trigger.CANVAS).count() == 1
    assert recorded(k_after) == [] and sim.received(next_device.name) == []

    # when it is canceled again (CLI), or an unknown canvas is
    admin_api_again = admin_api.post(f"/api/canvases/{root}/cancel/")
    unknown = admin_api.post("/api/canvases/no-such-root/cancel/")

    # then nothing more was running, the canvas is marked once (by the first), and the
    # unknown one is a 404 (CLI: an error)
    assert admin_api_again.json()["canceled"] == 0
    marks = RunEvent.objects.filter(kind=CANVAS_CANCELED)
    assert [(m.data["root_id"], m.data["by"]) for m in marks] == [(root, "admin")]
    assert unknown.status_code == 404
    with pytest.raises(CommandError, match="no canvas with root id"):
        call_command("canvas_cancel", "no-such-root")


def test_a_later_device_command_of_a_canceled_canvas_starts_no_run(stack, simulator, admin_api, capsys):
    # given a canvas whose root fetches a URL, then at once holds a device busy and, in a
    # parallel branch, waits at a gate before flashing another device
    held, flashed = DeviceFactory(), DeviceFactory()
    sim = simulator({held.name: DeviceBehaviour(silent=True), flashed.name: DeviceBehaviour()})
    k_gate, flash_id = key(), str(uuid.uuid4())
    flash = device_command(flashed, "flash").set(task_id=flash_id)
    chain(
        fetch_url.s("v2"), group(device_command(held, "hold"), chain(gate.si(key=k_gate), flash))
    ).apply_async()
    run = wait_for(running_canvas_run, what="the held command's run")

    # when the canvas is canceled by its root id from the CLI, and the gate opens after it
    call_command("canvas_cancel", root_of(run), "--by", "ops")
    gate_open(k_gate)

    # then the held run ended canceled, and the flash behind the gate refused to start a run
    assert "1 run canceled" in capsys.readouterr().out
    failed = wait_for(lambda: AsyncResult(flash_id).state == "FAILURE", what="the flash link to fail")
    assert failed
    assert "was canceled by ops" in str(AsyncResult(flash_id).result)
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELED
    assert not CanvasLink.objects.filter(task_id=flash_id).exists()
    assert sim.received(flashed.name) == []


@pytest.mark.django_db
def test_who_may_not_see_runs_learns_nothing_of_canvases():
    # given a signed-in user with no permission on runs
    api = APIClient()
    api.force_authenticate(User.objects.create_user("visitor"))

    # then a cancel is a 404, as for a run they may not see; without signing in a 401/403
    assert api.post("/api/canvases/any-root/cancel/").status_code == 404
    assert APIClient().post("/api/canvases/any-root/cancel/").status_code in (401, 403)
