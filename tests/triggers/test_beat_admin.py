"""Beat's PeriodicTask admin: a task a Schedule owns is read-only there and links to the
schedule (its next save would overwrite any edit); a task nobody owns stays editable."""

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django_celery_beat.models import IntervalSchedule, PeriodicTask

from tests.factories import DeviceFactory, template_with_steps
from triggers.models import Schedule
from triggers.schedules import schedule_save

pytestmark = pytest.mark.django_db


@pytest.fixture
def browser() -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser("admin", "a@example.com", "pw"))
    return client


@pytest.fixture
def owned_task() -> PeriodicTask:
    template = template_with_steps((DeviceFactory(), "firmware/check", {}))
    schedule = schedule_save(schedule=Schedule(name="nightly check", template=template, interval_seconds=300))
    return PeriodicTask.objects.get(pk=schedule.periodic_task_id)


@pytest.fixture
def unowned_task() -> PeriodicTask:
    every_minute = IntervalSchedule.objects.create(every=60, period=IntervalSchedule.SECONDS)
    return PeriodicTask.objects.create(name="housekeeping", task="jobs.cleanup", interval=every_minute)


def change_form(task: PeriodicTask, **changes) -> dict:
    return {
        "name": task.name,
        "regtask": "",
        "task": task.task,
        "enabled": "on",
        "description": "",
        "interval": task.interval_id or "",
        "crontab": "",
        "solar": "",
        "clocked": "",
        "start_time_0": "",
        "start_time_1": "",
        "args": "[]",
        "kwargs": task.kwargs or "{}",
        "expires_0": "",
        "expires_1": "",
        "expire_seconds": "",
        "queue": "",
        "exchange": "",
        "routing_key": "",
        "priority": "",
        "headers": "{}",
        **changes,
    }


def test_an_owned_task_is_read_only_and_links_to_its_schedule(browser, owned_task):
    # given a PeriodicTask a schedule owns
    schedule = Schedule.objects.get(periodic_task=owned_task)

    # when its page in beat's admin is opened
    page = browser.get(f"/admin/django_celery_beat/periodictask/{owned_task.pk}/change/")

    # then it is shown, without a form to save, and links to the schedule
    assert page.status_code == 200
    body = page.content.decode()
    assert f'href="/admin/triggers/schedule/{schedule.pk}/change/"' in body
    assert 'name="_save"' not in body and "deletelink" not in body


def test_a_change_to_an_owned_task_is_refused(browser, owned_task):
    # given a PeriodicTask a schedule owns
    url = f"/admin/django_celery_beat/periodictask/{owned_task.pk}/change/"

    # when a change is posted to it, or it is deleted
    changed = browser.post(url, change_form(owned_task, enabled=""))
    deleted = browser.post(f"/admin/django_celery_beat/periodictask/{owned_task.pk}/delete/", {"post": "yes"})

    # then both are refused and the task is as the schedule left it
    assert changed.status_code == 403 and deleted.status_code == 403
    owned_task.refresh_from_db()
    assert owned_task.enabled


def test_beat_bulk_actions_leave_owned_tasks_alone(browser, owned_task, unowned_task):
    # when both tasks are disabled from beat's list
    browser.post(
        "/admin/django_celery_beat/periodictask/",
        {"action": "disable_tasks", "_selected_action": [owned_task.pk, unowned_task.pk]},
    )

    # then only the task nobody owns was disabled
    owned_task.refresh_from_db()
    unowned_task.refresh_from_db()
    assert owned_task.enabled and not unowned_task.enabled


def test_a_task_nobody_owns_stays_editable(browser, unowned_task):
    # given a PeriodicTask no schedule owns
    url = f"/admin/django_celery_beat/periodictask/{unowned_task.pk}/change/"
    assert 'name="_save"' in browser.get(url).content.decode()

    # when a change is posted to it
    response = browser.post(url, change_form(unowned_task, enabled=""))

    # then it is saved
    assert response.status_code == 302, response.content.decode()[:3000]
    unowned_task.refresh_from_db()
    assert not unowned_task.enabled
