"""A run's own time window: its start-not-before and its end-by, as run deadlines.

`run_start` (jobs/services.py) records both on the run and, after the commit, sets a
`start` deadline at the start-not-before (instead of starting the run at once) and an
`end` deadline at the end-by (`run_window_deadlines_set`). The monitor claims them like
any deadline (jobs/deadlines.py); the handlers here check the run before they act, so a
deadline that fires late or twice changes nothing.

How it fails: the deadlines live in Redis; a lost one is found again from the database by
the monitor's reconcile pass (jobs/monitor.py: pending runs due to start, runs past their
end-by).
"""

from __future__ import annotations

from datetime import datetime

from django.utils import timezone

from .deadlines import Deadline, deadlines_set
from .engine.batch import run_end_by_apply
from .engine.continuous import fanout_close
from .engine.kinds import run_deadline
from .inbox import run_enqueue
from .models import JobRun, RunStatus

# Who closed a continuous fan-out at its run's end-by (its `step.fanout_closed` event).
RUN_END_BY = "the run's end-by"


def run_window_deadlines(run: JobRun, *, now: datetime) -> dict[Deadline, datetime]:
    """The run's `start` (a start-not-before still ahead) and `end` deadlines."""
    deadlines = {}
    if run.not_before is not None and run.not_before > now:
        deadlines[Deadline("start", str(run.pk), 0)] = run.not_before
    if run.end_by is not None:
        deadlines[Deadline("end", str(run.pk), 0)] = run.end_by
    return deadlines


def run_window_deadlines_set(run: JobRun) -> bool:
    """Set the run's deadlines after its commit; True when its start waits for one."""
    deadlines = run_window_deadlines(run, now=timezone.now())
    deadlines_set(deadlines)
    return any(deadline.kind == "start" for deadline in deadlines)


@run_deadline("start")
def run_start_due(run_id: str) -> None:
    """The `start` deadline: a run still pending starts now (through the engine's inbox)."""
    if JobRun.objects.filter(pk=run_id, status=RunStatus.PENDING).exists():
        run_enqueue(run_id)


@run_deadline("end")
def run_end_due(run_id: str) -> None:
    """The `end` deadline: the run's end behaviour decides (planner.run_end_by_plan). A run
    that lets its commands at work finish closes its open continuous fan-out too: no device
    joins it any more, and it is decided once its rows at work have ended."""
    if not run_end_by_apply(run_id):
        return
    run = JobRun.objects.filter(pk=run_id, status=RunStatus.RUNNING).first()
    if run is not None and any(step.get("continuous") for step in run.plan):
        while fanout_close(run=run, by=RUN_END_BY) is not None:
            pass
