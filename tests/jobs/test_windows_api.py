"""Time windows at the edges: maintenance windows' REST CRUD and admin, a device's quiet
hours in its REST and admin page, a run's start-not-before and end-by refused with the
field named, the preview listing the windows that apply."""

from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from devices.models import DeviceGroup
from jobs.models import EndBehaviour, JobRun, MaintenanceWindow
from jobs.services import RunStartError, run_start
from tests.factories import DeviceFactory, template_with_steps

pytestmark = [pytest.mark.django_db, pytest.mark.timeout(60)]


@pytest.fixture
def boss(client) -> User:
    user = User.objects.create_superuser("boss", "boss@example.com", "pw")
    client.force_login(user)
    return user


def test_windows_are_created_read_changed_and_deleted_over_rest(admin_api):
    # given a device group
    DeviceGroup.objects.create(name="stores")

    # when a window for it is created, read, changed and deleted
    body = {"name": "nightly", "cron": "0 2 * * *", "duration_minutes": 180, "timezone": "Europe/Berlin"}
    created = admin_api.post("/api/windows/", {**body, "group": "stores"}, format="json")
    assert created.status_code == 201, created.json()
    assert created.json()["applies_to"] == "group stores"
    assert created.json()["next_opening"] is not None
    listed = admin_api.get("/api/windows/").json()
    assert [w["name"] for w in listed["results"]] == ["nightly"]
    changed = admin_api.patch("/api/windows/nightly/", {"duration_minutes": 60}, format="json")
    assert changed.status_code == 200 and changed.json()["duration_minutes"] == 60

    # then it is gone once deleted
    assert admin_api.delete("/api/windows/nightly/").status_code == 204
    assert not MaintenanceWindow.objects.exists()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"cron": "0 2 * *"}, "cron"),
        ({"cron": "61 2 * * *"}, "cron"),
        ({"cron": "0 0 31 2 *"}, "cron"),
        ({"timezone": "Mars/Olympus"}, "timezone"),
        ({"duration_minutes": 0}, "duration_minutes"),
        ({"duration_minutes": 7 * 24 * 60 + 1}, "duration_minutes"),
        ({"label_key": ""}, "label_key"),
        ({"label_key": "", "label_value": ""}, "template"),
        ({"label_value": ""}, "label_value"),
        ({"group": "stores"}, "group"),
    ],
)
def test_a_bad_window_is_refused_with_the_field_named(admin_api, change, field):
    DeviceGroup.objects.create(name="stores")
    body = {"name": "w", "cron": "0 2 * * *", "duration_minutes": 60, "timezone": "UTC"}
    body.update({"label_key": "site", "label_value": "berlin"})
    answer = admin_api.post("/api/windows/", {**body, **change}, format="json")
    assert answer.status_code == 400
    assert field in answer.json(), answer.json()


def test_a_devices_quiet_hours_are_set_over_rest_and_both_times_are_needed(admin_api):
    device = DeviceFactory()
    quiet = {"timezone": "Asia/Tokyo", "quiet_hours_start": "08:00", "quiet_hours_end": "21:00"}
    answer = admin_api.patch(f"/api/devices/{device.name}/", quiet, format="json")
    assert answer.status_code == 200, answer.json()
    assert answer.json()["quiet_hours_end"] == "21:00:00"

    refused = admin_api.patch(f"/api/devices/{device.name}/", {"quiet_hours_end": None}, format="json")
    assert refused.status_code == 400 and "quiet_hours_end" in refused.json()
    refused = admin_api.patch(f"/api/devices/{device.name}/", {"timezone": "Nowhere/Land"}, format="json")
    assert refused.status_code == 400 and "timezone" in refused.json()


def test_a_run_start_takes_its_time_window_and_refuses_a_bad_one(admin_api):
    # given a template of one command
    template = template_with_steps((DeviceFactory(), "check", {}))
    later = timezone.now() + timedelta(hours=1)

    # when a run is started over REST with a start-not-before and an end-by
    body = {
        "template": template.name,
        "not_before": later.isoformat(),
        "end_by": (later + timedelta(hours=1)).isoformat(),
        "end_behaviour": "finish",
    }
    answer = admin_api.post("/api/runs/", body, format="json")

    # then the run keeps them and stays pending
    assert answer.status_code == 201, answer.json()
    run = JobRun.objects.get(pk=answer.json()["id"])
    assert (run.status, run.end_behaviour) == ("pending", EndBehaviour.FINISH)
    assert answer.json()["not_before"] is not None
    assert answer.json()["waiting"]["reason"] == "run_not_before"
    assert answer.json()["waiting"]["until"] is not None
    # and a window that ends before it starts, or in the past, is refused naming end_by
    past = {"template": template.name, "end_by": (timezone.now() - timedelta(minutes=1)).isoformat()}
    assert "end_by" in admin_api.post("/api/runs/", past, format="json").json()
    backwards = {**body, "end_by": (later - timedelta(minutes=1)).isoformat()}
    assert "end_by" in admin_api.post("/api/runs/", backwards, format="json").json()
    bad = {**body, "end_behaviour": "explode"}
    assert "end_behaviour" in admin_api.post("/api/runs/", bad, format="json").json()
    with pytest.raises(RunStartError) as refused:
        run_start(template=template, end_by=timezone.now() - timedelta(seconds=1))
    assert refused.value.field == "end_by"


