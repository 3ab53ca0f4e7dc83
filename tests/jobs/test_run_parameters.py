"""A run whose template reads {{ params.level }} is refused without `level`, before any run
exists: REST, the admin's Run now, schedules, trigger rules and canvas links alike."""

from __future__ import annotations

import uuid

import pytest
from celery import signature
from django.contrib.auth.models import User
from django.test import Client

from jobs.canvas import PARK_TASK
from jobs.models import JobRun, JobStep, RunEvent
from tests.conftest import wait_for
from tests.factories import DeviceFactory, template_with_steps
from tests.jobs.canvas_tasks import on_error, recorded
from triggers.models import Schedule, TriggerRule
from triggers.rules import trigger_rule_fire
from triggers.schedules import schedule_fire

pytestmark = [pytest.mark.django_db, pytest.mark.timeout(120)]


@pytest.fixture
def template():
    return template_with_steps((DeviceFactory(), "on", {"level": "{{ params.level }}"}))


@pytest.fixture
def browser() -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser("boss", "boss@example.com", "pw"))
    return client


# --- REST ----------------------------------------------------------------------------------


def test_a_rest_start_without_a_parameter_the_steps_read_is_400_naming_it(admin_api, template):
    # when a run is asked for with no parameters
    response = admin_api.post("/api/runs/", {"template": template.name, "parameters": {}}, format="json")

    # then it is refused on the parameters field, naming the one missing, and nothing was created
    assert response.status_code == 400, response.content
    assert "level" in response.json()["parameters"][0]
    assert not JobRun.objects.exists()
    # with the parameter it starts
    started = admin_api.post(
        "/api/runs/", {"template": template.name, "parameters": {"level": 80}}, format="json"
    )
    assert started.status_code == 201, started.content


def test_a_template_says_which_parameters_a_run_must_give(admin_api):
    # given a template whose first step reads {{ params.level }} and whose second addresses
    # its device by the parameter `pump`, and reads `level` again in its compensation
    template = template_with_steps((DeviceFactory(), "on", {"level": "{{ params.level }}"}))
    JobStep.objects.create(
        template=template,
        position=2,
        device_param="pump",
        action="prime",
        compensation_action="drain",
        compensation_args={"to": "{{ params.level }}", "why": "{{ params.reason }}"},
    )

    # when it is read over REST
    listed = admin_api.get("/api/templates/").json()["results"]
    detail = admin_api.get(f"/api/templates/{template.name}/").json()

    # then it lists each parameter once, in step order
    assert detail["parameters"] == ["level", "pump", "reason"]
    assert [t["parameters"] for t in listed if t["name"] == template.name] == [["level", "pump", "reason"]]


def test_a_device_param_is_a_parameter_too_and_for_each_gives_it(admin_api):
    # given a template addressing its device by parameter
    pump = DeviceFactory(labels={"kind": "pump-params"})
    template = template_with_steps()
    JobStep.objects.create(template=template, position=0, device_param="device", action="firmware/check")

    refused = admin_api.post("/api/runs/", {"template": template.name}, format="json")
    assert refused.status_code == 400 and "device" in refused.json()["parameters"][0]
    # for each device, every run gets its device's name
    each = {"template": template.name, "for_each": {"labels": {"kind": "pump-params"}}}
    started = admin_api.post("/api/runs/", each, format="json")
    assert started.status_code == 201, started.content
    assert JobRun.objects.get().parameters == {"device": pump.name}


# --- schedules and trigger rules, at save ------------------------------------------------


def test_a_schedule_without_a_parameter_is_refused_at_save(admin_api, browser, template):
    schedule = {"name": "nightly", "template": template.name, "parameters": {}, "interval_seconds": 60}

    response = admin_api.post("/api/schedules/", schedule, format="json")

    assert response.status_code == 400 and "level" in response.json()["parameters"][0]
    form = {
        "name": "nightly",
        "template": template.pk,
        "parameters": '{"zone": "B"}',
        "priority": "",
        "interval_seconds": "60",
        "crontab": "",
        "timezone": "UTC",
        "enabled": "on",
        "overlap": "skip",
    }
    page = browser.post("/admin/triggers/schedule/add/", form)
    assert page.status_code == 200
    assert "level" in page.context["adminform"].form.errors["parameters"][0]
    assert not Schedule.objects.exists()
    # given, it saves
    saved = browser.post("/admin/triggers/schedule/add/", {**form, "parameters": '{"level": 30}'})
    assert saved.status_code == 302


