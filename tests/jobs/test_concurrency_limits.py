"""Shared concurrency limits on the real stack (SCENARIOS §6: "at most 3 downloads at once
per store"): two fan-outs over the same 8 simulated devices in 2 sites, under a limit of 2
per site, never have more than 2 commands in flight per site, and both succeed; a command
held back says which limit holds it and what holds its slots."""

import time
import uuid

import pytest

from devtools.simulator import DeviceBehaviour
from jobs.limits import LIMITS_CACHE_SECONDS
from jobs.models import ConcurrencyLimit, JobRun, RunEvent, RunStatus, StepRun, StepStatus
from jobs.services import run_start
from jobs.waiting import steps_waiting
from tests.conftest import wait_for
from tests.factories import DeviceFactory, JobStepFactory

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

LIMIT = 2


def finished(run: JobRun) -> JobRun | None:
    run.refresh_from_db()
    return run if run.is_terminal else None


def most_at_once(spans: list[tuple[float, float]]) -> int:
    """The largest number of (start, end) spans open at one moment; an end at the same
    moment as a start comes first (the slot was handed on in that transition)."""
    points = sorted([(end, -1) for _, end in spans] + [(start, 1) for start, _ in spans])
    most = now = 0
    for _, step in points:
        now += step
        most = max(most, now)
    return most


def test_a_per_site_limit_holds_across_two_concurrent_rollouts(stack, simulator):
    tag = uuid.uuid4().hex[:6]
    action = f"firmware/download-{tag}"
    limit = ConcurrencyLimit.objects.create(
        name=f"site-downloads-{tag}", label="site", max_concurrent=LIMIT, applies_to="action", match=action
    )
    sites = {f"store-{tag}-{s}": [] for s in ("a", "b")}
    for i in range(8):
        site = list(sites)[i % 2]
        sites[site].append(DeviceFactory(name=f"lim-{tag}-{i}", labels={"kind": tag, "site": site}))
    # The worker reads the limits again within LIMITS_CACHE_SECONDS of a change (the
    # documented delay; it may have read them just before the limit was saved).
    time.sleep(LIMITS_CACHE_SECONDS)
    slow = DeviceBehaviour(latency_min_ms=400, latency_max_ms=600)
    simulator({device.name: slow for devices in sites.values() for device in devices})
    runs = []
    for _ in range(2):
        step = JobStepFactory(device=None, labels={"kind": tag}, action=action, queue_timeout_seconds=120)
        runs.append(run_start(template=step.template)[0])

    # While the limit holds commands back, a waiting one says why: the limit, its label
    # value and the devices holding its slots.
    def held_back():
        rows = StepRun.objects.select_related("run", "device").filter(run__in=runs, status=StepStatus.QUEUED)
        reasons = [w for w in steps_waiting(list(rows)).values() if w.reason == "limit_full"]
        return reasons[0] if reasons else None

    waiting = wait_for(held_back, what="a command waiting for the limit")
    assert f"limit '{limit.name}' ({LIMIT} per site)" in waiting.message
    assert f"has {LIMIT} of {LIMIT} in flight" in waiting.message
    assert f"lim-{tag}-" in waiting.message  # a device holding a slot is named

    for run in runs:
        assert wait_for(lambda run=run: finished(run)).status == RunStatus.SUCCEEDED

    rows = StepRun.objects.filter(run__in=runs).select_related("device")
    assert rows.count() == 16 and all(row.status == StepStatus.SUCCEEDED for row in rows)
    for site in sites:
        spans = [
            (row.dispatched_at.timestamp(), row.finished_at.timestamp())
            for row in rows
            if row.device.labels["site"] == site
        ]
        assert len(spans) == 8
        assert most_at_once(spans) <= LIMIT, site
        # A freed slot was handed on in the transition that ended its holder: the next
        # command was dispatched at that very moment (not by the monitor's later sweep).
        ends = {end for _, end in spans}
        handed = [start for start, _ in spans if start in ends]
        assert handed, site
    # The engine said so when it held a command back.
    events = RunEvent.objects.filter(run__in=runs, kind="step.waiting").values_list("message", flat=True)
    assert any(f"limit {limit.name}=" in message for message in events), list(events)
