"""Schedules and trigger rules pinned to a template version: their runs execute that version's
steps after the template moved on (real beat task, bridge, worker and simulated devices);
a pin must be a version of the row's own template (REST 400 and admin error on the field)."""

from __future__ import annotations

import time

import pytest
from django.contrib.auth.models import User
from django.test import Client

from devtools.simulator import DeviceBehaviour
from jobs.models import JobRun, JobTemplate, RunStatus, Trigger
from tests.conftest import wait_for
from tests.factories import DeviceFactory
from tests.triggers.test_trigger_rules import REPUBLISH_SECONDS, publish, sensor  # noqa: F401
from triggers.admin import ScheduleForm, TriggerRuleForm
from triggers.models import Schedule, TriggerRule
from triggers.schedules import schedule_fire

pytestmark = pytest.mark.timeout(120)


def flash_template(admin_api, name: str, device: str, image: str, *, change: bool = False) -> None:
    """Create (or, with `change`, edit: a new version) a one-step template flashing `image`."""
    body = {
        "name": name,
        "steps": [{"position": 0, "device": device, "action": "flash", "args": {"image": image}}],
    }
    response = (
        admin_api.put(f"/api/templates/{name}/", body, format="json")
        if change
        else admin_api.post("/api/templates/", body, format="json")
    )
    assert response.status_code in (200, 201), response.content


def finished(run_id) -> JobRun | None:
    run = JobRun.objects.get(pk=run_id)
    return run if run.is_terminal else None


def images(sim, device: str) -> list[str]:
    return [command["args"]["image"] for command in sim.received(device)]


@pytest.mark.django_db(transaction=True)
def test_a_schedule_pinned_to_v1_starts_a_v1_run_after_the_template_moved_to_v2(stack, simulator, admin_api):
    # given a firmware template at version 2, a schedule pinned to version 1 and one unpinned
    device = DeviceFactory()
    sim = simulator({device.name: DeviceBehaviour()})
    flash_template(admin_api, "Flash", device.name, "fw-1")
    flash_template(admin_api, "Flash", device.name, "fw-2", change=True)
    pinned = admin_api.post(
        "/api/schedules/",
        {"name": "pinned", "template": "Flash", "template_version": 1, "interval_seconds": 3600},
        format="json",
    )
    current = admin_api.post(
        "/api/schedules/", {"name": "current", "template": "Flash", "interval_seconds": 3600}, format="json"
    )
    assert pinned.status_code == 201, pinned.content
    assert (pinned.json()["template_version"], current.json()["template_version"]) == (1, None)

    # when beat's task fires each schedule
    first = schedule_fire(schedule_id=pinned.json()["id"])
    wait_for(lambda: finished(first.pk), what="the pinned schedule's run")
    second = schedule_fire(schedule_id=current.json()["id"])
    wait_for(lambda: finished(second.pk), what="the current schedule's run")

    # then the pinned one ran version 1's steps, the other the template as it is now
    first.refresh_from_db()
    second.refresh_from_db()
    assert (first.status, first.template_version.number) == (RunStatus.SUCCEEDED, 1)
    assert (second.status, second.template_version.number) == (RunStatus.SUCCEEDED, 2)
    assert images(sim, device.name) == ["fw-1", "fw-2"]
    assert admin_api.get(f"/api/runs/{first.pk}/").json()["template_version"] == 1


@pytest.mark.django_db(transaction=True)
def test_a_trigger_rule_pinned_to_v1_starts_a_v1_run_after_the_template_moved_to_v2(
    stack,
    simulator,
    admin_api,
    sensor,  # noqa: F811
    services,
):
    # given a firmware template at version 2 and a rule pinned to version 1, made over REST
    device = DeviceFactory()
    sim = simulator({device.name: DeviceBehaviour()})
    flash_template(admin_api, "Flash", device.name, "fw-1")
    flash_template(admin_api, "Flash", device.name, "fw-2", change=True)
    topic = f"{services.namespace}/site/berlin/update"
    response = admin_api.post(
        "/api/trigger-rules/",
        {
            "name": "update pinned",
            "topic_filter": topic,
            "template": "Flash",
            "template_version": 1,
            "idempotency_key": "{{ message.event_id }}",
        },
        format="json",
    )
    assert response.status_code == 201, response.content
    assert response.json()["template_version"] == 1

    # when a message arrives through the bridge (again until the bridge has subscribed)
    def published_and_started():
        publish(sensor, topic, {"event_id": "ev-1"})
        return JobRun.objects.filter(trigger=Trigger.MQTT).first() or time.sleep(REPUBLISH_SECONDS)

    run = wait_for(published_and_started, what="a run started by the rule")
    run = wait_for(lambda: finished(run.pk), what="the rule's run to end")

    # then it ran version 1's steps
    assert (run.status, run.template_version.number) == (RunStatus.SUCCEEDED, 1), run.error
    assert images(sim, device.name) == ["fw-1"]


