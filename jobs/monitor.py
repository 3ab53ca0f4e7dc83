"""The monitor: one beat-driven tick that finds what is due and hands each item to a task.

A tick costs O(what is due): it claims due deadlines and expired lock leases from Redis
sorted sets in batches and enqueues one small task per item. Every IOTQUEUE_RECONCILE_SECONDS one
tick also asks the database (the authority) for work Redis may have lost — overdue steps,
runs that never started, runs whose step ended but that did not move on, rollouts in waves
whose soak ended or whose webhook gate was never asked — through
indexed queries, so a lost task or a Redis restart delays a run but never strands it.
After Redis lost its data, the device locks are rebuilt from the database before any new
grant (see devices/locks.py, NotReady).
"""

from __future__ import annotations

import logging
from collections import Counter
from datetime import timedelta

from celery import current_app
from django.conf import settings
from django.db.models import Exists, OuterRef, Q
from django.utils import timezone

from devices.lock_recovery import locks_maintain
from iotqueue.metrics import MetricsBatch
from iotqueue.redis_conn import redis_connection, redis_key

from .deadlines import Deadline, deadlines_claim, deadlines_set
from .engine.batch import inbox_apply, run_continue
from .engine.continuous import fanouts_overdue_close
from .engine.rollback import compensation_next
from .engine.wave_gates import gates_unanswered, soaks_overdue
from .inbox import inbox_reclaim
from .metrics import MONITOR_ACTIONS
from .models import (
    STEP_AT_WORK,
    STEP_TERMINAL,
    ContinuousFanout,
    EndBehaviour,
    JobRun,
    Phase,
    Rollout,
    RolloutState,
    RunStatus,
    StepRun,
    StepStatus,
)
from .presence import steps_resume
from .services import RUN_ADVANCE_TASK
from .step_locks import DEADLINE_KIND_FOR_STATUS

log = logging.getLogger(__name__)

# Items claimed per tick and kind; more wait for the next tick (a second later).
CLAIM_BATCH = 500
# Due deadlines handled per task: small enough that two workers share a burst, large
# enough that enqueueing stays a small part of the tick.
DEADLINES_PER_TASK = 25
# Tasks the monitor enqueues, named (jobs/tasks.py imports this module, not the reverse).
DEADLINES_TASK = "jobs.step_deadlines"


def monitor_tick() -> dict[str, int]:
    """Claim what is due and enqueue its handling; returns counts for logs and the bench."""
    # Lost lock state is rebuilt, and expired leases reclaimed, before any deadline acts.
    locks = locks_maintain()
    # Replies and run starts whose worker died after taking them (jobs/inbox.py).
    inbox_reclaim(inbox_apply, count=CLAIM_BATCH)
    due = deadlines_claim(limit=CLAIM_BATCH)
    # One task per chunk, not per deadline: enqueueing is most of a tick's cost.
    for start in range(0, len(due), DEADLINES_PER_TASK):
        chunk = [d.member for d in due[start : start + DEADLINES_PER_TASK]]
        current_app.signature(DEADLINES_TASK, args=(chunk,)).apply_async(
            argsrepr=f"batch={len(chunk)}, {chunk!r}"
        )
    swept = 0
    interval = settings.IOTQUEUE_RECONCILE_SECONDS
    if redis_connection().set(redis_key("reconcile"), "1", nx=True, px=int(interval * 1000)):
        swept = reconcile()
    _actions_count(due, leases=locks["leases"], swept=swept, rebuilt=bool(locks["rebuilt"]))
    return {"deadlines": len(due), "leases": locks["leases"], "swept": swept}


def _actions_count(due: list[Deadline], *, leases: int, swept: int, rebuilt: bool) -> None:
    """Count the tick's work on /metrics (one round trip; a Redis failure only loses it)."""
    batch = MetricsBatch().count(MONITOR_ACTIONS, "tick")
    for kind, n in Counter(d.kind for d in due).items():
        batch.count(MONITOR_ACTIONS, f"deadline_{kind}", amount=n)
    for action, n in (("lease_reclaimed", leases), ("reconciled", swept), ("locks_rebuilt", int(rebuilt))):
        if n:
            batch.count(MONITOR_ACTIONS, action, amount=n)
    batch.send()


