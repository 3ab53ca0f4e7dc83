"""REST API: templates with nested steps, devices and their lock, permissions, the schema."""

import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from devices.locks import device_lock_acquire, device_lock_release
from jobs.models import JobTemplate
from tests.factories import DeviceFactory

pytestmark = pytest.mark.django_db


def provisioning(devices) -> dict:
    """The provisioning job (check, init_instance, deduct, with rollback) as a REST body."""
    check, mysql, billing = devices
    return {
        "name": "Provision DB",
        "steps": [
            {
                "position": 0,
                "name": "check",
                "device": check.name,
                "action": "resource/check",
                "args": {"cpu": "{{ params.cpu }}"},
                "timeout_seconds": 300,
                "compensation_action": "monitor/report_event",
            },
            {
                "position": 1,
                "device": mysql.name,
                "action": "mysql/init_instance",
                "args": {"host": "{{ steps.check.result.host }}"},
                "timeout_seconds": 1800,
                "max_attempts": 3,
                "on_failure": "rollback",
                "compensation_action": "mysql/clean_instance",
            },
            {
                "position": 2,
                "device": billing.name,
                "action": "resource/deduct",
                "timeout_seconds": 200,
                "max_attempts": 2,
            },
        ],
    }


def test_template_with_steps_is_created_read_and_replaced(admin_api):
    devices = [DeviceFactory() for _ in range(3)]
    created = admin_api.post("/api/templates/", provisioning(devices), format="json")
    assert created.status_code == 201, created.content
    body = admin_api.get("/api/templates/Provision DB/").json()
    assert [s["action"] for s in body["steps"]] == [
        "resource/check",
        "mysql/init_instance",
        "resource/deduct",
    ]
    assert body["steps"][1]["device"] == devices[1].name

    replaced = admin_api.put(
        "/api/templates/Provision DB/",
        {"name": "Provision DB", "steps": [{"position": 0, "device": devices[0].name, "action": "ping"}]},
        format="json",
    )
    assert replaced.status_code == 200, replaced.content
    assert JobTemplate.objects.get(name="Provision DB").steps.count() == 1


def test_template_validation_errors_name_the_step_and_field(admin_api):
    devices = [DeviceFactory() for _ in range(3)]
    body = provisioning(devices)
    body["steps"][1]["args"] = {"host": "{{ steps.later.result.host }}"}
    body["steps"][2]["device"] = "no-such-device"
    response = admin_api.post("/api/templates/", body, format="json")
    assert response.status_code == 400
    errors = response.json()["steps"]
    assert "device" in errors["2"], errors
    body["steps"][2]["device"] = devices[2].name
    errors = admin_api.post("/api/templates/", body, format="json").json()["steps"]
    assert "'later' is not an earlier step" in errors["1"]["args"][0]
    assert set(errors) == {"1"}


def test_read_only_user_can_read_but_not_write_and_missing_is_404(admin_api, reader_api):
    device = DeviceFactory()
    assert reader_api.get("/api/templates/").status_code == 200
    assert reader_api.get("/api/devices/").status_code == 200
    denied = reader_api.post(
        "/api/templates/",
        {"name": "x", "steps": [{"position": 0, "device": device.name, "action": "a"}]},
        format="json",
    )
    assert denied.status_code == 403
    assert reader_api.post("/api/devices/", {"name": "new-1"}, format="json").status_code == 403
    assert reader_api.get("/api/templates/nope/").status_code == 404
    assert APIClient().get("/api/devices/").status_code in (401, 403)


def test_devices_crud_filters_and_lock_state(admin_api):
    created = admin_api.post(
        "/api/devices/", {"name": "pump-7", "labels": {"site": "berlin", "kind": "pump"}}, format="json"
    )
    assert created.status_code == 201, created.content
    assert admin_api.post("/api/devices/", {"name": "bad/name"}, format="json").status_code == 400
    DeviceFactory(labels={"site": "paris"})
    names = [d["name"] for d in admin_api.get("/api/devices/?label=site=berlin").json()["results"]]
    assert names == ["pump-7"]
    # a key is one JSON key, never a lookup path: `a__b` and `contains` match nothing here
    DeviceFactory(name="odd-1", labels={"a__b": "1", "contains": "x"})
    for selector, expected in (("a__b=1", ["odd-1"]), ("contains=x", ["odd-1"]), ("site__x=1", [])):
        found = admin_api.get(f"/api/devices/?label={selector}")
        assert [d["name"] for d in found.json()["results"]] == expected, selector
    for bad in ("label=site", "label==berlin", "online=maybe", "page_size=abc", "page_size=501", "page=0"):
        answer = admin_api.get(f"/api/devices/?{bad}")
        assert answer.status_code == 400 and bad.split("=")[0] in answer.json(), bad
    assert admin_api.get("/api/devices/?page=9").status_code == 404

    from devices.locks import lock_epoch_start

    lock_epoch_start()
    grant = device_lock_acquire("pump-7", holder="test:1", priority=5, lease_seconds=30)
    lock = admin_api.get("/api/devices/pump-7/lock/").json()
    assert (lock["holder"], lock["fence"]) == ("test:1", grant.fence)
    device_lock_release("pump-7", holder="test:1", fence=grant.fence)


