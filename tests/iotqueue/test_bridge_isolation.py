"""No stored topic can deafen the bridge or take a device's replies (issue 31, findings 3, 4).

Rows are written with `update()` / `create()`, past the save-time validation, as rows stored
before it existed (or by a broker with other rules) would be: the bridge itself must refuse
them. Step timeouts are far beyond the test's waits, so only a handled reply can end a step.
"""

from __future__ import annotations

import json
import time

import pytest

from devices.models import Device
from devtools.simulator import DeviceBehaviour
from jobs.models import JobRun, RunStatus, StepRun, Trigger
from jobs.services import run_start
from tests.conftest import wait_for
from tests.factories import DeviceFactory, template_with_steps
from tests.mqtt_device import mqtt_client
from triggers.models import TriggerRule

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

STEP_TIMEOUT_SECONDS = 300
# A message published before the bridge subscribed to a new rule is lost: published again
# this often until its run appears.
REPUBLISH_SECONDS = 0.5


def one_step_run(device) -> JobRun:
    template = template_with_steps((device, "open", {}))
    template.steps.update(timeout_seconds=STEP_TIMEOUT_SECONDS)
    return run_start(template=template)[0]


def succeeded_on_first_attempt(run: JobRun) -> None:
    step = wait_for(
        lambda: StepRun.objects.filter(run=run).exclude(status__in=("pending", "queued", "dispatched",
                                                                    "in_progress")).first(),
        what="the step to end",
    )  # fmt: skip
    assert (step.status, step.attempt) == ("succeeded", 1)
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED


def test_a_stored_reply_topic_with_a_control_character_cannot_deafen_the_bridge(stack, simulator):
    # given a healthy device, and another whose legacy reply topic holds U+0001
    device, broken = DeviceFactory(), DeviceFactory()
    simulator({device.name: DeviceBehaviour()})
    offset = stack.supervisor.log_size("bridge")
    Device.objects.filter(pk=broken.pk).update(reply_topic="legacy/\x01/ack")

    # when the bridge has read it (it says what it did with its dynamic topics)
    stack.supervisor.wait_for_log("bridge", r"not subscribing to|dynamic topics \+", since=offset)

    # then it still serves every device, refused that one filter, and was never dropped by
    # the broker (which drops a client over a malformed SUBSCRIBE at once, before this run)
    succeeded_on_first_attempt(one_step_run(device))
    log = stack.supervisor.children["bridge"].log_text()[offset:]
    assert "not subscribing to 'legacy/\\x01/ack'" in log
    assert "bridge: disconnected" not in log


def test_a_rule_stored_on_a_device_reply_topic_never_takes_its_replies(stack, simulator, services):
    # given a victim device, a rule stored on its done topic, and a sensor rule beside it
    victim, camera = DeviceFactory(), DeviceFactory()
    simulator({victim.name: DeviceBehaviour()})
    template = template_with_steps((camera, "snapshot", {}))
    hijack = TriggerRule.objects.create(
        name="hijack", topic_filter=f"{services.namespace}/{victim.name}/done", template=template
    )
    site = f"{services.namespace}-site"
    TriggerRule.objects.create(name="sentinel", topic_filter=f"{site}/+/opened", template=template)

    # when the bridge has read both rules (the sensor rule fires)
    sensor = mqtt_client(services.mqtt_url)
    try:
        deadline = time.monotonic() + 30
        while not JobRun.objects.filter(
            trigger=Trigger.MQTT, triggered_by__startswith="mqtt sentinel "
        ).exists():
            assert time.monotonic() < deadline, "the sensor rule never fired"
            sensor.publish(f"{site}/7/opened", json.dumps({"door": 7}), qos=1).wait_for_publish(5)
            time.sleep(REPUBLISH_SECONDS)
    finally:
        sensor.loop_stop()
        sensor.disconnect()

    # then the victim's replies still end its steps, and the rule on them started nothing
    succeeded_on_first_attempt(one_step_run(victim))
    assert not JobRun.objects.filter(triggered_by__startswith=f"mqtt {hijack.name} ").exists()
