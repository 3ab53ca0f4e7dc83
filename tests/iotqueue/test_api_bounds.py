"""Bounded requests: limits on what one write may ask for, step writes that cost what changed,
and names that their own URLs can find again."""

from urllib.parse import quote

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from devices.models import DeviceGroup
from jobs.engine.fanout import fanout_rows_make
from jobs.engine.start import StepRefused
from jobs.models import JobRun, JobStep, JobTemplate, StepRun
from jobs.services import run_start
from tests.factories import DeviceFactory, JobTemplateFactory, template_with_steps

pytestmark = pytest.mark.django_db


def step(position: int, device, action: str = "noop") -> dict:
    return {"position": position, "device": device.name, "action": action}


def group_of(name: str, size: int) -> DeviceGroup:
    group = DeviceGroup.objects.create(name=name)
    for _ in range(size):
        DeviceFactory().groups.add(group)
    return group


# --- limits -----------------------------------------------------------------------------


def test_a_template_over_the_step_limit_is_refused_before_any_step_is_read(admin_api, settings):
    # given a body with one step more than the default limit, each naming a device
    device = DeviceFactory()
    limit = settings.IOTQUEUE_TEMPLATE_MAX_STEPS
    body = {"name": "huge", "steps": [step(n, device) for n in range(limit + 1)]}

    # when it is posted
    with CaptureQueriesContext(connection) as queries:
        response = admin_api.post("/api/templates/", body, format="json")

    # then 400 names steps and the limit, and no step's device was even looked up
    assert response.status_code == 400, response.content
    assert list(response.json()) == ["steps"]
    assert str(limit) in response.json()["steps"][0]
    assert "IOTQUEUE_TEMPLATE_MAX_STEPS" in response.json()["steps"][0]
    assert len(queries) < 5, [q["sql"] for q in queries]
    assert not JobTemplate.objects.exists()


def test_a_template_at_the_step_limit_is_created(admin_api, settings):
    settings.IOTQUEUE_TEMPLATE_MAX_STEPS = 3
    device = DeviceFactory()

    response = admin_api.post(
        "/api/templates/", {"name": "three", "steps": [step(n, device) for n in range(3)]}, format="json"
    )

    assert response.status_code == 201, response.content
    assert len(response.json()["steps"]) == 3


def test_for_each_selecting_more_devices_than_the_limit_is_400(admin_api, settings):
    # given a group of three devices and a limit of two
    settings.IOTQUEUE_FOR_EACH_MAX_DEVICES = 2
    group_of("pumps", 3)
    template = JobTemplateFactory()
    JobStep.objects.create(template=template, position=0, device_param="device", action="noop")

    # when a run for each device of the group is asked for
    response = admin_api.post(
        "/api/runs/", {"template": template.name, "for_each": {"group": "pumps"}}, format="json"
    )

    # then nothing starts, and the answer names for_each and the limit
    assert response.status_code == 400, response.content
    assert list(response.json()) == ["for_each"]
    assert "IOTQUEUE_FOR_EACH_MAX_DEVICES (2)" in response.json()["for_each"][0]
    assert not JobRun.objects.exists()


def test_parameters_over_the_size_limit_are_400(admin_api, settings):
    template = template_with_steps((DeviceFactory(), "noop", {}))
    limit = settings.IOTQUEUE_RUN_PARAMETERS_MAX_BYTES

    too_big = admin_api.post(
        "/api/runs/", {"template": template.name, "parameters": {"blob": "x" * limit}}, format="json"
    )
    fits = admin_api.post(
        "/api/runs/", {"template": template.name, "parameters": {"blob": "x" * (limit - 20)}}, format="json"
    )

    assert too_big.status_code == 400, too_big.content
    assert list(too_big.json()) == ["parameters"]
    assert f"IOTQUEUE_RUN_PARAMETERS_MAX_BYTES ({limit})" in too_big.json()["parameters"][0]
    assert fits.status_code == 201, fits.content
    assert JobRun.objects.count() == 1


def test_a_fanout_step_over_the_device_limit_fails_without_rows(settings):
    # given a fan-out step on a group of three, a limit of two, and a run of it
    # (not enqueued: the test's transaction never commits, so only this call starts it)
    settings.IOTQUEUE_FANOUT_MAX_DEVICES = 2
    group = group_of("lamps", 3)
    template = JobTemplateFactory()
    JobStep.objects.create(template=template, position=0, group=group, action="on")
    run, _ = run_start(template=template)

    # when the step starts, then it is refused, naming the limit, and wrote no row
    with pytest.raises(StepRefused, match=r"3 devices match group lamps.*IOTQUEUE_FANOUT_MAX_DEVICES \(2\)"):
        fanout_rows_make(run, 0)
    assert not StepRun.objects.filter(run=run).exists()


