"""REST for schedules and trigger rules: each schedule keeps its beat PeriodicTask in step."""

import json

import pytest
from django_celery_beat.models import PeriodicTask

from tests.factories import DeviceFactory, template_with_steps
from triggers.models import Schedule, TriggerRule

pytestmark = pytest.mark.django_db


@pytest.fixture
def template():
    return template_with_steps((DeviceFactory(), "firmware/check", {}))


def nightly(template) -> dict:
    """The nightly fleet job: firmware check every night at 02:00 Berlin time."""
    return {
        "name": "nightly firmware check",
        "template": template.name,
        "parameters": {"channel": "stable"},
        "crontab": "0 2 * * *",
        "timezone": "Europe/Berlin",
    }


def test_crontab_schedule_creates_its_periodic_task(admin_api, template):
    response = admin_api.post("/api/schedules/", nightly(template), format="json")

    assert response.status_code == 201, response.content
    body = response.json()
    assert body["overlap"] == "skip" and body["enabled"] is True and body["last_run"] is None
    task = Schedule.objects.get(name="nightly firmware check").periodic_task
    assert task.task == "triggers.schedule_fire" and task.enabled
    assert json.loads(task.kwargs) == {"schedule_id": body["id"]}
    assert (task.crontab.minute, task.crontab.hour, str(task.crontab.timezone)) == ("0", "2", "Europe/Berlin")
    assert task.interval is None


def test_patch_switches_to_an_interval_renames_and_disables(admin_api, template):
    admin_api.post("/api/schedules/", nightly(template), format="json")

    response = admin_api.patch(
        "/api/schedules/nightly firmware check/",
        {"interval_seconds": 600, "crontab": None, "name": "firmware check", "enabled": False},
        format="json",
    )

    assert response.status_code == 200, response.content
    task = PeriodicTask.objects.get(pk=Schedule.objects.get(name="firmware check").periodic_task_id)
    assert (task.interval.every, task.interval.period, task.crontab) == (600, "seconds", None)
    assert task.name == "iotqueue schedule firmware check"
    assert task.enabled is False
    assert PeriodicTask.objects.filter(task="triggers.schedule_fire").count() == 1


def test_delete_removes_the_periodic_task(admin_api, template):
    admin_api.post("/api/schedules/", nightly(template), format="json")

    response = admin_api.delete("/api/schedules/nightly firmware check/")

    assert response.status_code == 204
    assert not PeriodicTask.objects.filter(task="triggers.schedule_fire").exists()


@pytest.mark.parametrize(
    ("change", "fields"),
    [
        ({"interval_seconds": 60}, {"interval_seconds", "crontab"}),  # both
        ({"crontab": ""}, {"interval_seconds", "crontab"}),  # neither
        ({"crontab": "61 2 * * *"}, {"crontab"}),
        ({"crontab": "0 2 * *"}, {"crontab"}),
        ({"timezone": "Mars/Olympus"}, {"timezone"}),
        ({"template": "no such template"}, {"template"}),
        ({"parameters": [1, 2]}, {"parameters"}),
        ({"priority": 12}, {"priority"}),
        ({"overlap": "sometimes"}, {"overlap"}),
    ],
)
def test_invalid_schedule_is_400_naming_the_field(admin_api, template, change, fields):
    response = admin_api.post("/api/schedules/", {**nightly(template), **change}, format="json")

    assert response.status_code == 400
    assert set(response.json()) == fields, response.json()
    assert not PeriodicTask.objects.filter(task="triggers.schedule_fire").exists()


def test_patch_adding_a_crontab_to_an_interval_schedule_names_both(admin_api, template):
    admin_api.post(
        "/api/schedules/", {**nightly(template), "crontab": "", "interval_seconds": 60}, format="json"
    )

    response = admin_api.patch(
        "/api/schedules/nightly firmware check/", {"crontab": "*/5 * * * *"}, format="json"
    )

    assert response.status_code == 400
    assert set(response.json()) == {"interval_seconds", "crontab"}


def test_reader_may_list_but_not_create_and_unknown_is_404(admin_api, reader_api, template):
    admin_api.post("/api/schedules/", nightly(template), format="json")

    assert reader_api.get("/api/schedules/").json()["count"] == 1
    assert reader_api.post("/api/schedules/", nightly(template), format="json").status_code == 403
    assert reader_api.patch("/api/schedules/nightly firmware check/", {"enabled": False}).status_code == 403
    assert admin_api.get("/api/schedules/nope/").status_code == 404
    assert admin_api.get("/api/trigger-rules/nope/").status_code == 404
    assert reader_api.post("/api/trigger-rules/", {}, format="json").status_code == 403


def door_rule(template) -> dict:
    """A door sensor's event starts a camera snapshot."""
    return {
        "name": "door opened",
        "topic_filter": "site/berlin/door/+/opened",
        "template": template.name,
        "parameters": {"door": "{{ topic.3 }}", "badge": "{{ message.badge }}", "resolution": "hd"},
        "idempotency_key": "{{ message.event_id }}",
    }


def test_trigger_rule_is_created_and_edited(admin_api, template):
    created = admin_api.post("/api/trigger-rules/", door_rule(template), format="json")
    assert created.status_code == 201, created.content

    edited = admin_api.patch(
        "/api/trigger-rules/door opened/", {"enabled": False, "priority": 8}, format="json"
    )

    assert edited.status_code == 200, edited.content
    rule = TriggerRule.objects.get(name="door opened")
    assert (rule.enabled, rule.priority, rule.topic_filter) == (False, 8, "site/berlin/door/+/opened")


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"topic_filter": "site/#/opened"}, "topic_filter"),
        ({"topic_filter": "site/door+/opened"}, "topic_filter"),
        ({"topic_filter": ""}, "topic_filter"),
        ({"topic_filter": "$share/g/site/#"}, "topic_filter"),
        ({"parameters": {"door": "{{ params.door }}"}}, "parameters"),
        ({"parameters": {"door": "{{ topic.9 }}"}}, "parameters"),
        ({"parameters": {"door": "{{ topic.x }}"}}, "parameters"),
        ({"parameters": {"door": "{{ message.badge"}}, "parameters"),
        ({"parameters": "door"}, "parameters"),
        ({"idempotency_key": "always-the-same"}, "idempotency_key"),
        ({"template": "no such template"}, "template"),
    ],
)
def test_invalid_trigger_rule_is_400_naming_the_field(admin_api, template, change, field):
    response = admin_api.post("/api/trigger-rules/", {**door_rule(template), **change}, format="json")

    assert response.status_code == 400
    assert list(response.json()) == [field], response.json()
