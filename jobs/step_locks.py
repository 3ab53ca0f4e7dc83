"""What the jobs app tells the device lock about its holders (devices/lock_recovery.py).

A "step:<id>" holder is a step row. When its lease runs out while the step is still in
flight, the attempt ends (timed out, retried if it has budget) and the lock is passed on;
a lease of a step that never dispatched (granted, its hand-off lost) is passed on and the
step asks again. After Redis lost its data the rows are the source of truth: each
executing step gets its lock back, fence counters are raised to the highest fence the
rows have seen, deadlines are put back and every queued step asks for its lock again.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from django.db.models import Max

from devices.lock_recovery import LockRecord
from devices.locks import Grant, device_lock_pass_on

from .deadlines import Deadline, deadlines_set
from .engine.batch import attempt_end_apply, rows_start
from .engine.plan import holder_step_id, lease_seconds, step_holder, step_spec
from .events import event_record
from .models import STEP_IN_FLIGHT, StepRun, StepStatus
from .presence import steps_resume

log = logging.getLogger(__name__)

# The deadline that guards a step in each waiting or working status.
DEADLINE_KIND_FOR_STATUS = {
    StepStatus.QUEUED: "queue",
    StepStatus.DISPATCHED: "done",
    StepStatus.IN_PROGRESS: "done",
    StepStatus.RETRYING: "retry",
}


def step_lease_expired(device: str, grant: Grant) -> None:
    """A holder's lease ran out: a step still executing ends its attempt (one transition,
    `attempt_end_apply`); any other holder (a step that never dispatched, a locked Celery
    task) is recorded and passed on."""
    step_id = holder_step_id(grant.holder)
    step_run = StepRun.objects.select_related("run", "device").filter(pk=step_id).first()
    if step_run is not None and step_run.device_name != device:
        step_run = None  # the holder's row is gone and its id now names another step
    if step_run is not None and step_run.status in STEP_IN_FLIGHT and step_run.fence == grant.fence:
        attempt_end_apply(step_run.pk, fence=grant.fence, error="device lock lease expired", timed_out=True)
        return
    event_record(
        "lock.reclaimed",
        device=device,
        message=f"lease of {grant.holder} expired",
        holder=grant.holder,
        fence=grant.fence,
    )
    device_lock_pass_on(device, holder=grant.holder, fence=grant.fence)
    if step_run is not None and step_run.status == StepStatus.QUEUED:
        rows_start([step_run.pk])  # was granted but never dispatched: queue again


def step_lock_records() -> Iterator[LockRecord]:
    """Rebuild source: each device's executing step (if any) and its highest fence."""
    executing = {
        s.device.name: s
        for s in StepRun.objects.select_related("run", "device").filter(
            status__in=STEP_IN_FLIGHT, command_id__isnull=False
        )
    }
    floors = (
        StepRun.objects.filter(fence__isnull=False).values_list("device__name").annotate(top=Max("fence"))
    )
    for device, top in floors:
        holder = executing.get(device)
        yield LockRecord(
            device=device,
            holder=step_holder(holder) if holder else None,
            fence=holder.fence if holder else top,
            floor=top,
            lease_seconds=lease_seconds(step_spec(holder)) if holder else 0.0,
        )


def steps_after_rebuild() -> None:
    """Grants resumed: put the rows' deadlines back, then every queued step asks again."""
    active = StepRun.objects.filter(status__in=list(DEADLINE_KIND_FOR_STATUS), deadline__isnull=False)
    entries = {
        Deadline(DEADLINE_KIND_FOR_STATUS[status], pk, attempt, device): deadline
        for pk, status, attempt, deadline, device in active.values_list(
            "pk", "status", "attempt", "deadline", "device__name"
        )
    }
    if entries:
        deadlines_set(entries)
    queued = StepRun.objects.select_related("run", "device").filter(status=StepStatus.QUEUED)
    steps_resume(list(queued.order_by("queued_at", "pk")))
    log.warning("device locks rebuilt: %d step deadlines restored", len(entries))
