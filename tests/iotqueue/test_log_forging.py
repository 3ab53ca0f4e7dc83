"""Text a device sends cannot forge a log line: the worker's text log escapes its newlines
(iotqueue/logfmt.py), here through the real bridge and worker."""

from __future__ import annotations

import logging
import logging.config
import uuid

import pytest
from django.conf import settings as django_settings

from jobs.events import event_record
from jobs.models import JobRun, RunStatus, StepRun, StepStatus
from jobs.services import run_start
from tests.conftest import wait_for
from tests.factories import DeviceFactory, template_with_steps

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

FORGED_PREFIX = "2026-01-01 00:00:00,000 ERROR jobs.timeline run.succeeded"


def test_a_newline_in_a_devices_error_stays_on_its_line_in_the_workers_log(stack, manual_device):
    # given a step in flight on a device, and the worker logging in text (the default)
    marker = f"forged-{uuid.uuid4().hex}"
    device = DeviceFactory()
    hand = manual_device(device.name)
    run, _ = run_start(template=template_with_steps((device, "on", {})))
    command = hand.next_command()
    since = stack.supervisor.log_size("worker")

    # when the device fails it with an error that tries to start a line of its own
    hand.done(command["id"], ok=False, error=f"boom\n{FORGED_PREFIX} {marker}\r\u2028", retryable=False)
    wait_for(lambda: JobRun.objects.get(pk=run.pk).status == RunStatus.FAILED, what="the run to fail")
    stack.supervisor.wait_for_log("worker", marker, since=since)

    # then its text is in the worker's log, escaped, and no line begins with what it forged
    logged = stack.supervisor.children["worker"].log_text()[since:]
    assert f"boom\\n{FORGED_PREFIX} {marker}\\r\\u2028" in logged
    assert not [line for line in logged.splitlines() if line.startswith(FORGED_PREFIX)]


def test_the_text_format_escapes_an_events_device_text(caplog):
    # given a dispatched step, and its device's progress detail with a newline in it
    device = DeviceFactory(name="lamp-9")
    run = JobRun.objects.create(
        template=template_with_steps((device, "on", {})), plan=[{"device": device.name, "action": "on"}]
    )
    step_run = StepRun.objects.create(
        run=run,
        index=0,
        device=device,
        action="on",
        status=StepStatus.DISPATCHED,
        attempt=1,
        command_id="7-1-a",
    )

    # when the event is recorded and formatted as IOTQUEUE_LOG_FORMAT=text does
    with caplog.at_level(logging.INFO, logger="jobs.timeline"):
        event_record("step.in_progress", step_run=step_run, message=f"progress 5%\n{FORGED_PREFIX} x")
    configurator = logging.config.DictConfigurator(django_settings.LOGGING)
    formatter = configurator.configure_formatter(dict(django_settings.LOGGING["formatters"]["text"]))
    (record,) = [r for r in caplog.records if r.name == "jobs.timeline"]
    line = formatter.format(record)

    # then it is one line, the newline written as \n
    assert "\n" not in line
    assert line.endswith(f"progress 5%\\n{FORGED_PREFIX} x")
    # and the record itself is unchanged for other handlers (JSON escapes on its own)
    assert "\n" in record.getMessage()