def test_a_trigger_rule_without_a_parameter_is_refused_at_save(admin_api, browser, template):
    rule = {
        "name": "door opened",
        "topic_filter": "site/berlin/door/+/opened",
        "template": template.name,
        "parameters": {"door": "{{ topic.3 }}"},
    }

    response = admin_api.post("/api/trigger-rules/", rule, format="json")

    assert response.status_code == 400 and "level" in response.json()["parameters"][0]
    form = {
        **rule,
        "template": template.pk,
        "parameters": '{"door": "{{ topic.3 }}"}',
        "idempotency_key": "",
        "priority": "",
        "enabled": "on",
        "max_runs_per_minute": "60",
        "max_active_runs": "10",
    }
    page = browser.post("/admin/triggers/triggerrule/add/", form)
    assert page.status_code == 200
    assert "level" in page.context["adminform"].form.errors["parameters"][0]
    assert not TriggerRule.objects.exists()
    fixed = {**rule, "parameters": {"level": "{{ message.level }}"}}
    assert admin_api.post("/api/trigger-rules/", fixed, format="json").status_code == 201


# --- at fire time: the template changed after the schedule or rule was saved ---------------


def test_a_fire_missing_a_parameter_records_why_and_starts_nothing(template):
    # given a schedule and a rule stored before the template read `level` (rows, unchecked)
    schedule = Schedule.objects.create(name="nightly", template=template, interval_seconds=60)
    rule = TriggerRule.objects.create(name="door", topic_filter="site/+/door", template=template)

    # when they fire
    assert schedule_fire(schedule_id=schedule.pk) is None
    assert trigger_rule_fire(rule=rule, topic="site/berlin/door", message={}) is None

    # then each recorded why, and no run exists
    failed = RunEvent.objects.get(kind="schedule.failed")
    dropped = RunEvent.objects.get(kind="message.dropped")
    assert "missing parameter: level" in failed.message and "missing parameter: level" in dropped.message
    assert not JobRun.objects.exists()


# --- canvas ---------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_canvas_link_reading_a_parameter_it_cannot_have_fails_before_any_run(stack):
    # given a link built by hand (device_command itself refuses it when built)
    device = DeviceFactory()
    k = uuid.uuid4().hex[:8]
    link = signature(
        PARK_TASK,
        kwargs={
            "device": device.name,
            "action": "on",
            "args": {"level": "{{ params.level }}"},
            "options": {},
        },
    )

    link.apply_async(link_error=on_error.s(key=k))

    errors = wait_for(lambda: recorded(k), what="the errback")
    assert "missing parameter: level" in errors[0]["error"]
    assert not JobRun.objects.exists()


# --- the admin's Run now ------------------------------------------------------------------


def test_run_now_lists_each_parameter_with_an_input_and_refuses_it_missing(browser, template):
    url = f"/admin/jobs/jobtemplate/{template.pk}/run/"

    # the page lists the parameter with its own input, marked required
    page = browser.get(url)
    assert page.status_code == 200
    assert 'name="param_level"' in page.text
    assert 'class="required" for="id_param_level"' in page.text

    # an empty submit is a field error, and no run is created
    refused = browser.post(url, {"parameters": "{}", "param_level": ""})
    assert refused.status_code == 200
    assert "level" in refused.context["form"].errors["param_level"][0]
    assert not JobRun.objects.exists()

    # filled, a run starts with the value as JSON when it parses
    started = browser.post(url, {"parameters": "{}", "param_level": "80"})
    assert started.status_code == 302
    assert JobRun.objects.get().parameters == {"level": 80}


def test_run_now_takes_text_json_and_the_json_object_and_refuses_a_broken_value(browser, template):
    url = f"/admin/jobs/jobtemplate/{template.pk}/run/"

    broken = browser.post(url, {"parameters": "{}", "param_level": "[1, 2"})
    assert broken.status_code == 200 and "Not valid JSON" in broken.context["form"].errors["param_level"][0]
    twice = browser.post(url, {"parameters": '{"level": 1}', "param_level": "2"})
    assert twice.status_code == 200 and "param_level" in twice.context["form"].errors
    assert not JobRun.objects.exists()

    assert browser.post(url, {"parameters": "{}", "param_level": "dim"}).status_code == 302
    assert browser.post(url, {"parameters": '{"level": {"max": 9}}'}).status_code == 302
    assert [run.parameters for run in JobRun.objects.order_by("created_at")] == [
        {"level": "dim"},
        {"level": {"max": 9}},
    ]
