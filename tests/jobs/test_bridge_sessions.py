"""No reply is lost while no bridge is connected: persistent sessions and late acknowledgement.

The device publishes its done while the bridge is dead; the broker keeps it for the
bridge's session and delivers it when the bridge comes back, so the step succeeds on its
first attempt and the device performs its action once. Step timeouts are long here, so a
timeout and retry cannot be what rescues the step.
"""

from __future__ import annotations

import pytest

from devtools.processes import manage_argv
from jobs.models import RunStatus, StepRun, StepStatus
from jobs.services import run_start
from tests.conftest import READY, wait_for
from tests.factories import DeviceFactory, template_with_steps

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

# Far beyond the test's own waits: a step rescued by a retry would fail the test.
STEP_TIMEOUT_SECONDS = 300


def one_step_run(device):
    template = template_with_steps((device, "open", {}))
    template.steps.update(timeout_seconds=STEP_TIMEOUT_SECONDS)
    run, _ = run_start(template=template)
    return run


def assert_succeeded_on_first_attempt(run, manual) -> None:
    step = wait_for(
        lambda: StepRun.objects.filter(run=run, status=StepStatus.SUCCEEDED).first(),
        what="the step to succeed from the done the bridge missed",
    )
    assert step.attempt == 1
    assert step.result == {"opened": True}
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED
    assert manual.commands.empty(), "the device got a second command"


def test_done_published_while_the_bridge_is_dead_is_delivered_when_it_returns(stack, manual_device):
    device = DeviceFactory()
    manual = manual_device(device.name)
    run = one_step_run(device)
    command = manual.next_command()

    # when the bridge is SIGKILLed and the device answers before it is back
    offset = stack.supervisor.log_size("bridge")
    stack.supervisor.kill("bridge")
    manual.done(command["id"], result={"opened": True})
    stack.supervisor.start("bridge", stack.supervisor.children["bridge"].argv)
    stack.supervisor.wait_for_log("bridge", READY["bridge"], since=offset)

    # then the broker delivers the done to the bridge's session
    assert_succeeded_on_first_attempt(run, manual)


def test_two_replicas_in_a_shared_group_one_killed(stack, manual_device):
    replicas = ("bridge-a", "bridge-b")
    stack.supervisor.stop("bridge")
    try:
        for name in replicas:
            env = {
                "MQTT_SHARED_GROUP": f"{stack.services.namespace}-g",
                "MQTT_BRIDGE_CLIENT_ID": f"{name}-{stack.services.namespace}",
            }
            stack.supervisor.start(name, manage_argv("bridge"), extra_env=env)
        for name in replicas:
            stack.supervisor.wait_for_log(name, READY["bridge"])
        device = DeviceFactory()
        manual = manual_device(device.name)
        run = one_step_run(device)
        command = manual.next_command()

        # when one replica is SIGKILLed and the device answers before it is back
        offset = stack.supervisor.log_size("bridge-a")
        stack.supervisor.kill("bridge-a")
        manual.done(command["id"], result={"opened": True})
        stack.supervisor.start("bridge-a", stack.supervisor.children["bridge-a"].argv)
        stack.supervisor.wait_for_log("bridge-a", READY["bridge"], since=offset)

        # then the other replica, or the killed one's session, hands the done on
        assert_succeeded_on_first_attempt(run, manual)
    finally:
        for name in replicas:
            if name in stack.supervisor.children:
                stack.supervisor.stop(name)
        offset = stack.supervisor.log_size("bridge")
        stack.supervisor.start("bridge", stack.supervisor.children["bridge"].argv)
        stack.supervisor.wait_for_log("bridge", READY["bridge"], since=offset)
