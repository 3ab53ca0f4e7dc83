"""A run through the REST trigger, the worker, the bridge and simulated devices."""

import json

import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from devtools.simulator import DeviceBehaviour
from jobs.models import JobRun, RunEvent, RunStatus, StepStatus
from tests.conftest import wait_for
from tests.factories import DeviceFactory, template_with_steps
from tests.mqtt_device import mqtt_client

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


@pytest.fixture
def api() -> APIClient:
    client = APIClient()
    client.force_authenticate(User.objects.create_superuser("operator", "op@example.com", "pw"))
    return client


def run_finished(run_id) -> JobRun | None:
    run = JobRun.objects.get(pk=run_id)
    return run if run.is_terminal else None


def test_three_steps_over_two_devices_succeed(stack, simulator, api):
    # given two simulated devices and a 3-step template that uses both
    gate, lamp = DeviceFactory(), DeviceFactory()
    sim = simulator({gate.name: DeviceBehaviour(), lamp.name: DeviceBehaviour()})
    template = template_with_steps(
        (gate, "unlock", {}), (lamp, "on", {"level": "{{ params.level }}"}), (gate, "lock", {})
    )

    # when the REST trigger starts a run
    response = api.post("/api/runs/", {"template": template.name, "parameters": {"level": 80}}, format="json")
    assert response.status_code == 201, response.content
    run = wait_for(lambda: run_finished(response.json()["id"]), what="run to finish")

    # then every step ran in order on its device and the run succeeded
    assert run.status == RunStatus.SUCCEEDED, run.error
    steps = list(run.step_runs.order_by("index"))
    assert [(s.device.name, s.action, s.status) for s in steps] == [
        (gate.name, "unlock", StepStatus.SUCCEEDED),
        (lamp.name, "on", StepStatus.SUCCEEDED),
        (gate.name, "lock", StepStatus.SUCCEEDED),
    ]
    assert [c["action"] for c in sim.received(gate.name)] == ["unlock", "lock"]
    assert sim.received(lamp.name)[0]["args"] == {"level": 80}
    assert steps[1].result["echo"] == {"level": 80}
    assert sim.stats()["totals"]["overlaps"] == 0
    detail = api.get(response.json()["url"]).json()
    assert [e["kind"] for e in detail["events"]][-1] == "run.succeeded"


def test_failing_device_fails_the_run(stack, simulator, api):
    # given a device that always reports failure in the middle of a run
    good, bad = DeviceFactory(), DeviceFactory()
    simulator({good.name: DeviceBehaviour(), bad.name: DeviceBehaviour(failure_rate=1.0)})
    template = template_with_steps((good, "a", {}), (bad, "b", {}), (good, "c", {}))

    response = api.post("/api/runs/", {"template": template.name}, format="json")
    run = wait_for(lambda: run_finished(response.json()["id"]), what="run to finish")

    # then the run failed at step 1 and step 2 never started
    assert run.status == RunStatus.FAILED
    assert "step 1" in run.error and "simulated failure" in run.error
    assert [s.status for s in run.step_runs.order_by("index")] == [StepStatus.SUCCEEDED, StepStatus.FAILED]


def test_bad_mqtt_input_is_dropped_and_recorded(stack, simulator, api, services):
    # given a device with a run in flight on it
    device = DeviceFactory()
    simulator({device.name: DeviceBehaviour()})
    other = DeviceFactory()
    template = template_with_steps((device, "a", {}))
    prefix = services.namespace
    client = mqtt_client(services.mqtt_url)
    try:
        # when garbage, an unknown command id and a reply from the wrong device arrive
        client.publish(f"{prefix}/{device.name}/done", b"\xff not json", qos=1).wait_for_publish(5)
        client.publish(f"{prefix}/{device.name}/done", json.dumps({"ok": True}), qos=1).wait_for_publish(5)
        nul = json.dumps({"id": "x-1", "ok": True, "result": {"note": "a\x00b"}})  # PostgreSQL refuses NUL
        client.publish(f"{prefix}/{device.name}/done", nul, qos=1).wait_for_publish(5)
        client.publish(f"{prefix}/{device.name}/done", json.dumps({"id": "nope", "ok": True}), qos=1)
        response = api.post("/api/runs/", {"template": template.name}, format="json")
        run = wait_for(lambda: run_finished(response.json()["id"]), what="run to finish")
        command_id = run.step_runs.get().command_id
        client.publish(f"{prefix}/{other.name}/done", json.dumps({"id": command_id, "ok": True}), qos=1)
        client.publish(f"{prefix}/{device.name}/done", json.dumps({"id": command_id, "ok": True}), qos=1)

        # then each is recorded and dropped, and the bridge still serves runs
        wait_for(lambda: RunEvent.objects.filter(kind="reply.foreign_device").exists(), what="foreign reply")
        wait_for(lambda: RunEvent.objects.filter(kind="reply.stale").exists(), what="duplicate reply")
        assert RunEvent.objects.filter(kind="message.dropped").count() == 3
        assert RunEvent.objects.filter(kind="message.dropped", message__contains="result.note").exists()
        assert RunEvent.objects.filter(kind="reply.unknown", device=device.name).exists()
        assert run.status == RunStatus.SUCCEEDED
        again = api.post("/api/runs/", {"template": template.name}, format="json")
        assert wait_for(lambda: run_finished(again.json()["id"])).status == RunStatus.SUCCEEDED
    finally:
        client.loop_stop()
        client.disconnect()
