"""Rollback: when a step fails for good under policy `rollback`, undo what succeeded.

The compensations of the steps that ran run one at a time in reverse order — the failed
step's own first (it may have done part of its work), then those that succeeded — each as
an ordinary step row (phase `compensation`) with the step's timeout and retries, under the
same device locks. The run ends `compensated` when all of them succeeded, else `failed`
with the compensation failures listed. Fan-out steps have no compensation.
"""

from __future__ import annotations

from django.utils import timezone

from .. import templating
from ..events import event_record
from ..models import STEP_TERMINAL, JobRun, OnFailure, Phase, RunStatus, StepRun, StepStatus
from .batch import rows_start
from .kinds import failure_policy, row_ended, spec_behaviour
from .plan import step_args
from .start import step_row_create

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
    """Start the next compensation (highest index first), or end the run when none is left."""
    run.refresh_from_db(fields=["status", "error"])
    if run.status != RunStatus.COMPENSATING:
        return
    compensations = StepRun.objects.filter(run=run, phase=Phase.COMPENSATION)
    if compensations.exclude(status__in=STEP_TERMINAL).exists():
        return  # one at a time: the running one calls back when it ends
    done = set(compensations.values_list("index", flat=True))
    ran = (
        StepRun.objects.select_related("device")
        .filter(run=run, phase=Phase.FORWARD, status__in=UNDOABLE, attempt__gt=0)
        .order_by("-index")
    )
    for forward in ran:
        spec = run.plan[forward.index]
        if (
            not spec.get("compensation_action")
            or forward.index in done
            or not spec_behaviour(spec).compensable
        ):
            continue
        try:
            args = step_args(run, spec["compensation_args"], forward.device)
        except templating.TemplateError as exc:
            # e.g. it reads a result the failed step never produced: record, never send garbage
            _compensation_refused(run, forward, spec["compensation_action"], str(exc))
            continue
        step_run = step_row_create(
            run=run,
            index=forward.index,
            device=forward.device,
            action=spec["compensation_action"],
            args=args,
            phase=Phase.COMPENSATION,
        )
        if step_run.status == StepStatus.QUEUED:
            rows_start([step_run.pk])
        return
    _rollback_finish(run, compensations)


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


def _rollback_finish(run: JobRun, compensations) -> None:
    failures = [
        f"step {c.index} {c.action}: {c.status} {c.error}".strip()
        for c in compensations.exclude(status=StepStatus.SUCCEEDED).order_by("-index")
    ]
    status = RunStatus.FAILED if failures else RunStatus.COMPENSATED
    error = run.error + ("; compensation failed: " + "; ".join(failures) if failures else "")
    if JobRun.objects.filter(pk=run.pk, status=RunStatus.COMPENSATING).update(
        status=status, error=error, finished_at=timezone.now()
    ):
        event_record(f"run.{status}", run=run, message=error)


@row_ended(Phase.COMPENSATION)
def compensation_ended(step_run: StepRun) -> None:
    compensation_next(run=step_run.run)
