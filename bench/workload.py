"""The engine workload: a fleet of devices, one template per run, runs driven to the end.

Every run gets its own template of S steps. A fraction of the steps goes to a small pool of
shared devices, so runs meet on a busy device and wait in its lock queue; the rest are
spread over the other devices at random. Runs start through jobs.services.run_start, as any
trigger does, and the database is polled until every run is terminal.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from devices.models import Device
from jobs.models import (
    RUN_TERMINAL,
    STEP_TERMINAL,
    JobRun,
    JobStep,
    JobTemplate,
    RunEvent,
    RunStatus,
    StepRun,
    StepStatus,
)
from jobs.services import run_start, template_version_record

from .report import spread_ms
from .timed_simulator import SimulatorProcess, handoffs

# Any action will do: the simulated devices answer every action alike, at once.
STEP_ACTION = "noop"
# How often the database is asked whether the runs have finished: often enough that the
# poll is not what ends the measurement (the end time is the last run's finished_at).
POLL_SECONDS = 0.1
# How often a progress line is printed while runs are going.
PROGRESS_SECONDS = 2.0
# No step finished for this long while runs are open: the engine is stuck (a task raising,
# a child dead), so give up early instead of waiting out the whole timeout.
STALL_SECONDS = 30.0
# Errors of failed runs quoted in the result: enough to see the pattern, not a wall of text.
ERRORS_QUOTED = 3

Say = Callable[[str], None]


@dataclass(frozen=True)
class Fleet:
    """Device names: the shared pool most runs meet on, and the rest that steps spread over."""

    shared: list[str]
    spread: list[str]

    @property
    def names(self) -> list[str]:
        return self.shared + self.spread


def fleet_create(*, devices: int, shared_devices: int) -> Fleet:
    """Create `devices` online Device rows; the first `shared_devices` are the shared pool."""
    if not 0 <= shared_devices < devices:
        raise ValueError(f"need fewer shared devices ({shared_devices}) than devices ({devices})")
    names = [f"bench-{i:04d}" for i in range(devices)]
    Device.objects.bulk_create([Device(name=name, online=True) for name in names])
    return Fleet(shared=names[:shared_devices], spread=names[shared_devices:])


def templates_create(
    *, tag: str, count: int, steps: int, fleet: Fleet, shared: float, rng: random.Random
) -> list[JobTemplate]:
    """`count` templates of `steps` steps; each step is on a shared device with probability `shared`.

    Each template's first version is recorded here, as saving a template in the admin or the
    API records it, so a run start only reads it (jobs/services.py).
    """
    devices = {d.name: d for d in Device.objects.filter(name__in=fleet.names)}
    templates = JobTemplate.objects.bulk_create(
        [JobTemplate(name=f"{tag}-{i:05d}", description="bench") for i in range(count)]
    )
    rows = []
    for template in templates:
        for position in range(steps):
            pool = fleet.shared if fleet.shared and rng.random() < shared else fleet.spread
            device = devices[rng.choice(pool)]
            rows.append(JobStep(template=template, position=position, device=device, action=STEP_ACTION))
    JobStep.objects.bulk_create(rows)
    for template in templates:
        template_version_record(template=template)
    return templates


def runs_start(templates: list[JobTemplate], *, tag: str, interval: float = 0.0) -> tuple[float, list[str]]:
    """Start a run of each template, `interval` seconds apart (0: back to back).

    Returns the time.time() just before the first start, and the run ids.
    """
    started = time.time()
    run_ids = []
    for i, template in enumerate(templates):
        if interval:
            time.sleep(max(0.0, started + i * interval - time.time()))
        run, _ = run_start(template=template, trigger="cli", triggered_by=tag)
        run_ids.append(str(run.pk))
    return started, run_ids


def runs_wait(*, tag: str, total: int, timeout: float, say: Say) -> None:
    """Poll until all `total` runs of `tag` are terminal.

    Raises TimeoutError after `timeout` seconds, or after STALL_SECONDS without a step ending.
    """
    deadline = time.monotonic() + timeout
    next_line = time.monotonic() + PROGRESS_SECONDS
    ended, moved_at = -1, time.monotonic()
    while True:
        finished = JobRun.objects.filter(triggered_by=tag, status__in=RUN_TERMINAL).count()
        if finished >= total:
            return
        now = time.monotonic()
        steps = StepRun.objects.filter(run__triggered_by=tag, status__in=STEP_TERMINAL).count()
        if steps != ended:
            ended, moved_at = steps, now
        if now > deadline or now - moved_at > STALL_SECONDS:
            why = f"after {timeout:.0f}s" if now > deadline else f"no step ended for {STALL_SECONDS:.0f}s"
            raise TimeoutError(f"{tag}: {finished}/{total} runs terminal, {steps} steps ended; {why}")
        if now >= next_line:
            say(f"  {tag}: {finished}/{total} runs finished, {steps} steps ended")
            next_line = now + PROGRESS_SECONDS
        time.sleep(POLL_SECONDS)


def phase_run(
    templates: list[JobTemplate], *, tag: str, timeout: float, say: Say, interval: float = 0.0
) -> tuple[float, list[str]]:
    """Start a run of every template and wait for them all; returns (start time, run ids)."""
    started, run_ids = runs_start(templates, tag=tag, interval=interval)
    runs_wait(tag=tag, total=len(run_ids), timeout=timeout, say=say)
    return started, run_ids


def phase_measure(
    *, tag: str, started: float, run_ids: list[str], simulator: SimulatorProcess
) -> dict[str, Any]:
    """Throughput, hand-off, lock-wait and failure figures of one finished phase."""
    runs = JobRun.objects.filter(triggered_by=tag)
    finished = [t for t in runs.values_list("finished_at", flat=True) if t is not None]
    seconds = max(t.timestamp() for t in finished) - started
    steps = StepRun.objects.filter(run__triggered_by=tag)
    succeeded = steps.filter(status=StepStatus.SUCCEEDED).count()
    failed = runs.exclude(status=RunStatus.SUCCEEDED)
    found = simulator.deliveries()
    run_samples, ready_samples = handoffs(found, set(run_ids))
    return {
        "runs": len(run_ids),
        "steps": succeeded,
        "seconds": round(seconds, 3),
        "steps_per_s": round(succeeded / seconds, 1),
        "failed_runs": failed.count(),
        "failed_errors": list(failed.values_list("error", flat=True)[:ERRORS_QUOTED]),
        "handoff_ms": spread_ms(run_samples),
        "handoff_ready_ms": spread_ms(ready_samples),
        **_lock_waits(steps),
        "handoff_legs_ms": _handoff_legs(run_ids, found),
    }


def _lock_waits(steps) -> dict[str, Any]:
    """Steps that waited (a `step.waiting` event) and their queued_at -> dispatched_at times."""
    waited_ids = set(
        RunEvent.objects.filter(step_run__in=steps, kind="step.waiting").values_list("step_run_id", flat=True)
    )
    waits, waits_all = [], []
    for pk, queued, dispatched in steps.values_list("pk", "queued_at", "dispatched_at"):
        if queued is None or dispatched is None:
            continue
        wait = (dispatched - queued).total_seconds()
        waits_all.append(wait)
        if pk in waited_ids:
            waits.append(wait)
    return {
        "lock_waits": len(waited_ids),
        "lock_wait_ms": spread_ms(waits),
        "queued_to_dispatched_ms": spread_ms(waits_all),
    }


def _handoff_legs(run_ids: list[str], found) -> dict[str, dict[str, float | None]]:
    """Where a run-to-run hand-off's time goes, leg by leg (device clock = worker clock).

    reply: step n-1's done leaves the device -> its step.succeeded event (bridge, Celery queue,
    task start, the attempt's end in the database). engine: -> step n's step.dispatched event
    (next step created, lock acquired or waited for, attempt committed). publish: -> the
    device receives step n's command (lease extend, MQTT publish with PUBACK, broker).
    """
    events: dict[tuple[str, int, str], float] = {}
    rows = RunEvent.objects.filter(run_id__in=run_ids, kind__in=("step.succeeded", "step.dispatched"))
    for run_id, index, kind, created in rows.values_list("run_id", "step_run__index", "kind", "created_at"):
        events.setdefault((str(run_id), index, kind), created.timestamp())  # first dispatch
    wanted = set(run_ids)
    by_step = {(d.run, d.step): d for d in found if d.run in wanted}
    legs: dict[str, list[float]] = {"reply": [], "engine": [], "publish": []}
    for (run, step), d in by_step.items():
        before = by_step.get((run, step - 1))
        ended = events.get((run, step - 1, "step.succeeded"))
        dispatched = events.get((run, step, "step.dispatched"))
        if before is None or before.done_at is None or ended is None or dispatched is None:
            continue
        legs["reply"].append(ended - before.done_at)
        legs["engine"].append(dispatched - ended)
        legs["publish"].append(d.received_at - dispatched)
    return {name: spread_ms(samples) for name, samples in legs.items()}
