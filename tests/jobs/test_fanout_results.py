"""Results that flow on, on the real stack: a fan-out's per-device outcomes read by later
steps ({{ steps.NAME.counts }}, .failed, .results) and targeted by them (devices_from)."""

import uuid

import pytest
from django.contrib.auth.models import User

from devtools.simulator import DeviceBehaviour
from jobs.cli import run_load, step_lines
from jobs.models import JobRun, JobTemplate, Phase, RunEvent, RunStatus, StepRun, StepStatus
from jobs.services import run_start
from tests.conftest import wait_for
from tests.factories import DeviceFactory, JobStepFactory, JobTemplateFactory

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

FLASH = "firmware/flash"


def finished(run: JobRun) -> JobRun | None:
    run.refresh_from_db()
    return run if run.is_terminal else None


def row_devices(run: JobRun, index: int) -> set[str]:
    return set(
        StepRun.objects.filter(run=run, phase=Phase.FORWARD, index=index).values_list(
            "device__name", flat=True
        )
    )


def gateways(
    label: str, *, flashing: int, broken: int
) -> tuple[dict[str, DeviceBehaviour], set[str], set[str]]:
    """`flashing` gateways that take the image and `broken` ones whose flash fails (they
    answer every other action), labelled kind=label: (behaviours, flashing names, broken names)."""
    good = {DeviceFactory(name=f"{label}-ok-{i}", labels={"kind": label}).name for i in range(flashing)}
    bad = {DeviceFactory(name=f"{label}-bad-{i}", labels={"kind": label}).name for i in range(broken)}
    behaviours = {name: DeviceBehaviour() for name in good}
    behaviours.update({name: DeviceBehaviour(failing_actions=frozenset({FLASH})) for name in bad})
    return behaviours, good, bad


def test_later_steps_target_and_read_the_devices_that_succeeded_or_failed_in_a_fan_out(
    stack, simulator, admin_api, client
):
    # given 5 gateways that flash and 3 whose flash fails, and a hub that takes the report
    label = f"gw-{uuid.uuid4().hex[:6]}"
    behaviours, good, bad = gateways(label, flashing=5, broken=3)
    hub = DeviceFactory()
    sim = simulator({**behaviours, hub.name: DeviceBehaviour()})
    # and a rollout: flash every gateway (it succeeds when half of them did), verify the image
    # on those that flashed, reboot those that did not into the old image, report to the hub
    template = JobTemplateFactory()
    step = {"template": template, "device": None}
    JobStepFactory(**step, position=0, name="flash", labels={"kind": label}, action=FLASH, success_percent=50)
    JobStepFactory(
        **step,
        position=1,
        name="verify",
        devices_from={"step": "flash", "outcome": "succeeded"},
        action="firmware/verify",
        args={"of": "{{ steps.flash.counts.total }}", "me": "{{ device.name }}"},
    )
    JobStepFactory(
        **step,
        position=2,
        name="fallback",
        devices_from={"step": "flash", "outcome": "failed"},
        action="reboot",
    )
    JobStepFactory(
        template=template,
        position=3,
        name="report",
        device=hub,
        action="report",
        args={
            "counts": "{{ steps.flash.counts }}",
            "failed": "{{ steps.flash.failed }}",
            "verified": "{{ steps.verify.succeeded }}",
            "note": "{{ steps.flash.counts.failed }} of {{ steps.flash.counts.total }} failed",
        },
    )

    # when the operator previews it, the targets of verify and fallback are known only at run
    # time: verify counts flash's gateways (at most all of them), fallback none
    preview = admin_api.post("/api/runs/preview/", {"template": template.name}, format="json").json()
    verify_preview, fallback_preview = preview["steps"][1], preview["steps"][2]
    assert verify_preview["target"] == "devices that succeeded in step flash (known when the step starts)"
    assert fallback_preview["target"] == "devices that failed in step flash (known when the step starts)"
    assert (verify_preview["kind"], verify_preview["devices"]["matched"]) == ("fanout", 8)
    assert fallback_preview["devices"]["matched"] == 0 and preview["problems"] == []

    run, _ = run_start(template=template)

    # then the run succeeds; verify went to exactly the gateways that flashed, fallback to
    # exactly those that did not, each as a fan-out row per device
    assert wait_for(lambda: finished(run)).status == RunStatus.SUCCEEDED, run.error
    assert row_devices(run, 0) == good | bad
    # (the plan holds devices_from only where it is set: older templates' versions stay equal)
    assert "devices_from" not in run.plan[0] and run.plan[2]["devices_from"]["outcome"] == "failed"
    assert row_devices(run, 1) == good
    assert row_devices(run, 2) == bad
    verify = StepRun.objects.filter(run=run, index=1)
    assert {row.args["me"] for row in verify} == good and {row.args["of"] for row in verify} == {8}
    assert all(
        row.status == StepStatus.SUCCEEDED for row in StepRun.objects.filter(run=run, index__in=(1, 2))
    )
    # and the report received the counts and the device lists, with their JSON types
    report = [command for command in sim.received(hub.name) if command["action"] == "report"][-1]
    assert report["args"]["counts"] == {
        "succeeded": 5,
        "failed": 3,
        "rejected": 0,
        "timed_out": 0,
        "canceled": 0,
        "skipped": 0,
        "unfinished": 0,
        "total": 8,
    }
    assert report["args"]["failed"] == sorted(bad)
    assert report["args"]["verified"] == sorted(good)
    assert report["args"]["note"] == "3 of 8 failed"
    # and the run page names each step's target
    client.force_login(User.objects.get(username="admin"))
    timeline = client.get(f"/admin/jobs/jobrun/{run.pk}/timeline/").text
    assert "devices that succeeded in step flash" in timeline
    assert "devices that failed in step flash" in timeline


