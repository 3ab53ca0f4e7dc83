"""The device agent library logged in with a client certificate, on the real stack's mTLS
listener: the certificate iotqueue issued is the device's identity, and its commands run."""

import pytest
from django.conf import settings
from iotqueue_device import Agent

from devices.credentials import device_certificate_issue, managed
from jobs.models import JobRun, RunStatus, StepRun
from jobs.services import run_start
from tests.conftest import wait_for
from tests.devices.certificate_client import files_for
from tests.factories import DeviceFactory, template_with_steps

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


def test_an_agent_with_a_certificate_runs_its_commands(stack, services, tmp_path):
    if services.broker is None or not services.broker.tls_url or not managed():
        pytest.skip("no mTLS listener on this broker (MQTT_URL given, or no dynamic security)")
    # given a device with a certificate iotqueue issued (and no password), and its agent
    device = DeviceFactory()
    issued = device_certificate_issue(device)
    files = files_for(
        tmp_path,
        certificate_pem=issued.certificate_pem,
        key_pem=issued.private_key_pem,
        ca_pem=issued.broker_ca_certificate_pem,
    )
    agent = Agent(
        device.name,
        services.broker.tls_url,
        certfile=str(files.certificate),
        keyfile=str(files.key),
        cafile=str(files.ca),
        state_dir=str(tmp_path / "state"),
        prefix=settings.IOTQUEUE_TOPIC_PREFIX,
    )
    seen = []

    @agent.action("light/on")
    def light_on(ctx):
        ctx.progress(50, "warming up")
        seen.append((ctx.id, ctx.args))
        return {"lumens": ctx.args["lumens"]}

    agent.start()
    try:
        assert agent.ready.wait(15), "the agent did not get its subscriptions on the mTLS listener"

        # when a run sends it a command
        run, _ = run_start(template=template_with_steps((device, "light/on", {"lumens": 800})))

        # then the agent ran it once and the run succeeded with its result
        ended = [RunStatus.SUCCEEDED, RunStatus.FAILED]
        done = wait_for(
            lambda: JobRun.objects.filter(pk=run.pk, status__in=ended).first(), what="the run to end"
        )
        assert done.status == RunStatus.SUCCEEDED
        assert [args for _, args in seen] == [{"lumens": 800}]
        assert StepRun.objects.get(run=run).result == {"lumens": 800}
    finally:
        agent.stop()
