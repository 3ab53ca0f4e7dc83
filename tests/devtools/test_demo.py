"""The demo's admin/admin superuser exists only in development."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.test import override_settings

from devtools.demo import demo_outcome_line, demo_runs_line
from jobs.models import JobRun, JobTemplate, RunStatus


@pytest.fixture(autouse=True)
def _isolated_services():
    """Override conftest's autouse fixture: the refusal comes before any Redis or MQTT use."""


@pytest.mark.django_db
@override_settings(DEBUG=False)
def test_the_demo_is_refused_without_debug():
    # given a deployment (DEBUG off)
    # when the demo is asked to seed its data
    with pytest.raises(CommandError, match="DEBUG=true"):
        call_command("demo", seed_only=True)

    # then no superuser was created
    assert not get_user_model().objects.filter(username="admin").exists()


def test_the_start_and_end_lines_count_the_same_runs():
    # given the runs the demo follows: some started directly, one by a sensor, two by a chain
    morning, door, canvas = (JobTemplate(name=name) for name in ("Morning", "Door opened", "Celery canvas"))
    started = [JobRun(template=morning, status=RunStatus.SUCCEEDED) for _ in range(2)]
    followed = [
        *started,
        JobRun(template=door, status=RunStatus.SUCCEEDED),
        JobRun(template=canvas, status=RunStatus.SUCCEEDED),
        JobRun(template=canvas, status=RunStatus.FAILED),
    ]

    # when the demo says what it started and how the followed runs ended
    start, end = demo_runs_line(started), demo_outcome_line(followed)

    # then each line counts the runs it names, and the end line all of those followed
    assert start == "2 runs: 2 Morning"
    assert end == "5 demo runs finished: 1 failed, 4 succeeded"