def test_a_step_for_the_failed_devices_succeeds_when_none_failed(stack, simulator):
    # given 3 gateways that all flash, then a retry on those that failed, then a report
    label = f"gw-{uuid.uuid4().hex[:6]}"
    behaviours, good, _ = gateways(label, flashing=3, broken=0)
    hub = DeviceFactory()
    sim = simulator({**behaviours, hub.name: DeviceBehaviour()})
    template = JobTemplateFactory()
    JobStepFactory(
        template=template, device=None, position=0, name="flash", labels={"kind": label}, action=FLASH
    )
    JobStepFactory(
        template=template,
        device=None,
        position=1,
        name="retry",
        devices_from={"step": "flash", "outcome": "failed"},
        action=FLASH,
    )
    JobStepFactory(
        template=template,
        device=hub,
        position=2,
        action="report",
        args={"retried": "{{ steps.retry.counts.total }}"},
    )

    run, _ = run_start(template=template)

    # then the retry has no device to target: it succeeds saying so, and the run goes on
    assert wait_for(lambda: finished(run)).status == RunStatus.SUCCEEDED, run.error
    empty = RunEvent.objects.get(run=run, kind="step.fanout_empty")
    assert empty.message == "no device to target: no device failed in step flash"
    assert not StepRun.objects.filter(run=run, index=1).exists()
    report = [command for command in sim.received(hub.name) if command["action"] == "report"][-1]
    assert report["args"] == {"retried": 0}
    assert all(len([c for c in sim.received(name) if c["action"] == FLASH]) == 1 for name in good)
    # and manage.py run_show says the step had no device to target
    assert "no device to target" in step_lines(run_load(str(run.pk)))["#1"]


def test_devices_from_naming_no_earlier_fan_out_is_refused_with_400(admin_api):
    # given a template whose second step targets the devices that succeeded in a one-device step
    device = DeviceFactory()
    body = {
        "name": f"t-{uuid.uuid4().hex[:6]}",
        "steps": [
            {"position": 0, "name": "check", "device": device.name, "action": "check"},
            {"position": 1, "devices_from": {"step": "check", "outcome": "succeeded"}, "action": "verify"},
        ],
    }

    response = admin_api.post("/api/templates/", body, format="json")

    # then the step's devices_from field says why, and nothing is saved
    assert response.status_code == 400
    message = response.json()["steps"]["1"]["devices_from"][0]
    assert message.startswith("'check' is not an earlier fan-out step of this template")
    assert not JobTemplate.objects.filter(name=body["name"]).exists()
    # and a well-formed one is saved and read back with the field
    body["steps"][0] = {"position": 0, "name": "check", "labels": {"kind": "x"}, "action": "check"}
    created = admin_api.post("/api/templates/", body, format="json")
    assert created.status_code == 201, created.content
    assert created.json()["steps"][1]["devices_from"] == {"step": "check", "outcome": "succeeded"}