def reconcile() -> int:
    """Re-find, from the database, work whose Redis trace (deadline, task) was lost."""
    now, interval = timezone.now(), settings.IOTQUEUE_RECONCILE_SECONDS
    # Overdue by a third of the sweep interval: the fast path (deadline set) had its chance.
    grace = timedelta(seconds=interval / 3)
    overdue = list(
        StepRun.objects.filter(status__in=list(DEADLINE_KIND_FOR_STATUS), deadline__lt=now - grace)
        .order_by("deadline")
        .values_list("pk", "status", "attempt", "device__name")[:CLAIM_BATCH]
    )
    deadlines_set(
        {
            Deadline(DEADLINE_KIND_FOR_STATUS[status], pk, attempt, device): now
            for pk, status, attempt, device in overdue
        }
    )
    # Runs past their max_duration whose `run` deadline was lost.
    expired = [
        str(pk)
        for pk in JobRun.objects.filter(status=RunStatus.RUNNING, deadline__lt=now - grace).values_list(
            "pk", flat=True
        )[:CLAIM_BATCH]
    ]
    deadlines_set({Deadline("run", run_id, 0): now for run_id in expired})
    # Runs past their end-by whose `end` deadline was lost (a running run that lets its
    # commands finish is not asked again: it ends by itself once they have).
    ending = (
        JobRun.objects.filter(end_by__lt=now - grace)
        .filter(Q(status=RunStatus.PENDING) | Q(status=RunStatus.RUNNING, end_behaviour=EndBehaviour.CANCEL))
        .values_list("pk", flat=True)
    )
    deadlines_set({Deadline("end", str(run_id), 0): now for run_id in ending[:CLAIM_BATCH]})
    # (A run whose start-not-before is ahead waits for it: jobs/run_windows.py.)
    unstarted = list(
        JobRun.objects.filter(status=RunStatus.PENDING, created_at__lt=now - 3 * grace)
        .filter(Q(not_before__isnull=True) | Q(not_before__lt=now - grace))
        .values_list("pk", flat=True)[:CLAIM_BATCH]
    )
    for run_id in unstarted:
        current_app.signature(RUN_ADVANCE_TASK, args=(str(run_id),)).apply_async(argsrepr=f"runs=[{run_id}]")
    # Running runs whose step at the cursor has a row that ended a while ago and none at
    # work (a fan-out with rows still at work is not stalled: the next row to end moves it
    # on). Asked per run, not per ended row: a 100,000-device fan-out is one question.
    ended = StepRun.objects.filter(
        run=OuterRef("pk"), index=OuterRef("cursor"), status__in=STEP_TERMINAL, finished_at__lt=now - grace
    )
    at_work = StepRun.objects.filter(run=OuterRef("pk"), index=OuterRef("cursor"), status__in=STEP_AT_WORK)
    # An open continuous fan-out waits for devices to join, not for a lost task.
    open_at_cursor = ContinuousFanout.objects.filter(
        run=OuterRef("pk"), index=OuterRef("cursor"), closed_at=None
    )
    stalled = (
        JobRun.objects.filter(status=RunStatus.RUNNING)
        .filter(Exists(ended))
        .filter(~Exists(at_work))
        .filter(~Exists(open_at_cursor))
        .values_list("pk", "cursor")[:CLAIM_BATCH]
    )
    moved = 0
    for run_id, cursor in stalled:
        step_run = (
            StepRun.objects.select_related("run", "device")
            .filter(run_id=run_id, index=cursor, status__in=STEP_TERMINAL, finished_at__lt=now - grace)
            .first()
        )
        if step_run is not None:
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
    steps_resume(list(waiting), quiet=True)
    # Runs whose cursor moved but whose next step row was never created (the worker died in
    # between): starting the step at the cursor again is idempotent.
    row_at_cursor = StepRun.objects.filter(run=OuterRef("pk"), phase=Phase.FORWARD, index=OuterRef("cursor"))
    cursorless = (
        JobRun.objects.filter(status=RunStatus.RUNNING, started_at__lt=now - grace)
        .filter(~Exists(row_at_cursor))
        .filter(~Exists(open_at_cursor))  # opened with no device yet: it has started
        .values_list("pk", flat=True)[:CLAIM_BATCH]
    )
    for run_id in cursorless:
        current_app.signature(RUN_ADVANCE_TASK, args=(str(run_id),)).apply_async(argsrepr=f"runs=[{run_id}]")
    unpumped = fanouts_unpumped(started_before=now - grace)
    # Continuous fan-outs past their end-by whose `fanout_close` deadline was lost.
    closed = fanouts_overdue_close(before=now - grace)
    # Rollouts in waves whose soak ended but whose `soak` deadline was lost, and rollouts
    # whose webhook gate was never asked (its task lost): past the gate's own timeout and a
    # sweep interval, an ask would have been answered or refused by now; it is asked again.
    soaks = soaks_overdue(before=now - grace)
    unanswered = timedelta(seconds=settings.IOTQUEUE_WAVE_GATE_TIMEOUT_SECONDS + interval)
    gates = gates_unanswered(before=now - unanswered)
    for run in JobRun.objects.filter(status=RunStatus.COMPENSATING, started_at__lt=now - grace)[:CLAIM_BATCH]:
        compensation_next(run=run)  # no-op while a compensation is active; resumes a lost one
    if overdue or unstarted or moved or unpumped or expired or closed or soaks or gates:
        log.warning(
            "reconcile: %d overdue steps, %d unstarted runs, %d stalled runs, %d fan-outs pumped again, "
            "%d runs past max_duration, %d continuous fan-outs past their end-by, %d soaks over, "
            "%d webhook gates asked again",
            len(overdue),
            len(unstarted),
            moved,
            unpumped,
            len(expired),
            closed,
            soaks,
            gates,
        )
    return len(overdue) + len(unstarted) + moved + unpumped + len(expired) + closed + soaks + gates


