"""Rollback: when a step fails for good under policy `rollback`, undo what succeeded.

The compensations of the steps that ran run one at a time in reverse order — the failed
step's own first (it may have done part of its work), then those that succeeded — each as
an ordinary step row (phase `compensation`) with the step's timeout and retries, under the
same device locks. The run ends `compensated` when all of them succeeded, else `failed`
with the compensation failures listed. A fan-out step is undone on each of its devices
that succeeded, paced (jobs/engine/fanout_rollback.py, declared with
`kinds.step_compensation`).
"""

from __future__ import annotations

from django.db.models import Count
from django.utils import timezone

from .. import templating
from ..events import event_record
from ..models import JobRun, OnFailure, Phase, RunStatus, StepRun, StepStatus
from .batch import row_create
from .effects import NewRow
from .kinds import failure_policy, row_ended, spec_behaviour, step_compensation_handler
from .plan import step_args

# Step outcomes whose effects a compensation may have to undo.
UNDOABLE = (StepStatus.SUCCEEDED, StepStatus.FAILED, StepStatus.TIMED_OUT)


@failure_policy(OnFailure.ROLLBACK)
def rollback_start(run: JobRun, reason: str) -> None:
    """The failure policy `rollback`: the run starts compensating its steps."""
    if not JobRun.objects.filter(pk=run.pk, status=RunStatus.RUNNING).update(
        status=RunStatus.COMPENSATING, error=reason
    ):
        return
    run.status, run.error = RunStatus.COMPENSATING, reason
    event_record("run.compensating", run=run, message=reason)
    compensation_next(run=run)


def compensation_next(*, run: JobRun) -> None:
    """Go on with the compensations (highest index first): the step being undone reports
    whether it is still at work, else the next one starts; the run ends when none is left.

    A step is undone by its kind's `step_compensation` when it declared one (a fan-out: a
    row per device, jobs/engine/fanout_rollback.py), else by one compensation row
    (`command_compensate`). Each is asked again at every call and answers from its rows,
    so a call that comes twice (two rows ending together, the monitor's sweep) starts
    nothing twice.
    """
    run.refresh_from_db(fields=["status", "error"])
    if run.status != RunStatus.COMPENSATING:
        return
    ran = (
        StepRun.objects.filter(run=run, phase=Phase.FORWARD, status__in=UNDOABLE, attempt__gt=0)
        .order_by("-index")
        .values_list("index", flat=True)
        .distinct()
    )
    for index in ran:
        spec = run.plan[index]
        if not spec.get("compensation_action") or not spec_behaviour(spec).compensable:
            continue
        compensate = step_compensation_handler(spec) or command_compensate
        if compensate(run, index):
            return  # at work: its rows call back when they end
    _rollback_finish(run, StepRun.objects.filter(run=run, phase=Phase.COMPENSATION))


def command_compensate(run: JobRun, index: int) -> bool:
    """Undo a step with one compensation row on its device; True while that row is at work."""
    existing = StepRun.objects.filter(run=run, phase=Phase.COMPENSATION, index=index).first()
    if existing is not None:
        return not existing.is_terminal
    forward = (
        StepRun.objects.select_related("device")
        .filter(run=run, phase=Phase.FORWARD, index=index, status__in=UNDOABLE, attempt__gt=0)
        .first()
    )
    if forward is None:
        return False
    spec = run.plan[index]
    try:
        args = step_args(run, spec["compensation_args"], forward.device)
    except templating.TemplateError as exc:
        # e.g. it reads a result the failed step never produced: record, never send garbage
        _compensation_refused(run, forward, spec["compensation_action"], str(exc))
        return False
    step_run = row_create(
        NewRow(run, index, forward.device, spec["compensation_action"], args, phase=Phase.COMPENSATION)
    )
    return not step_run.is_terminal


def _compensation_refused(run: JobRun, forward: StepRun, action: str, reason: str) -> None:
    StepRun.objects.get_or_create(
        run=run,
        phase=Phase.COMPENSATION,
        index=forward.index,
        device=forward.device,
        defaults={
            "action": action,
            "status": StepStatus.FAILED,
            "error": reason,
            "finished_at": timezone.now(),
        },
    )
    event_record(
        "step.failed", run=run, device=forward.device_name, message=f"compensation {action}: {reason}"
    )


# Devices a failed compensation of one step names in the run's error; the others are counted.
FAILURES_NAMED = 10


def compensation_failures(failed: list[tuple[int, str, str, str, str]], totals: dict[int, int]) -> list[str]:
    """How the compensations that did not succeed read on the run, one entry per step,
    highest index first, from (index, action, device, status, error) and each step's count
    of compensation rows: a step undone by one row as "step 1 undo: failed boom"; one
    undone on several devices (a fan-out) as "step 2 undo: 2 of 5 devices not rolled back:
    gw-3 failed boom; gw-4 timed_out …", at most FAILURES_NAMED devices named."""
    by_step: dict[tuple[int, str], list[tuple[str, str, str]]] = {}
    for index, action, device, status, error in sorted(failed, key=lambda r: (-r[0], r[2])):
        by_step.setdefault((index, action), []).append((device, status, error))
    lines = []
    for (index, action), rows in by_step.items():
        total = totals.get(index, len(rows))
        if total == 1:
            lines.append(f"step {index} {action}: {rows[0][1]} {rows[0][2]}".strip())
            continue
        named = "; ".join(
            f"{device} {status} {error}".strip() for device, status, error in rows[:FAILURES_NAMED]
        )
        more = f"; and {len(rows) - FAILURES_NAMED} more" if len(rows) > FAILURES_NAMED else ""
        lines.append(f"step {index} {action}: {len(rows)} of {total} devices not rolled back: {named}{more}")
    return lines


def _rollback_finish(run: JobRun, compensations) -> None:
    failed = compensations.exclude(status=StepStatus.SUCCEEDED).values_list(
        "index", "action", "device__name", "status", "error"
    )
    failed = [(i, a, d or "", s, e) for i, a, d, s, e in failed]
    totals = dict(compensations.order_by().values_list("index").annotate(n=Count("pk"))) if failed else {}
    failures = compensation_failures(failed, totals)
    status = RunStatus.FAILED if failures else RunStatus.COMPENSATED
    error = run.error + ("; compensation failed: " + "; ".join(failures) if failures else "")
    if JobRun.objects.filter(pk=run.pk, status=RunStatus.COMPENSATING).update(
        status=status, error=error, finished_at=timezone.now()
    ):
        event_record(f"run.{status}", run=run, message=error)


@row_ended(Phase.COMPENSATION)
def compensation_ended(step_run: StepRun) -> None:
    compensation_next(run=step_run.run)
