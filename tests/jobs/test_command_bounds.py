"""A command is bounded: {{ references }} cannot expand a run's parameters into a command of
megabytes. Before, an 8 KB step of 500 x {{ params.big }} with a 60 KB parameter rendered
30 MB into the command, its StepRun row and the run's API answer."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from jobs.models import JobRun, RunStatus, StepRun
from tests.conftest import wait_for
from tests.factories import DeviceFactory, template_with_steps

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(60)]


@pytest.fixture
def api() -> APIClient:
    client = APIClient()
    client.force_authenticate(User.objects.create_superuser("operator", "op@example.com", "pw"))
    return client


def test_a_run_whose_command_would_be_too_large_fails_at_once_saying_why(stack, api, settings):
    # given a step whose args repeat a parameter 500 times, and a 60 KB parameter
    device = DeviceFactory()
    template = template_with_steps((device, "flash", {"blob": " ".join(["{{ params.big }}"] * 500)}))
    big = "x" * 60_000

    # when a run starts
    response = api.post("/api/runs/", {"template": template.name, "parameters": {"big": big}}, format="json")
    assert response.status_code == 201, response.content[:300]

    # then it fails at once, naming the limit, and no row holds the expansion
    run = wait_for(
        lambda: JobRun.objects.filter(pk=response.json()["id"], status=RunStatus.FAILED).first(),
        what="the run to fail",
    )
    assert "IOTQUEUE_COMMAND_MAX_BYTES" in run.error
    assert not StepRun.objects.filter(run=run).exclude(args=None).exclude(args={}).exists()
    detail = api.get(f"/api/runs/{run.pk}/")
    assert detail.status_code == 200 and len(detail.content) < 2 * settings.IOTQUEUE_COMMAND_MAX_BYTES


def test_a_template_whose_args_alone_exceed_the_limit_is_refused_on_save(api, settings):
    device = DeviceFactory()
    settings.IOTQUEUE_COMMAND_MAX_BYTES = 1000
    body = {
        "name": "too-big",
        "steps": [{"position": 0, "device": device.name, "action": "a", "args": {"x": "y" * 2000}}],
    }
    response = api.post("/api/templates/", body, format="json")
    assert response.status_code == 400, response.content[:300]
    assert "IOTQUEUE_COMMAND_MAX_BYTES" in str(response.json())