def test_a_run_keeps_the_windows_of_its_template_group_and_labels(admin_api):
    # given windows for the template, a group and a label
    device = DeviceFactory(labels={"site": "berlin"})
    template = template_with_steps((device, "check", {}))
    group = DeviceGroup.objects.create(name="stores")
    device.groups.add(group)
    window = {"cron": "0 2 * * *", "duration_minutes": 60, "timezone": "Europe/Berlin"}
    MaintenanceWindow.objects.create(name="for-template", template=template, **window)
    MaintenanceWindow.objects.create(name="for-group", group=group, **window)
    MaintenanceWindow.objects.create(name="for-label", label_key="site", label_value="berlin", **window)
    MaintenanceWindow.objects.create(name="other-site", label_key="site", label_value="paris", **window)

    # when a run is started
    run, _ = run_start(template=template)

    # then it keeps them (which devices a group or label window holds is decided per command)
    names = sorted(w["name"] for w in run.windows)
    assert names == ["for-group", "for-label", "for-template", "other-site"]
    # and the preview lists the ones that hold its device, with their next opening
    preview = admin_api.post("/api/runs/preview/", {"template": template.name}, format="json").json()
    listed = {w["name"]: w for w in preview["windows"]}
    assert sorted(listed) == ["for-group", "for-label", "for-template"]
    assert listed["for-group"]["applies_to"] == "group stores"
    assert listed["for-label"]["devices"] == 1
    assert listed["for-template"]["open_now"] or listed["for-template"]["next_opening"]


def test_the_admin_lists_windows_and_shows_quiet_hours_on_the_device_page(client, boss):
    # given a window and a device with quiet hours
    MaintenanceWindow.objects.create(
        name="nightly",
        cron="0 2 * * *",
        duration_minutes=60,
        timezone="UTC",
        label_key="site",
        label_value="b",
    )
    device = DeviceFactory(timezone="Asia/Tokyo")

    # then the windows' list shows what each applies to and when it opens
    page = client.get("/admin/jobs/maintenancewindow/").content.decode()
    assert "nightly" in page and "label site=b" in page and ("opens at" in page or "open until" in page)
    assert client.get("/admin/jobs/maintenancewindow/add/").status_code == 200
    window = MaintenanceWindow.objects.get()
    assert client.get(f"/admin/jobs/maintenancewindow/{window.pk}/change/").status_code == 200
    # and the device page has its quiet hours
    device_page = client.get(f"/admin/devices/device/{device.pk}/change/").content.decode()
    assert "Quiet hours" in device_page and 'name="quiet_hours_start"' in device_page
    # and Run now offers the run's own time window
    template = template_with_steps((device, "check", {}))
    run_now = client.get(f"/admin/jobs/jobtemplate/{template.pk}/run/").content.decode()
    assert 'name="not_before"' in run_now and 'name="end_behaviour"' in run_now


def test_the_admin_refuses_a_window_without_exactly_one_target(client, boss):
    form = {"name": "w", "cron": "0 2 * * *", "duration_minutes": "60", "timezone": "UTC"}
    answer = client.post("/admin/jobs/maintenancewindow/add/", form)
    assert answer.status_code == 200
    assert "Name exactly one of a template" in answer.content.decode()
    assert not MaintenanceWindow.objects.exists()


def test_the_openapi_schema_describes_the_time_windows():
    from drf_spectacular.generators import SchemaGenerator

    schema = SchemaGenerator().get_schema(request=None, public=True)
    components = schema["components"]["schemas"]
    assert {"get", "post"} <= set(schema["paths"]["/api/windows/"])
    assert {"get", "put", "patch", "delete"} <= set(schema["paths"]["/api/windows/{name}/"])
    for field in ("not_before", "end_by", "end_behaviour"):
        assert components["RunStartRequest"]["properties"][field]["description"], field
        assert field in components["Run"]["properties"]
    window = components["MaintenanceWindowRequest"]["properties"]
    assert {"cron", "duration_minutes", "timezone", "template", "group", "label_key", "label_value"} <= set(
        window
    )
    assert window["cron"]["description"] and window["template"]["description"]
    assert components["Device"]["properties"]["quiet_hours_start"]["description"]
    assert components["JobStep"]["properties"]["urgent"]["description"]
    assert components["RunPreview"]["properties"]["windows"]["description"]


def test_the_cli_starts_a_run_with_its_time_window(capsys):
    from django.core.management import CommandError, call_command

    template = template_with_steps((DeviceFactory(), "check", {}))
    call_command(
        "run_start",
        template.name,
        "--not-before",
        "2099-01-01T02:00+01:00",
        "--end-by",
        "2099-01-02T06:00+01:00",
        "--end-behaviour",
        "finish",
    )
    run = JobRun.objects.get(pk=capsys.readouterr().out.strip())
    assert run.not_before.isoformat() == "2099-01-01T01:00:00+00:00"
    assert (run.status, run.end_behaviour) == ("pending", "finish")
    with pytest.raises(CommandError, match="not an ISO 8601 time"):
        call_command("run_start", template.name, "--end-by", "tomorrow")
    with pytest.raises(CommandError, match="end_by"):
        call_command("run_start", template.name, "--end-by", "2001-01-01T00:00+00:00")
