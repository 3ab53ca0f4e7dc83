"""A fan-out's progress: what a device's row ending (or a wave's soak ending) decides.

Under the run's row lock: abort when a criterion trips (by cause: failed, rejected, timed
out, any; the pending rows are skipped and the step fails with the criterion and the
failure breakdown), move a rollout in waves on (jobs/engine/wave_gates.py), pump more rows
(jobs/engine/fanout.py), or, when all rows ended, let the success criterion decide. A
continuous fan-out (jobs/engine/continuous.py) is decided when it closes, not while open.

It sits above the fan-out kind and the waves' gates, which it asks, so neither imports it:
the `soak` deadline's handler lives here because a soak's end decides the step as a row's
end does.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.utils import timezone

from ..choices import AbortCause
from ..deadlines import Deadline
from ..events import event_record
from ..models import STEP_TERMINAL, JobRun, Rollout, RolloutState, RunStatus, StepRun, StepStatus
from .batch import step_done_apply
from .continuous_open import fanout_is_open
from .fanout import ACTIVE, fanout_pump, fanout_rollout, fanout_rows, fanout_stop, fanout_summary
from .kinds import deadline_handler, row_ended
from .plan import FANOUT
from .planner import run_ended_by
from .rollback import compensation_next
from .rollout_pace import FAILING, abort_criteria, abort_criterion_tripped, rollout_succeeded
from .wave_gates import rollout_progress, wave_gate_ask


@row_ended(FANOUT)
def fanout_row_ended(step_run: StepRun) -> None:
    """A device's row of the fan-out ended: its progress, or, the run rolling back, the
    rollback's next move once the step's last row at work ended."""
    run, index = step_run.run, step_run.index
    if fanout_progress(run=run, index=index):
        return
    # The run moved on. Rolling back, it waited for this step's rows at work to end (their
    # outcome says whether they are undone): the last one lets the rollback go on.
    if (
        JobRun.objects.filter(pk=run.pk, status=RunStatus.COMPENSATING).exists()
        and not fanout_rows(run, index).filter(status__in=ACTIVE).exists()
    ):
        compensation_next(run=run)


def fanout_progress(*, run: JobRun, index: int) -> bool:
    """A device's row ended for good: abort, pump more, or decide the step; False when the
    run is no longer running at this step (nothing done).

    Under the run's row lock (SQLite: its write lock), so of two workers whose rows ended
    together, one decides and the other finds the run moved on and does nothing.
    """
    with transaction.atomic():
        locked = JobRun.objects.select_for_update().filter(pk=run.pk, status=RunStatus.RUNNING, cursor=index)
        if not locked.exists():
            return False
        fanout_decide(run=run, index=index)
    return True


def fanout_decide(*, run: JobRun, index: int) -> None:
    """Abort, pump or decide, from what each needs: abort criteria are counted only once a
    row failed (none can trip before), and the whole step is counted once, at its end.
    Call it under the run's row lock, with the run at this step (fanout_progress does)."""
    spec = run.plan[index]
    rows = fanout_rows(run, index)
    if abort_criteria(spec) and rows.filter(status__in=FAILING).exists():
        by_status, reasons = fanout_summary(run, index)
        ended = sum(by_status[s] for s in STEP_TERMINAL if s != StepStatus.SKIPPED)
        tripped = abort_criterion_tripped(criteria=abort_criteria(spec), by_status=by_status, executed=ended)
        if tripped is not None:
            breakdown = ", ".join(f"{n}x {reason}" for reason, n in reasons.most_common(5))
            fanout_abort(run=run, index=index, tripped=tripped, breakdown=breakdown)
            return
    rollout = fanout_rollout(run, index) if spec.get("waves") else None
    if rollout is not None and run_ended_by(run, timezone.now()):
        rollout = None  # past an end-by that lets what started finish: no wave opens any more
    if rollout is not None and not rollout_progress(run=run, index=index, rollout=rollout, rows=rows):
        return
    if rows.filter(status=StepStatus.PENDING).exists():
        fanout_pump(run=run, index=index)
        return
    if rows.filter(status__in=ACTIVE).exists():
        return
    if fanout_is_open(run, index):
        return  # its rows ended, but devices may still join: it ends when it closes
    by_status, reasons = fanout_summary(run, index)
    total = sum(by_status.values())
    succeeded = by_status[StepStatus.SUCCEEDED]
    ended = sum(by_status[s] for s in STEP_TERMINAL if s != StepStatus.SKIPPED)
    failed = ended - succeeded
    breakdown = ", ".join(f"{n}x {reason}" for reason, n in reasons.most_common(5))
    ok = rollout_succeeded(succeeded=succeeded, total=total, success_percent=spec.get("success_percent", 100))
    message = f"{succeeded} of {total} devices succeeded" + (f"; failures: {breakdown}" if failed else "")
    event_record("step.fanout_done", run=run, message=message, index=index, by_status=dict(by_status))
    Rollout.objects.filter(run=run, index=index).update(state=RolloutState.ENDED)
    step_done_apply(
        str(run.pk),
        index,
        ok=ok,
        status=StepStatus.SUCCEEDED if ok else StepStatus.FAILED,
        error=f"step {index}: {message}",
    )


def fanout_abort(*, run: JobRun, index: int, tripped: dict[str, Any], breakdown: str) -> None:
    """An abort criterion tripped: skip the rows not started, fail the step saying which
    criterion and what it counted. Rows already at work finish (their outcome is recorded)."""
    cause = tripped["cause"]
    counted = "failed, rejected or timed out" if cause == AbortCause.ANY else cause.replace("_", " ")
    error = (
        f"step {index}: rollout aborted by criterion {cause}: {tripped['count']} of "
        f"{tripped['executed']} devices {counted} ({tripped['percent']}% > "
        f"{tripped['threshold_percent']}%): {breakdown}"
    )
    fanout_stop(run=run, index=index, error=error, criterion=tripped)


@deadline_handler("soak")
def soak_due(step_run: StepRun, deadline: Deadline) -> None:
    """A wave's soak time is over: its gate decides (unless the rollout moved on meanwhile)."""
    run, index = step_run.run, step_run.index
    with transaction.atomic():
        if (
            not JobRun.objects.select_for_update()
            .filter(pk=run.pk, status=RunStatus.RUNNING, cursor=index)
            .exists()
        ):
            return
        rollout = fanout_rollout(run, index)
        if rollout is None or rollout.state != RolloutState.SOAKING or rollout.wave != step_run.wave - 1:
            return
        if wave_gate_ask(run=run, rollout=rollout):
            fanout_decide(run=run, index=index)