def test_openapi_schema_is_served(admin_api):
    response = admin_api.get("/api/schema/?format=json")
    assert response.status_code == 200
    paths = response.json()["paths"]
    assert {"/api/runs/", "/api/templates/", "/api/devices/{name}/lock/"} <= set(paths)
    assert admin_api.get("/api/docs/").status_code == 200


def test_runs_list_filters_by_status_template_device_and_time(admin_api):
    from datetime import timedelta

    from django.utils import timezone

    from jobs.models import JobRun, RunStatus, StepRun
    from jobs.services import template_plan
    from tests.factories import template_with_steps

    lamp, cam = DeviceFactory(), DeviceFactory()
    morning = template_with_steps((lamp, "on", {}))
    other = template_with_steps((cam, "snap", {}))
    done = JobRun.objects.create(template=morning, plan=template_plan(morning), status=RunStatus.SUCCEEDED)
    StepRun.objects.create(run=done, index=0, device=lamp, action="on", status="succeeded")
    failed = JobRun.objects.create(template=other, plan=template_plan(other), status=RunStatus.FAILED)
    StepRun.objects.create(run=failed, index=0, device=cam, action="snap", status="failed")

    def ids(query: str) -> set[str]:
        response = admin_api.get(f"/api/runs/?{query}")
        assert response.status_code == 200, response.content
        return {r["id"] for r in response.json()["results"]}

    assert ids("status=succeeded") == {str(done.pk)}
    assert ids("status=succeeded&status=failed") == {str(done.pk), str(failed.pk)}
    assert ids(f"template={other.name}") == {str(failed.pk)}
    assert ids(f"device={lamp.name}") == {str(done.pk)}
    soon = (timezone.now() + timedelta(minutes=1)).isoformat().replace("+00:00", "Z")
    assert ids(f"since={soon}") == set()
    assert admin_api.get("/api/runs/?status=bogus").status_code == 400
    assert admin_api.get("/api/runs/?since=yesterday").status_code == 400


def test_a_user_without_view_permission_reads_nothing():
    nobody = APIClient()
    nobody.force_authenticate(User.objects.create_user("nobody"))
    for path in ("/api/runs/", "/api/templates/", "/api/devices/", "/api/groups/"):
        assert nobody.get(path).status_code == 403, path


def test_token_is_issued_for_valid_credentials_only():
    User.objects.create_user("operator", password="s3cret-pass")
    issued = APIClient().post("/api/token/", {"username": "operator", "password": "s3cret-pass"})
    assert issued.status_code == 200
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {issued.json()['token']}")
    assert client.get("/api/runs/").status_code == 403  # authenticated, but no view permission
    wrong = APIClient().post("/api/token/", {"username": "operator", "password": "nope"})
    assert wrong.status_code == 400 and "non_field_errors" in wrong.json()


def test_groups_crud_validation_permission_and_not_found(admin_api, reader_api):
    created = admin_api.post("/api/groups/", {"name": "pumps", "description": "Berlin pumps"}, format="json")
    assert created.status_code == 201, created.content
    assert admin_api.post("/api/groups/", {"name": "pumps"}, format="json").status_code == 400
    assert "name" in admin_api.post("/api/groups/", {}, format="json").json()
    device = DeviceFactory()
    assert (
        admin_api.patch(f"/api/devices/{device.name}/", {"groups": ["pumps"]}, format="json").status_code
        == 200
    )
    assert admin_api.get(f"/api/devices/{device.name}/").json()["groups"] == ["pumps"]
    assert reader_api.delete("/api/groups/pumps/").status_code == 403
    assert admin_api.get("/api/groups/nope/").status_code == 404
    assert admin_api.delete("/api/groups/pumps/").status_code == 204