def test_names_are_bounded_in_length(admin_api):
    response = admin_api.post("/api/groups/", {"name": "g" * 129}, format="json")

    assert response.status_code == 400 and list(response.json()) == ["name"]


# --- step writes cost what changed -------------------------------------------------------


def template_of(size: int) -> JobTemplate:
    device = DeviceFactory()
    template = JobTemplateFactory()
    JobStep.objects.bulk_create(
        [JobStep(template=template, position=n, device=device, action="noop") for n in range(size)]
    )
    return template


def patch_queries(client, template: JobTemplate) -> int:
    with CaptureQueriesContext(connection) as queries:
        response = client.patch(f"/api/templates/{template.name}/", {"description": "changed"}, format="json")
    assert response.status_code == 200, response.content
    assert len(response.json()["steps"]) == template.steps.count()
    return len(queries)


def test_patching_only_the_description_costs_the_same_for_any_number_of_steps(admin_api):
    # given a small and a large template
    small, large = template_of(2), template_of(60)
    large_steps = list(large.steps.values_list("pk", flat=True).order_by("position"))

    # The first request warms what is cached per process; the first write of a template
    # made by factories records its version 1 (jobs/services.py), which later ones do not.
    patch_queries(admin_api, small)
    patch_queries(admin_api, large)

    # when each gets only a new description, then both cost the same queries
    assert patch_queries(admin_api, large) == patch_queries(admin_api, small)

    # and the large one's steps were left as they were
    assert list(large.steps.values_list("pk", flat=True).order_by("position")) == large_steps
    large.refresh_from_db()
    assert large.description == "changed"


def test_a_put_rewrites_only_the_steps_that_changed(admin_api):
    # given a template of three steps
    device = DeviceFactory()
    admin_api.post(
        "/api/templates/", {"name": "rollout", "steps": [step(n, device) for n in range(3)]}, format="json"
    )
    before = dict(JobStep.objects.values_list("position", "pk"))

    # when it is replaced with step 1 changed, step 2 gone and a step 3 new
    steps = [step(0, device), step(1, device, "reboot"), step(3, device, "report")]
    response = admin_api.put("/api/templates/rollout/", {"name": "rollout", "steps": steps}, format="json")

    # then step 0 is the same row, and the rest are as sent
    assert response.status_code == 200, response.content
    assert [(s["position"], s["action"]) for s in response.json()["steps"]] == [
        (0, "noop"),
        (1, "reboot"),
        (3, "report"),
    ]
    after = dict(JobStep.objects.values_list("position", "pk"))
    assert after[0] == before[0]
    assert after[1] != before[1]
    assert sorted(after) == [0, 1, 3]


# --- names that appear in URLs ------------------------------------------------------------


@pytest.fixture
def template():
    return template_with_steps((DeviceFactory(), "noop", {}))


def bodies(template) -> dict[str, dict]:
    return {
        "groups": {},
        "templates": {"steps": [{"position": 0, "device": template.steps.get().device.name, "action": "x"}]},
        "schedules": {"template": template.name, "interval_seconds": 60},
        "trigger-rules": {"template": template.name, "topic_filter": "site/+/door"},
    }


@pytest.mark.parametrize("collection", ["groups", "templates", "schedules", "trigger-rules"])
@pytest.mark.parametrize("name", ["site/door", "back\\slash", "..", "tab\there"])
def test_a_name_its_url_cannot_reach_is_400(admin_api, template, collection, name):
    response = admin_api.post(
        f"/api/{collection}/", {**bodies(template)[collection], "name": name}, format="json"
    )

    assert response.status_code == 400, response.content
    assert list(response.json()) == ["name"]


@pytest.mark.parametrize("collection", ["groups", "templates", "schedules", "trigger-rules"])
@pytest.mark.parametrize("name", ["a.b", "Door opened", "v1.json", "50% off?#"])
def test_a_name_the_validator_takes_is_reachable(admin_api, template, collection, name):
    # given an object created with such a name
    created = admin_api.post(
        f"/api/{collection}/", {**bodies(template)[collection], "name": name}, format="json"
    )
    assert created.status_code == 201, created.content
    url = f"/api/{collection}/{quote(name)}/"

    # then its URL reads it and deletes it
    read = admin_api.get(url)
    assert read.status_code == 200, read.content
    assert read.json()["name"] == name
    assert admin_api.delete(url).status_code == 204
    assert admin_api.get(url).status_code == 404


def test_the_admin_refuses_a_name_with_a_slash():
    browser = Client()
    browser.force_login(User.objects.create_superuser("admin", "a@example.com", "pw"))

    response = browser.post("/admin/devices/devicegroup/add/", {"name": "a/b", "description": ""})

    assert response.status_code == 200  # the form again, with the error
    assert "may not contain /" in response.content.decode()
    assert not DeviceGroup.objects.exists()
