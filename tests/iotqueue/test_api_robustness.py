"""Every input gets a 4xx with a JSON body, never a 5xx: deep JSON, oversized bodies, form
bodies, deleting what is still referenced, unique-name races, and no existence oracle on
run actions."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlencode

import pytest
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test import override_settings
from rest_framework.test import APIClient

from devices import credentials
from devices.models import Device, DeviceGroup
from iotqueue.dynsec import DynsecError
from jobs.models import JobRun, JobStep, RunStatus
from jobs.services import template_plan
from jobs.template_serializers import JobTemplateSerializer
from tests.factories import DeviceFactory, template_with_steps

pytestmark = pytest.mark.django_db

# Deep enough that Python's JSON decoder gives up with RecursionError (about a thousand).
RECURSION_DEEP = 5000
FIVE_MB = 5 * 1024 * 1024
FORM = "application/x-www-form-urlencoded"


def nested(depth: int) -> str:
    """A JSON array nested `depth` levels deep, as text."""
    return "[" * depth + "]" * depth


def nested_object(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def json_error(response) -> dict:
    """The answer's JSON body, after checking it is a 4xx in JSON."""
    assert 400 <= response.status_code < 500, (response.status_code, response.content[:300])
    assert response["Content-Type"].startswith("application/json"), response["Content-Type"]
    return response.json()


def api_as(user: User) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


# --- Deep JSON --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path", ["/api/token/", "/api/runs/", "/api/devices/", "/api/templates/", "/api/schedules/"]
)
def test_json_nested_beyond_what_python_decodes_is_a_400(admin_api, path):
    response = admin_api.post(path, nested(RECURSION_DEEP), content_type="application/json")

    assert response.status_code == 400
    assert "nested more than 32 levels" in json_error(response)["detail"]


def test_the_anonymous_token_endpoint_refuses_deep_json_too():
    response = APIClient().post("/api/token/", nested(RECURSION_DEEP), content_type="application/json")

    assert response.status_code == 400
    assert "nested more than" in json_error(response)["detail"]


def test_run_parameters_nested_beyond_the_limit_are_refused(admin_api):
    # given a template, and parameters Python could decode but nest 40 levels deep
    template = template_with_steps((DeviceFactory(), "on", {}))

    # when a run is started with them
    response = admin_api.post(
        "/api/runs/", {"template": template.name, "parameters": nested_object(40)}, format="json"
    )

    # then it is a 400 and no run was stored
    assert response.status_code == 400
    assert "nested more than 32 levels" in json_error(response)["detail"]
    assert not JobRun.objects.exists()


@override_settings(IOTQUEUE_JSON_MAX_DEPTH=3)
def test_the_depth_limit_is_a_setting_for_bodies_and_for_each_stored_field(admin_api):
    # given a limit of 3 levels, when a JSON body nests 4 deep, and a form field holds
    # JSON 4 deep (DRF decodes it after the parser: the field checks it again)
    in_json = admin_api.post(
        "/api/devices/", {"name": "lamp-1", "config": {"a": {"b": {"c": 1}}}}, format="json"
    )
    in_form = admin_api.post("/api/devices/", {"name": "lamp-1", "config": '{"a": {"b": {"c": {}}}}'})

    # then both are refused, the form one naming its field
    assert "nested more than 3 levels" in json_error(in_json)["detail"]
    assert "nested more than 3 levels" in json_error(in_form)["config"][0]
    assert admin_api.post("/api/devices/", {"name": "lamp-1", "config": '{"a": {"b": 1}}'}).status_code == 201


def test_a_form_field_holding_deep_json_is_a_400_naming_the_field(admin_api):
    response = admin_api.post("/api/devices/", {"name": "lamp-1", "config": nested(RECURSION_DEEP)})

    assert response.status_code == 400
    assert "nested more than" in json_error(response)["config"][0]


# --- Form bodies validated like JSON ----------------------------------------------------


@pytest.mark.parametrize("encoding", ["form", "multipart"])
def test_form_null_for_a_json_field_is_a_400_naming_the_field(admin_api, encoding):
    # given form and multipart bodies, where every value is a string and JSON fields hold JSON
    fields = {"name": "lamp-1", "config": "null"}
    if encoding == "form":
        response = admin_api.post("/api/devices/", urlencode(fields), content_type=FORM)
    else:
        response = admin_api.post("/api/devices/", fields, format="multipart")

    assert response.status_code == 400
    assert json_error(response) == {"config": ["This field may not be null."]}