def fanouts_unpumped(*, started_before) -> int:
    """Running fan-outs whose rows at the cursor wait `pending` with none at work: their
    pump was lost (a start cut after its rows committed, a `pump` deadline lost with
    Redis). Each gets its `pump` deadline due now; the pump itself finds its rate window.
    A rollout in waves that is not running (paused, soaking, at a gate) waits on purpose
    and is not asked: a rollout awaiting approval for days costs no pump per sweep.
    Returns how many."""
    at_cursor = StepRun.objects.filter(run=OuterRef("pk"), phase=Phase.FORWARD, index=OuterRef("cursor"))
    pending = at_cursor.filter(status=StepStatus.PENDING)
    at_work = at_cursor.filter(status__in=STEP_AT_WORK)
    waiting_rollout = Rollout.objects.filter(run=OuterRef("pk"), index=OuterRef("cursor")).exclude(
        state=RolloutState.RUNNING
    )
    runs = (
        JobRun.objects.filter(status=RunStatus.RUNNING, started_at__lt=started_before)
        .filter(Exists(pending))
        .filter(~Exists(at_work))
        .filter(~Exists(waiting_rollout))
        .values_list("pk", "cursor")[:CLAIM_BATCH]
    )
    due = {}
    for run_id, cursor in runs:
        rows = StepRun.objects.filter(run_id=run_id, phase=Phase.FORWARD, index=cursor)
        first = rows.filter(status=StepStatus.PENDING).order_by("pk").values_list("pk", flat=True).first()
        if first is not None:
            due[Deadline("pump", first, 0)] = timezone.now()
    deadlines_set(due)
    return len(due)
