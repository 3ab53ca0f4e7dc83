"""The monitor: one beat-driven tick that finds what is due and hands each item to a task.

A tick costs O(what is due): it claims due deadlines and expired lock leases from Redis
sorted sets in batches and enqueues one small task per item. Every IOTQUEUE_RECONCILE_SECONDS one
tick also asks the database (the authority) for work Redis may have lost — overdue steps,
runs that never started, runs whose step ended but that did not move on — through
indexed queries, so a lost task or a Redis restart delays a run but never strands it.
After Redis lost its data, the device locks are rebuilt from the database before any new
grant (see devices/locks.py, NotReady).
"""

from __future__ import annotations

import logging
from collections import Counter
from datetime import timedelta

from django.conf import settings
from django.db.models import Exists, F, Max, OuterRef
from django.utils import timezone

from devices.locks import (
    device_lock_expired,
    device_lock_restore,
    holder_parse,
    lock_epoch_exists,
    lock_epoch_start,
)
from iotqueue.metrics import MONITOR_ACTIONS, MetricsBatch
from iotqueue.redis_conn import redis_connection, redis_key

from .deadlines import Deadline, deadlines_claim, deadlines_set
from .engine import HOLDER_KIND, lease_seconds, lock_pass_on, step_acquire, step_holder, step_spec
from .events import event_record
from .models import STEP_IN_FLIGHT, STEP_TERMINAL, JobRun, Phase, RunStatus, StepRun, StepStatus
from .outcomes import attempt_end, run_continue
from .presence import step_resume
from .rollback import compensation_next

log = logging.getLogger(__name__)

# Items claimed per tick and kind; more wait for the next tick (a second later).
CLAIM_BATCH = 500
# Due deadlines handled per task: small enough that two workers share a burst, large
# enough that enqueueing stays a small part of the tick.
DEADLINES_PER_TASK = 25
# An expired lease being reclaimed is pushed out this far so it is not claimed twice.
LEASE_CLAIM_SECONDS = 30.0
# Only one process rebuilds the locks at a time; this bounds a crashed rebuilder's hold.
REBUILD_LOCK_SECONDS = 60

DEADLINE_KIND_FOR_STATUS = {
    StepStatus.QUEUED: "queue",
    StepStatus.DISPATCHED: "done",
    StepStatus.IN_PROGRESS: "done",
    StepStatus.RETRYING: "retry",
}


def monitor_tick() -> dict[str, int]:
    """Claim what is due and enqueue its handling; returns counts for logs and the bench."""
    from .tasks import lease_reclaim_task, step_deadlines_task

    rebuilt = False
    if not lock_epoch_exists():
        rebuilt = locks_rebuild()
    due = deadlines_claim(limit=CLAIM_BATCH)
    # One task per chunk, not per deadline: enqueueing is most of a tick's cost.
    for start in range(0, len(due), DEADLINES_PER_TASK):
        step_deadlines_task.delay([d.member for d in due[start : start + DEADLINES_PER_TASK]])
    expired = device_lock_expired(limit=CLAIM_BATCH, claim_seconds=LEASE_CLAIM_SECONDS)
    for device, grant in expired:
        lease_reclaim_task.delay(device, grant.holder, grant.fence)
    swept = 0
    interval = settings.IOTQUEUE_RECONCILE_SECONDS
    if redis_connection().set(redis_key("reconcile"), "1", nx=True, px=int(interval * 1000)):
        swept = reconcile()
    _actions_count(due, leases=len(expired), swept=swept, rebuilt=rebuilt)
    return {"deadlines": len(due), "leases": len(expired), "swept": swept}


def _actions_count(due: list[Deadline], *, leases: int, swept: int, rebuilt: bool) -> None:
    """Count the tick's work on /metrics (one round trip; a Redis failure only loses it)."""
    batch = MetricsBatch().count(MONITOR_ACTIONS, "tick")
    for kind, n in Counter(d.kind for d in due).items():
        batch.count(MONITOR_ACTIONS, f"deadline_{kind}", amount=n)
    for action, n in (("lease_reclaimed", leases), ("reconciled", swept), ("locks_rebuilt", int(rebuilt))):
        if n:
            batch.count(MONITOR_ACTIONS, action, amount=n)
    batch.send()


def lease_reclaim(*, device: str, holder: str, fence: int) -> None:
    """A holder's lease ran out: end its attempt if it is still executing, hand the lock on."""
    kind, ident = holder_parse(holder)
    step_run = None
    if kind == HOLDER_KIND and ident.isdigit():
        step_run = StepRun.objects.select_related("run", "device").filter(pk=int(ident)).first()
    if step_run is not None and step_run.status in STEP_IN_FLIGHT and step_run.fence == fence:
        attempt_end(
            step_run=step_run,
            command_id=step_run.command_id,
            ok=False,
            error="device lock lease expired",
            retryable=True,
            timed_out=True,
        )
        return
    event_record(
        "lock.reclaimed", device=device, message=f"lease of {holder} expired", holder=holder, fence=fence
    )
    lock_pass_on(device, holder=holder, fence=fence)
    if step_run is not None and step_run.status == StepStatus.QUEUED:
        step_acquire(step_run=step_run)  # was granted but never dispatched: queue again


