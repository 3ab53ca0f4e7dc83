"""planner.steps_decide: what a step's final outcome does to its run, as a plan (no I/O)."""

from __future__ import annotations

import uuid

from django.utils import timezone

from jobs.engine import effects, planner
from jobs.models import JobRun, OnFailure, RunStatus, StepStatus


def run_at(cursor: int, *policies: str, status: str = RunStatus.RUNNING) -> JobRun:
    """A run in memory whose steps have these failure policies, at `cursor`."""
    plan = [{"action": f"step{n}", "on_failure": policy} for n, policy in enumerate(policies)]
    return JobRun(id=uuid.uuid4(), plan=plan, cursor=cursor, status=status)


def decide(run: JobRun, index: int, *, ok: bool, status: str = StepStatus.SUCCEEDED) -> effects.Plan:
    plan = effects.Plan(now=timezone.now())
    planner.steps_decide(plan, [planner.StepDone(run, index, ok, status, f"step {index}: {status}")])
    return plan


def run_writes(plan: effects.Plan) -> list[tuple[list[str], tuple]]:
    return [(w.fields, w.status_in) for w in plan.writes if w.model is JobRun]


def test_a_step_that_succeeded_moves_its_run_to_the_next_step_started_in_the_same_plan():
    run = run_at(0, OnFailure.ABORT, OnFailure.ABORT)
    plan = decide(run, 0, ok=True)
    assert run.cursor == 1 and run.status == RunStatus.RUNNING
    assert plan.starting == [run]
    assert run_writes(plan) == [(["cursor"], (RunStatus.RUNNING,))]


def test_the_last_step_that_succeeded_ends_its_run_succeeded_once():
    run = run_at(1, OnFailure.ABORT, OnFailure.ABORT)
    plan = decide(run, 1, ok=True)
    assert (run.cursor, run.status) == (2, RunStatus.SUCCEEDED)
    assert plan.starting == [] and [e.kind for e in plan.events.events] == ["run.succeeded"]
    assert run_writes(plan) == [(planner.RUN_FINISH_FIELDS, (RunStatus.RUNNING,))]


def test_a_failed_step_that_aborts_ends_its_run_failed_or_timed_out_with_its_error():
    failed, timed_out = run_at(0, OnFailure.ABORT), run_at(0, OnFailure.ABORT)
    decide(failed, 0, ok=False, status=StepStatus.FAILED)
    decide(timed_out, 0, ok=False, status=StepStatus.TIMED_OUT)
    assert (failed.status, failed.error) == (RunStatus.FAILED, "step 0: failed")
    assert timed_out.status == RunStatus.TIMED_OUT


def test_a_failed_step_whose_policy_continues_moves_its_run_on():
    run = run_at(0, OnFailure.CONTINUE, OnFailure.ABORT)
    plan = decide(run, 0, ok=False, status=StepStatus.FAILED)
    assert (run.cursor, run.status, plan.starting) == (1, RunStatus.RUNNING, [run])


def test_a_rollback_is_left_to_its_failure_policy_after_the_commit_and_writes_nothing():
    run = run_at(0, OnFailure.ROLLBACK, OnFailure.ABORT)
    plan = decide(run, 0, ok=False, status=StepStatus.FAILED)
    assert [(later.what, later.args["policy"]) for later in plan.later] == [("policy", OnFailure.ROLLBACK)]
    assert plan.writes == [] and run.status == RunStatus.RUNNING


def test_an_outcome_for_a_run_no_longer_at_that_step_or_no_longer_running_changes_nothing():
    moved_on = run_at(1, OnFailure.ABORT, OnFailure.ABORT)
    canceled = run_at(0, OnFailure.ABORT, status=RunStatus.CANCELED)
    for run, index in ((moved_on, 0), (canceled, 0)):
        plan = decide(run, index, ok=True)
        assert plan.writes == [] and plan.starting == [] and plan.later == []
    assert (moved_on.cursor, canceled.status) == (1, RunStatus.CANCELED)