def test_form_null_on_patch_is_a_400_and_changes_nothing(admin_api):
    device = DeviceFactory(config={"mode": "eco"})

    response = admin_api.patch(f"/api/devices/{device.name}/", {"config": "null"}, format="multipart")

    assert response.status_code == 400
    assert "config" in json_error(response)
    device.refresh_from_db()
    assert device.config == {"mode": "eco"}


@pytest.mark.parametrize("config", [[1, 2], "eco", 3])
def test_a_device_config_is_a_json_object(admin_api, config):
    response = admin_api.post("/api/devices/", {"name": "lamp-1", "config": config}, format="json")

    assert response.status_code == 400
    assert json_error(response) == {"config": ['Config must be a JSON object, e.g. {"mode": "eco"}.']}


# --- Body size --------------------------------------------------------------------------


@pytest.mark.parametrize("content_type", ["application/json", FORM])
def test_a_5_mb_body_is_a_413_in_json(admin_api, content_type):
    body = json.dumps({"template": "x", "parameters": {"blob": "x" * FIVE_MB}})

    response = admin_api.post("/api/runs/", body, content_type=content_type)

    assert response.status_code == 413
    assert "DATA_UPLOAD_MAX_MEMORY_SIZE" in json_error(response)["detail"]


def test_a_5_mb_multipart_body_is_a_413_in_json(admin_api):
    response = admin_api.post("/api/devices/", {"name": "lamp-1", "config": "{}", "x": "x" * FIVE_MB})

    assert response.status_code == 413
    assert "DATA_UPLOAD_MAX_MEMORY_SIZE" in json_error(response)["detail"]


@override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=1000)
def test_the_size_limit_is_the_django_setting(admin_api):
    # given a limit of 1000 bytes, when one body is under it and another over it
    small = admin_api.post("/api/groups/", {"name": "pumps", "description": "x" * 100}, format="json")
    large = admin_api.post("/api/groups/", {"name": "fans", "description": "x" * 1000}, format="json")

    # then the small one is stored, the large one is a 413 and is not
    assert small.status_code == 201
    assert large.status_code == 413 and "detail" in json_error(large)
    assert list(DeviceGroup.objects.values_list("name", flat=True)) == ["pumps"]


def test_an_anonymous_5_mb_token_request_is_a_413_in_json():
    body = json.dumps({"username": "x" * FIVE_MB, "password": "pw"})

    response = APIClient().post("/api/token/", body, content_type="application/json")

    assert response.status_code == 413
    assert "detail" in json_error(response)


# --- Deleting what is still referenced --------------------------------------------------


def test_deleting_a_device_a_template_uses_is_a_409_naming_the_step(admin_api):
    device = DeviceFactory()
    template = template_with_steps((device, "on", {}))

    response = admin_api.delete(f"/api/devices/{device.name}/")

    assert response.status_code == 409
    body = json_error(response)
    assert body["detail"].startswith(f"Cannot delete device '{device.name}': 1 object(s) still refer to it")
    step = JobStep.objects.get(device=device)
    assert body["referenced_by"] == [{"type": "job step", "id": str(step.pk), "name": str(step)}]
    assert body["referenced_by_count"] == 1
    assert template.steps.filter(device=device).exists()


def test_deleting_a_template_with_runs_is_a_409_naming_the_runs(admin_api):
    template = template_with_steps((DeviceFactory(), "on", {}))
    run = JobRun.objects.create(template=template, plan=template_plan(template), status=RunStatus.SUCCEEDED)

    response = admin_api.delete(f"/api/templates/{template.name}/")

    assert response.status_code == 409
    body = json_error(response)
    assert "job runs" in body["detail"]
    assert [entry["id"] for entry in body["referenced_by"]] == [str(run.pk)]


def test_deleting_a_group_a_step_targets_is_a_409(admin_api):
    group = DeviceGroup.objects.create(name="pumps")
    template = template_with_steps((DeviceFactory(), "on", {}))
    JobStep.objects.create(template=template, position=1, group=group, action="off", timeout_seconds=30)

    response = admin_api.delete("/api/groups/pumps/")

    assert response.status_code == 409
    assert json_error(response)["referenced_by"][0]["type"] == "job step"
    assert DeviceGroup.objects.filter(name="pumps").exists()


def test_the_409_names_at_most_ten_referrers_and_counts_them_all(admin_api):
    template = template_with_steps((DeviceFactory(), "on", {}))
    for _ in range(12):
        JobRun.objects.create(template=template, plan=template_plan(template), status=RunStatus.FAILED)

    body = json_error(admin_api.delete(f"/api/templates/{template.name}/"))

    assert len(body["referenced_by"]) == 10 and body["referenced_by_count"] == 12


# --- Unique-name races ------------------------------------------------------------------

PARALLEL = 20


