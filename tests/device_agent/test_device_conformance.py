"""The conformance kit (iotqueue_device.conformance) on the real stack and its REST API: the
agent library passes every case, reboot included; broken devices fail the right rows."""

from __future__ import annotations

import subprocess
import sys

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from iotqueue_device.conformance.__main__ import main as conformance_main
from rest_framework.authtoken.models import Token

from devices.credentials import device_password_issue, managed
from tests.device_agent.naive_device import NaiveDevice
from tests.factories import DeviceFactory

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

# The broken devices fail most cases by not answering: a short wait keeps the test quick.
BROKEN_WAIT_SECONDS = 3.0


class DeviceProcess:
    """The agent library's reference device (python -m iotqueue_device.example) as a process
    that can be power-cut (SIGKILL) and started again on the same state directory."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.process = subprocess.Popen(argv)

    def reboot(self) -> None:
        self.process.kill()
        self.process.wait(10)
        self.process = subprocess.Popen(self.argv)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


@pytest.fixture
def api_token() -> str:
    user = User.objects.create_superuser("kit", "kit@example.com", "pw")
    return Token.objects.create(user=user).key


def kit_argv(services, live_server, token: str, device: str, *, wait: float = 10.0) -> list[str]:
    return [
        "--mqtt-url",
        services.mqtt_url,
        "--device",
        device,
        "--api",
        live_server.url,
        "--token",
        token,
        "--prefix",
        settings.IOTQUEUE_TOPIC_PREFIX,
        "--wait",
        str(wait),
    ]


def rows(output: str) -> dict[str, str]:
    """The printed table as case name -> result."""
    found = {}
    for line in output.splitlines()[2:-1]:
        name, _, rest = line.partition("  ")
        found[name.strip()] = rest.split()[0] if rest.split() else ""
    return found


def test_the_agent_library_passes_every_case(stack, services, live_server, api_token, tmp_path, capsys):
    # given the reference device on the agent library, logged in as itself, with a state dir
    device = DeviceFactory()
    password = device_password_issue(device) if managed() else None
    argv = [sys.executable, "-m", "iotqueue_device.example", "--mqtt-url", services.mqtt_url]
    argv += [
        "--device",
        device.name,
        "--state-dir",
        str(tmp_path),
        "--prefix",
        settings.IOTQUEUE_TOPIC_PREFIX,
    ]
    argv += ["--password", password] if password else []
    dut = DeviceProcess(argv)
    try:
        # when the kit drives it, rebooting it (SIGKILL and start again) mid-command
        status = conformance_main(kit_argv(services, live_server, api_token, device.name), reboot=dut.reboot)
    finally:
        dut.stop()
    output = capsys.readouterr().out

    # then every case passed, the reboot included
    print(output)
    assert status == 0, output
    assert set(rows(output).values()) == {"pass"}, output
    assert len(rows(output)) == 10


@pytest.mark.parametrize(
    ("wrong_id", "failing", "passing"),
    [
        (
            True,
            {"command: ack, progress and done shapes", "rejected command", "no stale or foreign replies"},
            {"online: retained status"},
        ),
        (
            False,
            {
                "duplicate command: not run again",
                "late command, lower token: ignored",
                "late command, deadline passed: ignored",
                "cancel: stopped, both answered",
                "no stale or foreign replies",
            },
            {
                "command: ack, progress and done shapes",
                "rejected command",
                "one command at a time, none sent twice",
            },
        ),
    ],
    ids=["answers-with-the-wrong-id", "runs-duplicates-and-late-commands"],
)
def test_a_broken_device_fails_the_right_rows(
    stack, services, live_server, api_token, capsys, wrong_id, failing, passing
):
    # given a device that gets the protocol wrong
    device = DeviceFactory()
    password = device_password_issue(device) if managed() else None
    naive = NaiveDevice(
        device.name, services.mqtt_url, settings.IOTQUEUE_TOPIC_PREFIX, password=password, wrong_id=wrong_id
    )
    try:
        # when the kit drives it (no way to reboot it: that case is skipped)
        argv = kit_argv(services, live_server, api_token, device.name, wait=BROKEN_WAIT_SECONDS)
        status = conformance_main(argv)
    finally:
        naive.close()
    output = capsys.readouterr().out
    results = rows(output)

    # then the kit fails, on the rows that name the mistake
    print(output)
    assert status == 1, output
    assert {name for name in failing if results[name] == "FAIL"} == failing, output
    assert {name for name in passing if results[name] == "pass"} == passing, output
    assert results["reboot mid-command: jobs/get, same attempt"] == "skip"
