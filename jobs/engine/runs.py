"""Continuing runs: after a step row ended for good, move the run on, roll it back or end it.

A run is a database state machine: `cursor` is the index of its current step. A step's
outcome decides the run (`run_step_done`): the next step starts, the run rolls back (a
failure policy, `@kinds.failure_policy` in jobs/engine/rollback.py) or the run ends. Rows
that are not a step's whole outcome (one device of a fan-out, a compensation) report to the
handler their kind declared with `@kinds.row_ended` instead. Every run transition is a
compare-and-set, so a task that runs twice changes nothing.

Run:   pending -> running -> succeeded | failed | timed_out | canceled
                         \\-> compensating -> compensated | failed
"""

from __future__ import annotations

from dataclasses import dataclass

from django.utils import timezone

from ..events import event_record
from ..models import JobRun, OnFailure, RunStatus, StepRun, StepStatus
from .kinds import REGISTRY, row_ended_handler
from .plan import RUN_ACTIVE
from .start import StepRefused, step_start

# Statuses a final step outcome maps to on the run when the step's policy aborts it.
RUN_STATUS_FOR_STEP = {StepStatus.TIMED_OUT: RunStatus.TIMED_OUT}


def run_step_enter(*, run: JobRun, index: int) -> None:
    """Start the step at `index`, or end the run when the plan is done; a refusal fails it."""
    if index >= len(run.plan):
        run_finish(run=run, status=RunStatus.SUCCEEDED)
        return
    try:
        step_start(run=run, index=index)
    except StepRefused as refused:
        event_record("step.failed", run=run, device=refused.device, message=str(refused), index=index)
        run_step_done(
            run=run, index=index, ok=False, status=StepStatus.FAILED, error=f"step {index}: {refused}"
        )


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
    """A step's final outcome decides its run: the next step, the end, or its policy. The
    general path (`run_step_done`) and a plan (jobs/engine/planner.py) decide alike
    through this."""
    policy = run.plan[index].get("on_failure", OnFailure.ABORT)
    if ok or policy == OnFailure.CONTINUE:
        if index + 1 >= len(run.plan):
            return RunNext(cursor=index + 1, status=RunStatus.SUCCEEDED)
        return RunNext(cursor=index + 1)
    if policy != OnFailure.ABORT:
        return RunNext(policy=policy)
    return RunNext(status=RUN_STATUS_FOR_STEP.get(status, RunStatus.FAILED), error=error)


def run_step_done(*, run: JobRun, index: int, ok: bool, status: str, error: str = "") -> None:
    """A step's outcome decides the run (`run_next`): next step, its failure policy, or end (once)."""
    decided = run_next(run, index, ok=ok, status=status, error=error)
    if decided.policy:
        REGISTRY.failure_policies[decided.policy](run, error)
    elif decided.cursor is not None:
        if JobRun.objects.filter(pk=run.pk, status=RunStatus.RUNNING, cursor=index).update(
            cursor=decided.cursor
        ):
            run.cursor = decided.cursor
            run_step_enter(run=run, index=run.cursor)
    else:
        run_finish(run=run, status=decided.status, error=decided.error)


def step_error(step_run: StepRun) -> str:
    """How a step's failure reads on its run."""
    where = f"{step_run.device_name} {step_run.action}"
    return f"step {step_run.index} ({where}) {step_run.status}: {step_run.error}"


def run_continue(*, step_run: StepRun) -> None:
    """After a step row ended for good: move its run on (once)."""
    if step_run.status == StepStatus.CANCELED:
        return
    ended = row_ended_handler(step_run)
    if ended is not None:
        ended(step_run)
        return
    run_step_done(
        run=step_run.run,
        index=step_run.index,
        ok=step_run.status == StepStatus.SUCCEEDED,
        status=step_run.status,
        error=step_error(step_run),
    )
