"""Text that cannot be stored (a lone surrogate, a NUL) is refused at every entrance with the
field named, before anything is written: REST JSON and form bodies, admin JSON fields, the
CLI's parameters. Before, `labels: {"a": "\\udfff"}` created the device (and its broker user)
and then answered 500, and every later device list was a 500 too."""

from __future__ import annotations

import pytest
from django.core.management import CommandError, call_command

from devices.models import Device
from jobs.models import JobRun
from tests.factories import DeviceFactory, template_with_steps

pytestmark = pytest.mark.django_db


def post_json(client, url: str, text: str):
    """POST JSON text as given: the escape `\\ud800` is valid JSON, yet no UTF-8 encoder
    (the test client's included) can encode the character it decodes to."""
    return client.post(url, data=text, content_type="application/json")


def test_a_device_label_with_a_lone_surrogate_is_a_400_and_no_device(admin_api):
    # when a device is created with a label that UTF-8 cannot encode
    response = post_json(admin_api, "/api/devices/", '{"name": "atk-1", "labels": {"a": "\\udfff"}}')
    # then it is refused, naming the field, and nothing was written
    assert response.status_code == 400, response.content[:300]
    assert "labels.a" in response.json()["detail"] and "surrogate" in response.json()["detail"]
    assert not Device.objects.filter(name="atk-1").exists()
    # and the list still renders for everyone
    assert admin_api.get("/api/devices/").status_code == 200


def test_run_parameters_with_a_lone_surrogate_are_a_400_and_no_run(admin_api):
    device = DeviceFactory()
    template = template_with_steps((device, "a", {}))
    response = post_json(
        admin_api, "/api/runs/", f'{{"template": "{template.name}", "parameters": {{"x": "\\ud800"}}}}'
    )
    assert response.status_code == 400, response.content[:300]
    assert "parameters.x" in response.json()["detail"]
    assert not JobRun.objects.exists()


def test_a_json_field_in_a_form_body_with_a_surrogate_escape_is_a_400_naming_the_field(admin_api):
    # a multipart body carries JSON fields as text that DRF decodes after the parser
    response = admin_api.post(
        "/api/devices/", {"name": "atk-2", "labels": '{"a": "\\ud800"}'}, format="multipart"
    )
    assert response.status_code == 400, response.content[:300]
    assert "labels" in response.json() and "surrogate" in str(response.json()["labels"])
    assert not Device.objects.filter(name="atk-2").exists()


def test_the_admin_refuses_a_surrogate_escape_in_a_json_field(client, django_user_model):
    client.force_login(django_user_model.objects.create_superuser("boss", "b@example.com", "pw"))
    device = DeviceFactory()
    response = client.post(
        f"/admin/devices/device/{device.pk}/change/",
        {
            "name": device.name,
            "labels": '{"a": "\\udfff"}',
            "config": "{}",
            "min_interval_seconds": 0,
            "max_per_minute": 0,
        },
    )
    assert response.status_code == 200 and "surrogate" in response.text
    device.refresh_from_db()
    assert device.labels == {}


def test_the_cli_refuses_a_parameter_with_an_undecodable_byte(capsys):
    # a shell argument with invalid UTF-8 reaches Python as a lone surrogate (surrogateescape)
    device = DeviceFactory()
    template = template_with_steps((device, "a", {}))
    with pytest.raises(CommandError, match=r"parameters.*surrogate"):
        call_command("run_start", template.name, "--param", "zone=B\udcff")
    assert not JobRun.objects.exists()
