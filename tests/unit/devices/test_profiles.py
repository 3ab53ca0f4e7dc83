"""Device protocols' message builders (devices/profiles.py): declared where each protocol is
defined, and checked when the app loads."""

import pytest
from django.core.exceptions import ImproperlyConfigured

from devices import profiles
from devices.profiles import DeviceProtocol, profiles_check


def test_every_protocol_has_its_messages_once_the_app_loaded():
    profiles_check()  # the app loaded jobs/apps.py PROFILE_MODULES
    assert DeviceProtocol.AWS_IOT_JOBS in profiles.command_builders


def test_a_protocol_without_its_cancel_message_stops_the_app_naming_it(monkeypatch):
    builders = {k: v for k, v in profiles.cancel_builders.items() if k != DeviceProtocol.AWS_IOT_JOBS}
    monkeypatch.setattr(profiles, "cancel_builders", builders)

    with pytest.raises(ImproperlyConfigured, match="cancel_builder 'aws-iot-jobs'"):
        profiles_check()