def test_runs_start_validation_permission_and_not_found(admin_api, reader_api):
    import uuid

    from jobs.models import JobRun
    from tests.factories import template_with_steps

    template = template_with_steps((DeviceFactory(), "on", {}))
    bad = admin_api.post("/api/runs/", {"template": "no-such", "parameters": [1]}, format="json").json()
    assert set(bad) == {"template", "parameters"}, bad
    assert admin_api.post(
        "/api/runs/", {"template": template.name, "priority": 12}, format="json"
    ).json().keys() == {"priority"}
    assert admin_api.post(
        "/api/runs/", {"template": template.name, "for_each": {"site": "x"}}, format="json"
    ).json().keys() == {"for_each"}
    denied = reader_api.post("/api/runs/", {"template": template.name}, format="json")
    assert denied.status_code == 403 and not JobRun.objects.exists()

    started = admin_api.post(
        "/api/runs/", {"template": template.name, "parameters": {"site": "berlin"}}, format="json"
    )
    assert started.status_code == 201, started.content
    run_id = started.json()["id"]
    detail = reader_api.get(f"/api/runs/{run_id}/").json()
    assert (detail["template"], detail["parameters"], detail["events"][0]["kind"]) == (
        template.name,
        {"site": "berlin"},
        "run.created",
    )
    assert admin_api.get(f"/api/runs/{uuid.uuid4()}/").status_code == 404
    assert admin_api.get("/api/runs/not-a-uuid/").status_code == 404


def test_cancel_needs_permission_and_conflicts_once_ended(admin_api, reader_api):
    import uuid

    from jobs.models import JobRun, RunStatus
    from jobs.services import template_plan
    from tests.factories import template_with_steps

    template = template_with_steps((DeviceFactory(), "on", {}))
    run = JobRun.objects.create(template=template, plan=template_plan(template))
    assert reader_api.post(f"/api/runs/{run.pk}/cancel/").status_code == 403
    canceled = admin_api.post(f"/api/runs/{run.pk}/cancel/")
    assert canceled.status_code == 200 and canceled.json()["status"] == RunStatus.CANCELED
    again = admin_api.post(f"/api/runs/{run.pk}/cancel/")
    assert again.status_code == 409 and "already canceled" in again.json()["detail"]
    assert admin_api.post(f"/api/runs/{uuid.uuid4()}/cancel/").status_code == 404


def test_device_lock_of_a_missing_device_is_404_and_lists_are_paginated(admin_api):
    assert admin_api.get("/api/devices/nope/lock/").status_code == 404
    for _ in range(3):
        DeviceFactory()
    page = admin_api.get("/api/devices/?page_size=2").json()
    assert page["count"] == 3 and len(page["results"]) == 2 and "page=2" in page["next"]
    assert admin_api.get("/api/devices/?page=99").status_code == 404


def test_openapi_schema_validates_without_warnings(tmp_path):
    from django.core.management import call_command

    target = tmp_path / "schema.yaml"
    call_command("spectacular", "--validate", "--fail-on-warn", "--file", str(target))
    assert "/api/runs/{id}/retry/" in target.read_text()


def test_nul_characters_and_impossible_dates_are_a_400_not_a_database_error(admin_api):
    device = DeviceFactory()
    body = {
        "name": "nul",
        "steps": [{"position": 0, "device": device.name, "action": "a", "args": {"x": "a\x00"}}],
    }
    refused = admin_api.post("/api/templates/", body, format="json")
    assert refused.status_code == 400 and "steps[0].args.x" in refused.json()["detail"]
    assert admin_api.get("/api/templates/a%00b/").status_code == 400
    assert admin_api.get("/api/runs/?device=%00").status_code == 400
    assert admin_api.get("/api/runs/?since=2026-13-01T00:00:00Z").json() == {
        "since": ["use an ISO 8601 date-time, e.g. 2026-11-22T02:00:00Z"]
    }
    # an offset PostgreSQL would refuse (beyond ±15:59) is converted to UTC first
    assert admin_api.get("/api/runs/?since=0147-03-18T16:12:44-16:03").status_code == 200


def test_nul_characters_in_a_form_body_are_a_400(admin_api):
    response = admin_api.post("/api/runs/", {"template": "a\x00b"}, format="multipart")
    assert response.status_code == 400 and "template" in response.json()["detail"]
    form = admin_api.post("/api/runs/", "template=a%00b", content_type="application/x-www-form-urlencoded")
    assert form.status_code == 400


@pytest.mark.parametrize(
    "selector",
    [{"group": ""}, {"labels": {}}, {"group": "", "labels": {}}, {"group": None}, {"labels": []}, {}],
)
def test_for_each_with_an_empty_selector_is_400_not_a_run_on_every_device(admin_api, selector):
    from jobs.models import JobRun
    from tests.factories import template_with_steps

    # given enabled devices an empty selector would match
    template = template_with_steps((DeviceFactory(), "on", {}))
    DeviceFactory()

    response = admin_api.post("/api/runs/", {"template": template.name, "for_each": selector}, format="json")

    assert response.status_code == 400 and list(response.json()) == ["for_each"], response.json()
    assert not JobRun.objects.exists()


def test_the_service_refuses_an_empty_for_each_selector_too():
    from jobs.services import RunStartError, run_start_each
    from tests.factories import template_with_steps

    template = template_with_steps((DeviceFactory(), "on", {}))

    with pytest.raises(RunStartError) as refused:
        run_start_each(template=template, group="", labels={})

    assert refused.value.field == "for_each"
