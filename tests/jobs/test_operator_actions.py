"""Operator actions on the real path: REST cancel, admin pages and actions, the locks command."""

from io import StringIO

import pytest
from django.contrib.auth.models import Permission, User
from django.core.management import call_command
from rest_framework.test import APIClient

from devices.locks import device_lock_state
from devtools.simulator import DeviceBehaviour
from jobs.models import JobRun, RunEvent, RunStatus, StepRun, StepStatus
from jobs.services import run_start
from tests.conftest import wait_for
from tests.factories import DeviceFactory, template_with_steps

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


def dispatched(run: JobRun) -> bool:
    return StepRun.objects.filter(run=run, status=StepStatus.DISPATCHED).exists()


@pytest.fixture
def silent_run(stack, simulator):
    device = DeviceFactory()
    simulator({device.name: DeviceBehaviour(silent=True)})
    template = template_with_steps((device, "hold", {}))
    template.steps.update(max_attempts=3, backoff_seconds=30)
    run, _ = run_start(template=template)
    wait_for(lambda: dispatched(run), what="dispatch")
    return device, run


def test_rest_cancel_needs_permission_and_ends_the_run(silent_run):
    device, run = silent_run
    viewer = User.objects.create_user("viewer")
    viewer.user_permissions.add(Permission.objects.get(codename="view_jobrun"))
    client = APIClient()
    client.force_authenticate(viewer)
    assert client.post(f"/api/runs/{run.pk}/cancel/").status_code == 403
    assert client.post("/api/runs/", {"template": run.template.name}, format="json").status_code == 403

    client.force_authenticate(User.objects.create_superuser("boss", "b@example.com", "pw"))
    response = client.post(f"/api/runs/{run.pk}/cancel/")
    assert response.status_code == 200 and response.json()["status"] == RunStatus.CANCELED
    assert client.post(f"/api/runs/{run.pk}/cancel/").status_code == 409
    assert client.post("/api/runs/00000000-0000-0000-0000-000000000000/cancel/").status_code == 404
    assert device_lock_state(device.name).holder is None


def test_rest_trigger_rejects_bad_input_naming_the_field(stack):
    client = APIClient()
    assert client.post("/api/runs/", {}, format="json").status_code in (401, 403)
    client.force_authenticate(User.objects.create_superuser("boss", "b@example.com", "pw"))
    response = client.post("/api/runs/", {"template": "nope", "parameters": [1]}, format="json")
    assert response.status_code == 400
    assert set(response.json()) == {"template", "parameters"}


def test_idempotency_key_returns_the_same_run(stack):
    device = DeviceFactory()
    template = template_with_steps((device, "x", {}))
    client = APIClient()
    client.force_authenticate(User.objects.create_superuser("boss", "b@example.com", "pw"))
    body = {"template": template.name, "idempotency_key": "order-42"}
    first = client.post("/api/runs/", body, format="json")
    second = client.post("/api/runs/", body, format="json")
    assert (first.status_code, second.status_code) == (201, 200)
    assert first.json()["id"] == second.json()["id"]


def test_admin_pages_and_actions(silent_run, client):
    device, run = silent_run
    client.force_login(User.objects.create_superuser("boss", "b@example.com", "pw"))
    for url in (
        "/admin/jobs/jobrun/",
        f"/admin/jobs/jobrun/{run.pk}/change/",
        "/admin/devices/device/",
        f"/admin/devices/device/{device.pk}/change/",
        "/admin/jobs/jobtemplate/",
        f"/admin/jobs/jobtemplate/{run.template.pk}/change/",
        "/admin/jobs/steprun/",
        "/admin/jobs/runevent/",
    ):
        assert client.get(url).status_code == 200, url
    assert f"step:{run.step_runs.get().pk}" in client.get(f"/admin/devices/device/{device.pk}/change/").text

    # force-release: the holder's attempt ends (audited) and the device is free
    client.post("/admin/devices/device/", {"action": "force_release_lock", "_selected_action": [device.pk]})
    assert RunEvent.objects.filter(kind="lock.force_released", device=device.name).exists()
    wait_for(lambda: run.step_runs.get().status == StepStatus.RETRYING, what="attempt ended, retry pending")
    assert device_lock_state(device.name).holder is None

    # cancel from the admin
    client.post("/admin/jobs/jobrun/", {"action": "cancel_runs", "_selected_action": [run.pk]})
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELED


def test_locks_command_shows_holder_and_force_releases(silent_run):
    device, run = silent_run
    out = StringIO()
    call_command("locks", device.name, stdout=out)
    assert f"run {str(run.pk)[:8]} step #0" in out.getvalue()  # the holder's run and step
    call_command("locks", device.name, "--force-release", "--by", "ops", stdout=out)
    assert RunEvent.objects.filter(kind="lock.force_released", message__contains="ops").exists()


def test_rest_force_release_needs_permission_and_frees_the_device(silent_run, admin_api, reader_api):
    device, run = silent_run
    url = f"/api/devices/{device.name}/lock/release/"
    assert reader_api.post(url).status_code == 403
    assert admin_api.post("/api/devices/no-such-device/lock/release/").status_code == 404

    released = admin_api.post(url)

    assert released.json() == {"device": device.name, "released_from": f"step:{run.step_runs.get().pk}"}
    assert RunEvent.objects.filter(kind="lock.force_released", message__contains="admin").exists()
    wait_for(lambda: run.step_runs.get().status == StepStatus.RETRYING, what="attempt ended, retry pending")
