"""A restarted bridge does not replay every device's retained status (iotqueue/retained.py):
its broker session holds the status subscription already, so the replies queued for it
while it was away are not held up behind a status per device."""

from __future__ import annotations

import ast
import re

import pytest

from devices.models import Device
from devtools.simulator import DeviceBehaviour
from jobs.models import JobRun, RunStatus
from jobs.services import run_start
from tests.conftest import wait_for
from tests.factories import DeviceFactory, template_with_steps

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

STOPPED = re.compile(r"bridge: stopped \((\{.*\})\)")


def test_a_restarted_bridge_leaves_the_retained_statuses_alone_and_hears_the_next_reply(stack, simulator):
    devices = [DeviceFactory(online=False) for _ in range(5)]
    simulator({d.name: DeviceBehaviour() for d in devices}, heartbeat_interval=0)
    names = [d.name for d in devices]
    wait_for(lambda: Device.objects.filter(name__in=names, online=True).count() == 5, what="all online")

    stack.restart("bridge")  # to the session the broker kept, which holds the status filter
    since = stack.supervisor.log_size("bridge")
    run, _ = run_start(template=template_with_steps((devices[0], "ping", {})))
    wait_for(lambda: JobRun.objects.get(pk=run.pk).status == RunStatus.SUCCEEDED, what="the run")
    # The broker delivers a session's messages in order: a replay would have come before
    # the reply that ended the run. The stop line counts what this bridge handled.
    stack.restart("bridge")

    stopped = STOPPED.search(stack.supervisor.children["bridge"].log_text()[since:])
    assert stopped, "the restarted bridge's stop line"
    handled = ast.literal_eval(stopped.group(1))
    assert handled.get("handled:reply_message_handle", 0) >= 1, handled
    assert handled.get("handled:presence_message_handle", 0) == 0, handled
