"""Crashes and restarts under load: a SIGKILLed worker, a killed bridge, Redis and the MQTT
broker restarting. Every run must still end, and no device may ever run two commands at once.
"""

import time

import pytest

from devtools.simulator import DeviceBehaviour
from jobs.models import JobRun, RunStatus
from jobs.services import run_start
from tests.conftest import wait_for
from tests.factories import DeviceFactory, template_with_steps

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(480)]

# Long enough for every retry the faults below cause; they are rescued by timeouts.
RUN_END_SECONDS = 120.0


@pytest.fixture
def workload(stack, simulator):
    """Three devices, runs of three steps crossing them, generous retry budgets."""
    devices = [DeviceFactory() for _ in range(3)]
    sim = simulator({d.name: DeviceBehaviour(latency_min_ms=50, latency_max_ms=150) for d in devices})
    template = template_with_steps(*[(d, "step", {}) for d in devices])
    template.steps.update(timeout_seconds=2, max_attempts=6, backoff_seconds=0.2, queue_timeout_seconds=120)

    def start(count: int) -> list[JobRun]:
        return [run_start(template=template)[0] for _ in range(count)]

    return sim, start


def all_ended(runs: list[JobRun]) -> bool:
    return JobRun.objects.filter(pk__in=[r.pk for r in runs]).exclude(status__in=_terminal()).count() == 0


def _terminal():
    from jobs.models import RUN_TERMINAL

    return RUN_TERMINAL


def assert_runs_ended_without_overlap(sim, runs, stack):
    logs = stack.supervisor.log_dir
    wait_for(lambda: all_ended(runs), timeout=RUN_END_SECONDS, what=f"every run to end (logs in {logs})")
    statuses = set(JobRun.objects.filter(pk__in=[r.pk for r in runs]).values_list("status", flat=True))
    assert statuses == {RunStatus.SUCCEEDED}, statuses
    totals = sim.stats()["totals"]
    assert totals["overlaps"] == 0, sim.stats()["overlaps"]
    assert totals["token_regressions"] == 0, sim.stats()["token_regressions"]


def wait_busy(sim, count: int) -> None:
    # Generous: after a fault the runs recover by timeouts and retries before more commands go.
    wait_for(
        lambda: sim.stats()["totals"]["commands"] >= count,
        timeout=RUN_END_SECONDS,
        what=f"{count} commands delivered",
    )


# Each fault strikes this many times in a row during one workload, each time once the
# devices got four more commands: a recovery must survive the next fault as well.
FAULT_ROUNDS = 3


def faults_strike(sim, fault, rounds: int = FAULT_ROUNDS) -> None:
    for round_ in range(1, rounds + 1):
        wait_busy(sim, 4 * round_)
        fault()


def test_worker_sigkilled_mid_run(stack, workload):
    sim, start = workload
    runs = start(12)
    faults_strike(sim, lambda: stack.restart("worker", kill=True))
    assert_runs_ended_without_overlap(sim, runs, stack)


def test_bridge_killed_and_restarted(stack, workload):
    sim, start = workload
    runs = start(12)

    def bridge_killed() -> None:
        stack.supervisor.kill("bridge")
        time.sleep(1.0)  # replies published now are lost; timeouts and retries must recover them
        stack.restart("bridge")

    faults_strike(sim, bridge_killed)
    assert_runs_ended_without_overlap(sim, runs, stack)


def test_redis_restarted_loses_locks_and_queue(stack, workload):
    if stack.services.redis is None:
        pytest.skip("Redis is external (REDIS_URL): not ours to restart")
    sim, start = workload
    runs = start(12)
    faults_strike(sim, stack.services.redis.restart)
    assert_runs_ended_without_overlap(sim, runs, stack)


def test_mqtt_broker_restarted(stack, workload):
    if stack.services.broker is None:
        pytest.skip("the MQTT broker is external (MQTT_URL): not ours to restart")
    sim, start = workload
    runs = start(12)
    faults_strike(sim, stack.services.broker.restart)
    assert_runs_ended_without_overlap(sim, runs, stack)
