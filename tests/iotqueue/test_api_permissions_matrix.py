"""Who may do what over the API: a read-only user changes nothing, and setting up what
starts runs (a schedule, a trigger rule) needs the permission to start runs."""

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client
from rest_framework.test import APIClient

from jobs.models import JobRun, RunStatus
from jobs.services import template_plan
from tests.factories import DeviceFactory, template_with_steps
from triggers.models import Schedule, TriggerRule

pytestmark = pytest.mark.django_db

SCHEDULE_AND_RULE_PERMISSIONS = [
    f"{action}_{model}" for action in ("add", "change", "view") for model in ("schedule", "triggerrule")
]


@pytest.fixture
def template():
    return template_with_steps((DeviceFactory(), "on", {}))


def user_with(*codenames: str) -> User:
    user = User.objects.create_user(f"user-{len(codenames)}-{User.objects.count()}", password="pw")
    user.user_permissions.add(*Permission.objects.filter(codename__in=codenames))
    return user


def api_as(user: User) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


def schedule_body(template) -> dict:
    return {"name": "nightly", "template": template.name, "interval_seconds": 3600}


def rule_body(template) -> dict:
    return {"name": "doors", "topic_filter": "site/+/door", "template": template.name}


def test_a_read_only_user_cannot_start_cancel_retry_close_release_or_create(reader_api, template):
    # given a failed run, a device and every view_ permission
    device = DeviceFactory()
    run = JobRun.objects.create(template=template, plan=template_plan(template), status=RunStatus.FAILED)
    template_body = {"name": "new", "steps": [{"position": 0, "device": device.name, "action": "on"}]}

    # then every write is refused
    writes = {
        "start": reader_api.post("/api/runs/", {"template": template.name}, format="json"),
        "cancel": reader_api.post(f"/api/runs/{run.pk}/cancel/"),
        "retry": reader_api.post(f"/api/runs/{run.pk}/retry/"),
        "close fan-out": reader_api.post(f"/api/runs/{run.pk}/fanout/close/"),
        "release": reader_api.post(f"/api/devices/{device.name}/lock/release/"),
        "template": reader_api.post("/api/templates/", template_body, format="json"),
        "schedule": reader_api.post("/api/schedules/", schedule_body(template), format="json"),
        "rule": reader_api.post("/api/trigger-rules/", rule_body(template), format="json"),
    }
    assert {what: response.status_code for what, response in writes.items()} == dict.fromkeys(writes, 403)
    assert JobRun.objects.count() == 1 and not Schedule.objects.exists() and not TriggerRule.objects.exists()


def test_creating_or_changing_a_schedule_or_rule_needs_the_run_start_permission(template):
    # given a user who may edit schedules and rules but not start runs
    editor = api_as(user_with(*SCHEDULE_AND_RULE_PERMISSIONS))
    starter = api_as(user_with(*SCHEDULE_AND_RULE_PERMISSIONS, "add_jobrun"))

    # then creating either is 403, and so is changing one the starter made
    assert editor.post("/api/schedules/", schedule_body(template), format="json").status_code == 403
    assert editor.post("/api/trigger-rules/", rule_body(template), format="json").status_code == 403
    assert starter.post("/api/schedules/", schedule_body(template), format="json").status_code == 201
    assert starter.post("/api/trigger-rules/", rule_body(template), format="json").status_code == 201
    assert editor.patch("/api/schedules/nightly/", {"enabled": False}, format="json").status_code == 403
    assert editor.put("/api/trigger-rules/doors/", rule_body(template), format="json").status_code == 403
    assert editor.get("/api/trigger-rules/doors/").status_code == 200
    assert Schedule.objects.get().enabled is True


def test_the_admin_also_needs_the_run_start_permission(template):
    editor = User.objects.create_user("editor", password="pw", is_staff=True)
    editor.user_permissions.add(*Permission.objects.filter(codename__in=SCHEDULE_AND_RULE_PERMISSIONS))
    browser = Client()
    browser.force_login(editor)
    rule = TriggerRule.objects.create(name="doors", topic_filter="site/+/door", template=template)

    assert browser.get("/admin/triggers/schedule/add/").status_code == 403
    assert browser.get("/admin/triggers/triggerrule/add/").status_code == 403
    change = browser.post(f"/admin/triggers/triggerrule/{rule.pk}/change/", {"name": "renamed"})
    assert change.status_code == 403
    assert browser.get(f"/admin/triggers/triggerrule/{rule.pk}/change/").status_code == 200  # read-only view

    editor.user_permissions.add(Permission.objects.get(codename="add_jobrun"))
    browser.force_login(User.objects.get(pk=editor.pk))  # a fresh permission cache
    assert browser.get("/admin/triggers/schedule/add/").status_code == 200
    assert TriggerRule.objects.get().name == "doors"
