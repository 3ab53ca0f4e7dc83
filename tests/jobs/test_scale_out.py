"""Two bridge replicas in one MQTT shared group: they split the replies, both keep presence,
and one SIGKILLed in the middle of a fan-out loses nothing.

The session stack's own bridge subscribes without a shared group, so it is stopped for each
test and two replicas with MQTT_SHARED_GROUP and their own client ids stand in for it; it is
started again afterwards. The group is this module's own: replicas of other tests keep their
persistent sessions on the broker, and a session left in a group goes on receiving its share.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from devices.locks import device_lock_states
from devices.models import Device
from devtools.processes import manage_argv
from devtools.simulator import DeviceBehaviour
from jobs.models import STEP_TERMINAL, JobRun, RunEvent, RunStatus, StepRun, StepStatus
from jobs.services import run_start
from tests.conftest import READY, wait_for
from tests.factories import DeviceFactory, JobStepFactory

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(240)]

REPLICAS = ("scale-bridge-a", "scale-bridge-b")
# A run of 40 devices at most 8 at a time takes a few seconds; the bound only catches a hang.
RUN_SECONDS = 120.0


@pytest.fixture
def replicas(stack) -> Iterator[tuple[str, str]]:
    """Two bridges in one shared group instead of the stack's bridge, for one test."""
    supervisor, namespace = stack.supervisor, stack.services.namespace
    supervisor.stop("bridge")
    try:
        for name in REPLICAS:
            env = {"MQTT_SHARED_GROUP": f"{namespace}-scale", "MQTT_BRIDGE_CLIENT_ID": f"{namespace}-{name}"}
            replica_start(stack, name, env=env)
        yield REPLICAS
    finally:
        for name in REPLICAS:
            supervisor.stop(name)
        replica_start(stack, "bridge")


def replica_start(stack, name: str, *, env: dict[str, str] | None = None) -> None:
    offset = stack.supervisor.log_size(name)
    stack.supervisor.start(name, manage_argv("bridge"), extra_env=env)
    stack.supervisor.wait_for_log(name, READY["bridge"], since=offset)


def replica_stop_stats(stack, name: str) -> dict[str, int]:
    """Stop a replica cleanly and return the counts of its stop line (`bridge: stopped ({...})`)."""
    offset = stack.supervisor.log_size(name)
    stack.supervisor.stop(name)
    line = re.search(r"bridge: stopped \((\{.*\})\)", stack.supervisor.children[name].log_text()[offset:])
    assert line, f"{name} logged no stop line:\n{stack.supervisor.children[name].log_tail()}"
    return {key: int(value) for key, value in re.findall(r"'([^']+)': (\d+)", line.group(1))}


def fleet(count: int, label: str, *, online: bool = True) -> list[Device]:
    return [
        DeviceFactory(name=f"{label}-{i:02d}", labels={"kind": label}, online=online) for i in range(count)
    ]


def fanout(label: str, *, max_in_flight: int) -> JobRun:
    step = JobStepFactory(
        device=None, labels={"kind": label}, action="firmware/check", max_in_flight=max_in_flight
    )
    run, _ = run_start(template=step.template)
    return run


def finished(run: JobRun) -> JobRun | None:
    run.refresh_from_db()
    return run if run.is_terminal else None


def online(name: str, value: bool) -> bool:
    return Device.objects.filter(name=name, online=value).exists()


def assert_nothing_lost(run: JobRun, devices: list[Device], sim) -> None:
    """Every device succeeded on its first attempt, received one command, and nothing is held."""
    assert wait_for(lambda: finished(run), timeout=RUN_SECONDS, what="the fan-out to end").status == (
        RunStatus.SUCCEEDED
    )
    rows = StepRun.objects.filter(run=run)
    assert rows.count() == len(devices)
    assert set(rows.values_list("status", "attempt")) == {(StepStatus.SUCCEEDED, 1)}
    for device in devices:
        commands = {command["id"] for command in sim.received(device.name)}
        assert len(commands) == 1, f"{device.name} was commanded {len(commands)} times"
    assert sim.overlaps == [] and sim.token_regressions == []
    assert not rows.exclude(status__in=STEP_TERMINAL).exists()
    done = RunEvent.objects.filter(run=run, kind="step.fanout_done").values_list("message", flat=True)
    assert list(done) == [f"{len(devices)} of {len(devices)} devices succeeded"]  # decided once
    names = [device.name for device in devices]
    wait_for(
        lambda: all(s.holder is None and not s.queue for s in device_lock_states(names).values()),
        what="every device lock released, no waiter left",
    )


def test_two_replicas_split_the_replies_and_both_keep_presence(stack, replicas, simulator):
    # given 30 devices the bridges have not seen online yet
    label = "split"
    devices = fleet(30, label, online=False)
    sim = simulator({d.name: DeviceBehaviour() for d in devices}, heartbeat_interval=0)

    # then their retained "online" statuses reach the rows (every replica subscribes to them itself)
    names = [d.name for d in devices]
    wait_for(lambda: Device.objects.filter(name__in=names, online=True).count() == 30, what="all 30 online")

    # when a fan-out runs on them, its replies go through the shared group
    run = fanout(label, max_in_flight=10)
    assert_nothing_lost(run, devices, sim)

    # then each replica handled a share of the replies: its stop line counts by handler
    first, second = replicas
    probe = devices[0].name
    stats = {first: replica_stop_stats(stack, first)}

    # and presence works through each replica on its own: the other one records the last will
    sim.kill(probe)  # the broker publishes its retained "offline" last will
    wait_for(lambda: online(probe, False), what=f"{second} alone to record the will")
    replica_start(stack, first)
    stats[second] = replica_stop_stats(stack, second)
    sim.restart(probe)
    wait_for(lambda: online(probe, True), what=f"{first} alone to record the device back")
    replica_start(stack, second)

    for name, counts in stats.items():
        assert counts.get("handled:reply_message_handle", 0) > 0, f"{name} handled no reply: {counts}"
        assert counts.get("handled:presence_message_handle", 0) > 0, f"{name} saw no status: {counts}"
    replies = sum(counts["handled:reply_message_handle"] for counts in stats.values())
    assert replies >= 3 * len(devices)  # ack, progress and done of each device, each to one replica


def test_a_replica_killed_in_the_middle_of_a_fanout_loses_nothing(stack, replicas, simulator):
    # given 40 devices answering in 50-150 ms, at most 8 at work at once
    label = "killed"
    devices = fleet(40, label)
    sim = simulator({d.name: DeviceBehaviour(latency_min_ms=50, latency_max_ms=150) for d in devices})
    run = fanout(label, max_in_flight=8)

    # when one replica is SIGKILLed once 10 devices succeeded, and started again at once
    # (what a supervisor's restart policy does)
    wait_for(
        lambda: StepRun.objects.filter(run=run, status=StepStatus.SUCCEEDED).count() >= 10,
        what="10 devices succeeded",
    )
    victim = replicas[1]
    offset = stack.supervisor.log_size(victim)
    stack.supervisor.kill(victim)
    stack.supervisor.start(victim, stack.supervisor.children[victim].argv)
    stack.supervisor.wait_for_log(victim, READY["bridge"], since=offset)

    # then the fan-out ends with every device succeeded, each commanded once, nothing held
    assert_nothing_lost(run, devices, sim)
