"""A device that sends text the database cannot store (a lone surrogate in its reply) cannot
stall anyone else: before, each such message made the worker raise and the monitor drop the
whole batch, other devices' replies and run starts with it, and a stored one made the run
API answer 500 for everyone."""

from __future__ import annotations

import pytest

from devtools.simulator import DeviceBehaviour
from jobs.models import JobRun, RunEvent, RunStatus
from jobs.services import run_start
from tests.conftest import wait_for
from tests.factories import DeviceFactory, template_with_steps
from tests.mqtt_device import mqtt_client

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(90)]

# The body as a device's firmware would publish it: a JSON escape of half a UTF-16 pair.
POISON = b'{"id": "poison-\\ud800", "ok": true, "result": {"note": "\\udfff"}}'


def test_a_device_sending_lone_surrogates_holds_up_no_other_device(stack, simulator, admin_api, services):
    # given a victim device with runs to do, and an attacker device publishing poison
    victim, attacker = DeviceFactory(), DeviceFactory()
    simulator({victim.name: DeviceBehaviour()})
    template = template_with_steps((victim, "a", {}), (victim, "b", {}), (victim, "c", {}))
    client = mqtt_client(services.mqtt_url)
    try:
        topic = f"{services.namespace}/{attacker.name}/done"
        for _ in range(20):
            client.publish(topic, POISON, qos=1).wait_for_publish(5)
        # when the victim's runs go while the poison keeps coming
        runs = [run_start(template=template)[0] for _ in range(5)]
        for _ in range(20):
            client.publish(topic, POISON, qos=1).wait_for_publish(5)
        wait_for(
            lambda: (
                JobRun.objects.filter(pk__in=[r.pk for r in runs], status=RunStatus.SUCCEEDED).count() == 5
            ),
            what="the victim's runs to succeed",
        )
    finally:
        client.loop_stop()
        client.disconnect()

    # then the poison was dropped at the bridge and recorded on its device, saying why
    dropped = wait_for(
        lambda: RunEvent.objects.filter(kind="message.dropped", device=attacker.name).first(),
        what="the poison's drop recorded",
    )
    assert "surrogate" in dropped.message
    # and nothing unreadable was stored: the run API answers for everyone
    assert admin_api.get("/api/runs/").status_code == 200
    assert admin_api.get(f"/api/runs/{runs[0].pk}/").status_code == 200
