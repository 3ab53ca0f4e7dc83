"""Admin for schedules and trigger rules: saving a schedule keeps its PeriodicTask in step."""

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django_celery_beat.models import PeriodicTask

from tests.factories import DeviceFactory, template_with_steps
from triggers.models import Overlap, Schedule, TriggerRule
from triggers.schedules import schedule_fire, schedule_save

pytestmark = pytest.mark.django_db


@pytest.fixture
def browser() -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser("admin", "a@example.com", "pw"))
    return client


@pytest.fixture
def template():
    return template_with_steps((DeviceFactory(), "firmware/check", {}))


def form(template, **changes) -> dict:
    return {
        "name": "nightly",
        "template": template.pk,
        "parameters": "{}",
        "priority": "",
        "interval_seconds": "",
        "crontab": "0 2 * * *",
        "timezone": "Europe/Berlin",
        "enabled": "on",
        "overlap": "skip",
        **changes,
    }


def test_adding_and_editing_a_schedule_updates_its_periodic_task(browser, template):
    added = browser.post("/admin/triggers/schedule/add/", form(template))
    assert added.status_code == 302, added.content.decode()[:2000]
    schedule = Schedule.objects.get(name="nightly")
    assert schedule.periodic_task.crontab.hour == "2"

    changed = browser.post(
        f"/admin/triggers/schedule/{schedule.pk}/change/",
        form(template, crontab="", interval_seconds="300", enabled=""),
    )

    assert changed.status_code == 302
    task = PeriodicTask.objects.get(pk=schedule.periodic_task_id)
    assert (task.interval.every, task.crontab, task.enabled) == (300, None, False)


def test_invalid_schedule_form_names_the_fields(browser, template):
    response = browser.post("/admin/triggers/schedule/add/", form(template, interval_seconds="60"))

    assert response.status_code == 200
    errors = response.context["adminform"].form.errors
    assert set(errors) == {"interval_seconds", "crontab"}
    bad_zone = browser.post("/admin/triggers/schedule/add/", form(template, timezone="Mars/Olympus"))
    assert set(bad_zone.context["adminform"].form.errors) == {"timezone"}
    assert not Schedule.objects.exists()


def test_changelist_shows_the_last_run_and_the_disable_action_stops_the_task(browser, template):
    schedule = schedule_save(
        schedule=Schedule(name="every minute", template=template, interval_seconds=60, overlap=Overlap.ALLOW)
    )
    schedule_fire(schedule_id=schedule.pk)

    page = browser.get("/admin/triggers/schedule/")
    assert page.status_code == 200
    assert "every 60 s" in page.content.decode() and "pending" in page.content.decode()

    browser.post(
        "/admin/triggers/schedule/", {"action": "schedules_disable", "_selected_action": [schedule.pk]}
    )
    assert PeriodicTask.objects.get(pk=schedule.periodic_task_id).enabled is False
    browser.post(
        "/admin/triggers/schedule/", {"action": "schedules_enable", "_selected_action": [schedule.pk]}
    )
    assert PeriodicTask.objects.get(pk=schedule.periodic_task_id).enabled is True


def test_deleting_a_schedule_in_admin_deletes_its_periodic_task(browser, template):
    schedule = schedule_save(schedule=Schedule(name="gone", template=template, interval_seconds=60))

    browser.post(f"/admin/triggers/schedule/{schedule.pk}/delete/", {"post": "yes"})

    assert not Schedule.objects.exists()
    assert not PeriodicTask.objects.filter(task="triggers.schedule_fire").exists()


def test_trigger_rule_admin_validates_the_filter_and_references(browser, template):
    rule = {
        "name": "door opened",
        "topic_filter": "site/berlin/door/+/opened",
        "template": template.pk,
        "parameters": '{"door": "{{ topic.3 }}"}',
        "idempotency_key": "{{ message.event_id }}",
        "priority": "",
        "enabled": "on",
        "max_runs_per_minute": "60",
        "max_active_runs": "10",
    }
    bad = browser.post("/admin/triggers/triggerrule/add/", {**rule, "topic_filter": "site/#/door"})
    assert set(bad.context["adminform"].form.errors) == {"topic_filter"}

    assert browser.post("/admin/triggers/triggerrule/add/", rule).status_code == 302
    assert TriggerRule.objects.get().parameters == {"door": "{{ topic.3 }}"}
    assert browser.get("/admin/triggers/triggerrule/").status_code == 200
