"""The demo's admin/admin superuser exists only in development."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.test import override_settings


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