def reconcile() -> int:
    """Re-find, from the database, work whose Redis trace (deadline, task) was lost."""
    from .tasks import run_advance_task

    now = timezone.now()
    # Overdue by a third of the sweep interval: the fast path (deadline set) had its chance.
    grace = timedelta(seconds=settings.IOTQUEUE_RECONCILE_SECONDS / 3)
    overdue = list(
        StepRun.objects.filter(status__in=list(DEADLINE_KIND_FOR_STATUS), deadline__lt=now - grace)
        .order_by("deadline")
        .values_list("pk", "status", "attempt")[:CLAIM_BATCH]
    )
    deadlines_set(
        {Deadline(DEADLINE_KIND_FOR_STATUS[status], pk, attempt): now for pk, status, attempt in overdue}
    )
    unstarted = list(
        JobRun.objects.filter(status=RunStatus.PENDING, created_at__lt=now - 3 * grace).values_list(
            "pk", flat=True
        )[:CLAIM_BATCH]
    )
    for run_id in unstarted:
        run_advance_task.delay(str(run_id))
    stalled = (
        StepRun.objects.select_related("run", "device")
        .filter(run__status=RunStatus.RUNNING, index=F("run__cursor"), status__in=STEP_TERMINAL)
        .filter(finished_at__lt=now - grace)[:CLAIM_BATCH]
    )
    moved = 0
    for step_run in stalled:
        run_continue(step_run=step_run)
        moved += 1
    # Queued steps whose lock request was lost with a killed worker (row committed, no
    # acquire) or whose hand-off was (granted, never dispatched): asking again is
    # idempotent: a waiting step keeps its place, a step that holds the lock is dispatched.
    waiting = (
        StepRun.objects.select_related("run", "device")
        .filter(status=StepStatus.QUEUED, queued_at__lt=now - grace, device__isnull=False)
        .order_by("queued_at")[:CLAIM_BATCH]
    )
    for step_run in waiting:
        step_resume(step_run=step_run, quiet=True)
    # Runs whose cursor moved but whose next step row was never created (the worker died in
    # between): starting the step at the cursor again is idempotent.
    row_at_cursor = StepRun.objects.filter(run=OuterRef("pk"), phase=Phase.FORWARD, index=OuterRef("cursor"))
    cursorless = (
        JobRun.objects.filter(status=RunStatus.RUNNING, started_at__lt=now - grace)
        .filter(~Exists(row_at_cursor))
        .values_list("pk", flat=True)[:CLAIM_BATCH]
    )
    for run_id in cursorless:
        run_advance_task.delay(str(run_id))
    for run in JobRun.objects.filter(status=RunStatus.COMPENSATING, started_at__lt=now - grace)[:CLAIM_BATCH]:
        compensation_next(run=run)  # no-op while a compensation is active; resumes a lost one
    if overdue or unstarted or moved:
        log.warning(
            "reconcile: %d overdue steps, %d unstarted runs, %d stalled runs",
            len(overdue),
            len(unstarted),
            moved,
        )
    return len(overdue) + len(unstarted) + moved


def locks_rebuild() -> bool:
    """Rebuild device locks and deadlines from the database after Redis lost them.

    Runs in one process at a time. Fence counters are raised to the highest fence the
    database has seen, each executing step gets its lock back, then grants resume and every
    queued step asks for its lock again (oldest first). False if another process is at it.
    """
    conn = redis_connection()
    if not conn.set(redis_key("lock-rebuild"), "1", nx=True, ex=REBUILD_LOCK_SECONDS):
        return False
    try:
        log.warning("device locks: Redis has no lock state; rebuilding from the database")
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
            device_lock_restore(
                device,
                holder=step_holder(holder) if holder else None,
                fence=holder.fence if holder else top,
                floor=top,
                lease_seconds=lease_seconds(step_spec(holder)) if holder else 0,
            )
        active = StepRun.objects.filter(status__in=list(DEADLINE_KIND_FOR_STATUS), deadline__isnull=False)
        entries = {
            Deadline(DEADLINE_KIND_FOR_STATUS[status], pk, attempt): deadline
            for pk, status, attempt, deadline in active.values_list("pk", "status", "attempt", "deadline")
        }
        if entries:
            deadlines_set(entries)
        lock_epoch_start()
        queued = StepRun.objects.select_related("run", "device").filter(status=StepStatus.QUEUED)
        for step_run in queued.order_by("queued_at", "pk"):
            step_resume(step_run=step_run)
        log.warning("device locks rebuilt: %d executing, %d queued", len(executing), len(entries))
        return True
    finally:
        conn.delete(redis_key("lock-rebuild"))
