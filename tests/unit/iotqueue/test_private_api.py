"""Code on a library's private API names the version it was written for (iotqueue/private_api.py)."""

from __future__ import annotations

import logging
from importlib import metadata

import pytest
from django.test import override_settings

from iotqueue import beat_lease, kombu_fix, openapi
from iotqueue.private_api import PrivateAPIError, private_api_check


class Written:
    """A stand-in for a library class: one private method, one attribute set in __init__."""

    def __init__(self) -> None:
        self._state = {}

    def _private(self) -> None:
        return None


def test_the_modules_on_private_api_were_written_for_the_installed_versions():
    # given the modules that touch private API, each declaring what it was written for
    declared = [
        kombu_fix.WRITTEN_FOR,
        openapi.WRITTEN_FOR,
        beat_lease.WRITTEN_FOR,
        beat_lease.CELERY_WRITTEN_FOR,
    ]

    # when the installed versions are read
    installed = [(package, metadata.version(package)) for package, _ in declared]

    # then they are the ones the code was written for (an upgrade re-reads the code first)
    assert installed == declared


def test_attributes_that_exist_pass_whether_defined_on_the_class_or_set_on_self():
    # given the installed version and names the class has, one only assigned in __init__
    written_for = ("django", metadata.version("django"))

    # when checked, then nothing is raised
    private_api_check(written_for, owner=Written, attributes=("_private", "_state"), where="here.py")


@override_settings(DEBUG=True)
def test_another_version_raises_in_development_naming_both_versions():
    # given code written for an older Django than the one installed
    installed = metadata.version("django")

    # when checked with DEBUG on (development, the tests)
    with pytest.raises(PrivateAPIError) as raised:
        private_api_check(("django", "0.9"), owner=Written, attributes=("_private",), where="iotqueue/x.py")

    # then the message names the package, both versions, the private name and what to re-read
    message = str(raised.value)
    assert f"django {installed} is installed" in message
    assert "written for 0.9" in message
    assert "_private" in message
    assert "re-read iotqueue/x.py" in message


@override_settings(DEBUG=False)
def test_another_version_in_production_logs_an_error_and_carries_on(caplog):
    # given code written for another version, DEBUG off
    with caplog.at_level(logging.ERROR, logger="iotqueue.private_api"):
        # when checked
        private_api_check(("django", "0.9"), owner=Written, attributes=("_private",), where="iotqueue/x.py")

    # then an error names the versions, and the import goes on
    assert "written for 0.9" in caplog.text


@override_settings(DEBUG=False)
def test_a_private_name_gone_raises_even_in_production():
    # given the installed version, but a private name the class no longer has
    written_for = ("django", metadata.version("django"))

    # when checked
    with pytest.raises(PrivateAPIError) as raised:
        private_api_check(written_for, owner=Written, attributes=("_private", "_gone"), where="iotqueue/x.py")

    # then it says which name is gone, from which class
    assert "Written no longer has _gone" in str(raised.value)