@pytest.mark.django_db
def test_a_pin_to_another_templates_version_is_a_400_naming_the_field(admin_api):
    # given two templates, each at version 1, and a schedule and a rule pinned to Flash v1
    device = DeviceFactory()
    flash_template(admin_api, "Flash", device.name, "fw-1")
    flash_template(admin_api, "Reboot", device.name, "none")
    schedule = {"name": "nightly", "template": "Flash", "template_version": 1, "interval_seconds": 60}
    rule = {"name": "on update", "topic_filter": "site/+/update", "template": "Flash", "template_version": 1}
    assert admin_api.post("/api/schedules/", schedule, format="json").status_code == 201
    assert admin_api.post("/api/trigger-rules/", rule, format="json").status_code == 201

    # when each is moved to the other template but keeps its pin, or pins a version that does not exist
    moved_schedule = admin_api.patch("/api/schedules/nightly/", {"template": "Reboot"}, format="json")
    moved_rule = admin_api.patch("/api/trigger-rules/on%20update/", {"template": "Reboot"}, format="json")
    missing = admin_api.patch("/api/schedules/nightly/", {"template_version": 7}, format="json")

    # then each is a 400 naming template_version, and nothing changed
    for response in (moved_schedule, moved_rule, missing):
        assert response.status_code == 400, response.content
        assert list(response.json()) == ["template_version"]
    assert "belongs to template 'Flash', not 'Reboot'" in moved_schedule.json()["template_version"][0]
    assert "has no version 7" in missing.json()["template_version"][0]
    assert Schedule.objects.get(name="nightly").template.name == "Flash"
    assert TriggerRule.objects.get(name="on update").template.name == "Flash"

    # and null unpins: the schedule starts the template as it is now again
    cleared = admin_api.patch("/api/schedules/nightly/", {"template_version": None}, format="json")
    assert cleared.status_code == 200 and cleared.json()["template_version"] is None


@pytest.mark.django_db
def test_the_admin_forms_refuse_another_templates_version_and_offer_the_templates_own(admin_api):
    # given two templates, each at version 1, and a schedule of Flash
    device = DeviceFactory()
    flash_template(admin_api, "Flash", device.name, "fw-1")
    flash_template(admin_api, "Reboot", device.name, "none")
    flash, reboot = (JobTemplate.objects.get(name=name) for name in ("Flash", "Reboot"))
    schedule = Schedule.objects.create(name="nightly", template=flash, interval_seconds=60)

    # when the admin's forms pin Flash to Reboot's version 1
    other = reboot.versions.get(number=1)
    schedule_form = ScheduleForm(
        data={
            "name": "nightly2",
            "template": flash.pk,
            "template_version": other.pk,
            "parameters": "{}",
            "interval_seconds": 60,
            "timezone": "UTC",
            "enabled": "on",
            "overlap": "skip",
        }
    )
    rule_form = TriggerRuleForm(
        data={
            "name": "on update",
            "topic_filter": "site/+/update",
            "template": flash.pk,
            "template_version": other.pk,
            "parameters": "{}",
            "priority": "",
            "max_runs_per_minute": 60,
            "max_active_runs": 10,
        }
    )

    # then both are refused on the field
    for form in (schedule_form, rule_form):
        assert not form.is_valid()
        assert "belongs to template 'Reboot', not 'Flash'" in form.errors["template_version"][0]

    # and a saved schedule's form offers its template's versions only; the list shows the pin
    assert list(ScheduleForm(instance=schedule).fields["template_version"].queryset) == [flash.versions.get()]
    Schedule.objects.filter(pk=schedule.pk).update(template_version=flash.versions.get())
    browser = Client()
    browser.force_login(User.objects.get(username="admin"))
    page = browser.get("/admin/triggers/schedule/")
    assert page.status_code == 200 and "Flash v1" in page.content.decode()
