"""The ten-line device of iotqueue-device/README.md, run as written on the real stack: only
its placeholders (device, broker, password, state directory) and the two firmware functions
it calls (`battery_low`, `flash`) are filled in, and the test topic prefix is given."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings

from devices.credentials import device_password_issue, managed
from jobs.models import JobRun, RunStatus, StepRun, StepStatus
from jobs.services import run_start
from tests.conftest import wait_for
from tests.factories import DeviceFactory, template_with_steps

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

README = Path(__file__).resolve().parents[2] / "iotqueue-device" / "README.md"
# "A device in ten lines (of code)": the count the README claims, give or take a line.
MOST_CODE_LINES = 11
# The firmware's own functions, which the README's device calls: a file decides the battery.
FIRMWARE = """import os, signal
def battery_low():
    return os.path.exists({low!r})
def flash(url):
    pass
signal.signal(signal.SIGTERM, lambda *_: agent.stop())
"""


def readme_device() -> str:
    """The first Python block after the README's 'A device in ten lines' heading."""
    text = README.read_text()
    section = text[text.index("## A device in ten lines") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def filled_in(code: str, replacements: dict[str, str]) -> str:
    for placeholder, value in replacements.items():
        assert code.count(placeholder) == 1, f"the README's device no longer has {placeholder} once"
        code = code.replace(placeholder, value)
    return code


def run_of(device, **args) -> JobRun:
    run, _ = run_start(template=template_with_steps((device, "firmware/update", args)))
    return run


def test_the_readme_device_runs_as_written(stack, services, tmp_path):
    # given the README's device, about ten lines of code
    code = readme_device()
    lines = [line for line in code.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert len(lines) <= MOST_CODE_LINES, code

    # and run as a program for a device of ours, with its password where the broker checks one
    device = DeviceFactory()
    password = device_password_issue(device) if managed() else None
    low = tmp_path / "battery-low"
    program = FIRMWARE.format(low=str(low)) + filled_in(
        code,
        {
            '"lamp-2"': repr(device.name),
            '"mqtt://broker:1883"': repr(services.mqtt_url),
            '"<its password>"': repr(password),
            '"/var/lib/lamp-2"': f"{str(tmp_path / 'state')!r}, prefix={settings.IOTQUEUE_TOPIC_PREFIX!r}",
        },
    )
    path = tmp_path / "device.py"
    path.write_text(program)
    process = subprocess.Popen([sys.executable, str(path)])
    try:
        # when a firmware update runs on it, then it succeeds with the handler's result
        updated = run_of(device, url="http://firmware.example/2.1.bin", version="2.1")
        wait_for(lambda: JobRun.objects.get(pk=updated.pk).status == RunStatus.SUCCEEDED, what="the update")
        assert StepRun.objects.get(run=updated).result == {"version": "2.1"}

        # when the battery is low, then the next update is rejected, not retried
        low.touch()
        refused = run_of(device, url="http://firmware.example/2.2.bin", version="2.2")
        wait_for(lambda: JobRun.objects.get(pk=refused.pk).status == RunStatus.FAILED, what="the rejection")
        step = StepRun.objects.get(run=refused)
        assert step.status == StepStatus.REJECTED and step.attempt == 1

        # when it is stopped (SIGTERM, its handler calls agent.stop()), then it exits and is offline
        process.terminate()
        assert process.wait(15) == 0
        wait_for(lambda: not type(device).objects.get(pk=device.pk).online, what="the device offline")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
