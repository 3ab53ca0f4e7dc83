"""Rolling a fan-out back: its compensation on each device that succeeded, paced.

When a run rolls back (jobs/engine/rollback.py) and comes to a fan-out step with a
`compensation_action`, it first waits for the step's rows still at work (an aborted
rollout lets them finish: their outcome says whether they are undone). Then every device
whose row ended `succeeded` gets a compensation row (phase `compensation`, the step's
index, its device); a device whose row failed, was rejected, timed out, skipped or
canceled gets none. The rows start `pending` and the fan-out's pump starts them
(fanout.fanout_pump: the same `pump` deadline, RATE_WINDOW and rollout_room, the last two
of rollout_pace.py) at the step's `compensation_per_minute` (0 = no limit) and
`max_in_flight`, through the batched start (batch.rows_start), so they queue on the same
device locks as any step. When every one has ended the step's rollback is over
(`step.compensation_done`, with the devices not rolled back) and the rollback goes on with
the earlier steps.
"""

from __future__ import annotations

from collections import Counter

from django.db import transaction
from django.utils import timezone

from .. import templating
from ..events import event_record
from ..models import STEP_TERMINAL, JobRun, Phase, RunEvent, RunStatus, StepRun, StepStatus
from .fanout import ACTIVE, fanout_pump, fanout_rows, rows_by_status
from .kinds import step_compensation
from .plan import FANOUT, step_args

# Devices named in a `step.compensation_done` event's data (the others are counted).
NOT_ROLLED_BACK_NAMED = 50


@step_compensation(FANOUT)
def fanout_compensate(run: JobRun, index: int) -> bool:
    """Go on with the rollback of fan-out step `index`; True while it is at work (rows still
    running, waiting for their rate or device), False once it is over or had nothing to do.

    Under the run's row lock (SQLite: its write lock), as the fan-out's own progress is: of
    two callers at once (two rows ending together), one makes the rows or records the end.
    """
    with transaction.atomic():
        if not JobRun.objects.select_for_update().filter(pk=run.pk, status=RunStatus.COMPENSATING).exists():
            return True  # the run ended or was canceled meanwhile: nothing more here
        undo = fanout_rows(run, index, Phase.COMPENSATION)
        if not undo.exists():
            forward = fanout_rows(run, index)
            if forward.filter(status__in=ACTIVE).exists():
                _waiting_record(run, index, forward.filter(status__in=ACTIVE).count())
                return True  # fanout_progress.fanout_row_ended calls back when the last one ends
            if not _compensation_rows_create(run, index):
                return False
        if undo.filter(status=StepStatus.PENDING).exists():
            fanout_pump(run=run, index=index, phase=Phase.COMPENSATION)
            return True
        if undo.exclude(status__in=STEP_TERMINAL).exists():
            return True
        _done_record(run, index)
        return False


def _waiting_record(run: JobRun, index: int, at_work: int) -> None:
    if not RunEvent.objects.filter(run=run, kind="step.compensation_waiting", data__index=index).exists():
        event_record(
            "step.compensation_waiting",
            run=run,
            message=f"rollback waits for {at_work} devices still at work",
            index=index,
            at_work=at_work,
        )


def _compensation_rows_create(run: JobRun, index: int) -> int:
    """One pending compensation row per device whose row succeeded (a device whose undo's
    args cannot be rendered gets a failed row saying why); how many rows were made."""
    spec = run.plan[index]
    action = spec["compensation_action"]
    forward_rows = fanout_rows(run, index)
    succeeded = forward_rows.filter(status=StepStatus.SUCCEEDED).select_related("device").order_by("pk")
    rows, now = [], timezone.now()
    for forward in succeeded:
        row = StepRun(run=run, index=index, phase=Phase.COMPENSATION, device=forward.device, action=action)
        try:
            row.args = step_args(run, spec["compensation_args"], forward.device)
        except templating.TemplateError as exc:
            row.status, row.error, row.finished_at = StepStatus.FAILED, f"compensation {action}: {exc}", now
        rows.append(row)
    if not rows:
        return 0
    StepRun.objects.bulk_create(rows, ignore_conflicts=True)
    for row in rows:
        if row.status == StepStatus.FAILED:  # refused: counted on /metrics as any failed row
            event_record("step.failed", run=run, device=row.device.name, message=row.error, index=index)
    rate = spec.get("compensation_per_minute") or 0
    paced = f", {rate} a minute" if rate else ""
    event_record(
        "step.compensating",
        run=run,
        message=f"{action} to the {len(rows)} devices that succeeded{paced}",
        index=index,
        devices=len(rows),
        compensation_per_minute=rate,
    )
    return len(rows)


def _done_record(run: JobRun, index: int) -> None:
    """The step's rollback is over: one event with its rows by status and the devices that
    were not rolled back, each with why (recorded once)."""
    if RunEvent.objects.filter(run=run, kind="step.compensation_done", data__index=index).exists():
        return
    undo = fanout_rows(run, index, Phase.COMPENSATION)
    by_status: Counter = rows_by_status(undo)
    failed = list(
        undo.exclude(status=StepStatus.SUCCEEDED)
        .order_by("device__name")
        .values_list("device__name", "status", "error")[:NOT_ROLLED_BACK_NAMED]
    )
    total = sum(by_status.values())
    message = f"{by_status[StepStatus.SUCCEEDED]} of {total} devices rolled back"
    if failed:
        message += "; not rolled back: " + "; ".join(f"{d} {s} {e}".strip() for d, s, e in failed)
    event_record(
        "step.compensation_done",
        run=run,
        message=message,
        index=index,
        by_status=dict(by_status),
        not_rolled_back=[{"device": d, "status": s, "error": e} for d, s, e in failed],
    )
