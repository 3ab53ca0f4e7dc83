"""What a step's final outcome does to its run (`run_next`), and ending a run (`run_finish`).

A run is a database state machine: `cursor` is the index of its current step. A step's
outcome decides the run: the next step starts, the run rolls back (a failure policy,
`@kinds.failure_policy` in jobs/engine/rollback.py) or the run ends. The planner asks
`run_next` (jobs/engine/planner.py `steps_decide`), and a plan writes the decision as a
compare-and-set, so a task that runs twice changes nothing.

Run:   pending -> running -> succeeded | failed | timed_out | canceled
                         \\-> compensating -> compensated | failed
"""

from __future__ import annotations

from dataclasses import dataclass

from django.utils import timezone

from ..events import event_record
from ..models import JobRun, OnFailure, RunStatus, StepRun, StepStatus
from .plan import RUN_ACTIVE

# Statuses a final step outcome maps to on the run when the step's policy aborts it.
RUN_STATUS_FOR_STEP = {StepStatus.TIMED_OUT: RunStatus.TIMED_OUT}


def run_finish(*, run: JobRun, status: str, error: str = "") -> bool:
    """Move a run to a terminal status (once); False when it already was terminal."""
    finished = JobRun.objects.filter(pk=run.pk, status__in=(RunStatus.PENDING, *RUN_ACTIVE)).update(
        status=status, error=error, finished_at=timezone.now()
    )
    if finished:
        run.status, run.error = status, error
        event_record(f"run.{status}", run=run, message=error)
    return bool(finished)


@dataclass(frozen=True)
class RunNext:
    """What a step's final outcome does to its run: the `cursor` it moves to (past the last
    step when the run ends succeeded), the run's terminal `status` (with `error`), or a
    failure `policy` other than abort / continue that decides instead."""

    cursor: int | None = None
    status: str = ""
    error: str = ""
    policy: str = ""


def run_next(run: JobRun, index: int, *, ok: bool, status: str, error: str) -> RunNext:
    """A step's final outcome decides its run: the next step, the end, or its policy (the
    planner asks, jobs/engine/planner.py `steps_decide`)."""
    policy = run.plan[index].get("on_failure", OnFailure.ABORT)
    if ok or policy == OnFailure.CONTINUE:
        if index + 1 >= len(run.plan):
            return RunNext(cursor=index + 1, status=RunStatus.SUCCEEDED)
        return RunNext(cursor=index + 1)
    if policy != OnFailure.ABORT:
        return RunNext(policy=policy)
    return RunNext(status=RUN_STATUS_FOR_STEP.get(status, RunStatus.FAILED), error=error)


def step_error(step_run: StepRun) -> str:
    """How a step's failure reads on its run."""
    where = f"{step_run.device_name} {step_run.action}"
    return f"step {step_run.index} ({where}) {step_run.status}: {step_run.error}"