def parallel_posts(path: str, bodies: list[dict]) -> list[int]:
    """POST each body from its own thread and client at once; the status codes."""
    admin = User.objects.get(username="admin")

    def post(body: dict) -> int:
        client = api_as(admin)
        client.raise_request_exception = False  # a 500 is an answer here, not a test crash
        try:
            return client.post(path, body, format="json").status_code
        finally:
            connection.close()  # this thread's own connection

    with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        return list(pool.map(post, bodies))


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(60)
def test_two_creates_of_one_template_name_that_both_pass_validation_get_201_and_409(admin_api, monkeypatch):
    # given two requests for one new name that both get past the uniqueness check before
    # either stores its template (the window a real race hits, held open by a barrier)
    device = DeviceFactory()
    both_validated = threading.Barrier(2, timeout=20)

    def validate(self, attrs):
        both_validated.wait()
        return attrs

    monkeypatch.setattr(JobTemplateSerializer, "validate", validate, raising=False)
    body = {"name": "raced", "steps": [{"position": 0, "device": device.name, "action": "on"}]}

    # when both are stored
    answers = parallel_posts("/api/templates/", [body, body])

    # then one is created and the other is a 409, not a 500
    assert sorted(answers) == [201, 409]


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["device", "template"])
def test_parallel_creates_of_one_name_never_answer_5xx(admin_api, kind):
    device = DeviceFactory()
    if kind == "device":
        path, body = "/api/devices/", {"name": "raced-device"}
    else:
        path, body = "/api/templates/", {"name": "raced", "steps": [{"position": 0, "device": device.name}]}
        body["steps"][0]["action"] = "on"

    answers = parallel_posts(path, [body] * PARALLEL)

    assert answers.count(201) == 1
    assert set(answers) <= {201, 400, 409}, answers


# --- A device write that fails changes nothing ------------------------------------------


def test_a_device_write_the_broker_refuses_is_a_503_and_stores_nothing(admin_api, monkeypatch):
    # given a broker that cannot take the device's identity
    def broker_down(device):
        raise DynsecError("broker down")

    monkeypatch.setattr(credentials, "identity_write", broker_down)
    monkeypatch.setattr(credentials, "managed", lambda: True)

    # when a device is created
    response = admin_api.post("/api/devices/", {"name": "lamp-1"}, format="json")

    # then the answer says nothing changed, and nothing did
    assert response.status_code == 503 and "nothing changed" in response.json()["detail"]
    assert not Device.objects.filter(name="lamp-1").exists()


# --- No existence oracle on run and device actions --------------------------------------


def user_with(*codenames: str) -> User:
    user = User.objects.create_user(f"user-{User.objects.count()}")
    user.user_permissions.add(*Permission.objects.filter(codename__in=codenames))
    return user


@pytest.mark.parametrize("action", ["cancel", "retry"])
def test_a_user_who_may_not_see_runs_gets_the_same_404_for_an_existing_and_an_unknown_run(action):
    # given a run, and a user with every run permission except seeing them
    template = template_with_steps((DeviceFactory(), "on", {}))
    run = JobRun.objects.create(template=template, plan=template_plan(template), status=RunStatus.FAILED)
    client = api_as(user_with("add_jobrun", "change_jobrun"))

    # when it acts on that run, and on a run that does not exist
    existing = client.post(f"/api/runs/{run.pk}/{action}/")
    unknown = client.post(f"/api/runs/00000000-0000-0000-0000-000000000000/{action}/")

    # then both answers are the same 404, and the run is untouched
    assert existing.status_code == unknown.status_code == 404
    assert existing.json() == unknown.json()
    run.refresh_from_db()
    assert run.status == RunStatus.FAILED and JobRun.objects.count() == 1


@pytest.mark.parametrize("action", ["cancel", "retry"])
def test_a_user_who_may_see_runs_but_not_act_still_gets_403(action):
    template = template_with_steps((DeviceFactory(), "on", {}))
    run = JobRun.objects.create(template=template, plan=template_plan(template), status=RunStatus.FAILED)
    client = api_as(user_with("view_jobrun"))

    assert client.post(f"/api/runs/{run.pk}/{action}/").status_code == 403
    assert client.post(f"/api/runs/00000000-0000-0000-0000-000000000000/{action}/").status_code == 404


def test_a_user_who_may_not_see_devices_gets_the_same_404_for_credentials_of_any_device():
    device = DeviceFactory()
    client = api_as(user_with("change_device"))

    existing = client.post(f"/api/devices/{device.name}/credentials/")
    unknown = client.post("/api/devices/no-such-device/credentials/")

    assert existing.status_code == unknown.status_code == 404
    assert existing.json() == unknown.json()
