"""The step kind `command`: one command to one device, the kind most steps are.

A plan (jobs/engine/planner_locks.py) names a run's next command step itself (`rows_name`),
whatever moved the run on. This starter runs when the plan could not (its device missing
or disabled, a reference with no value: it refuses the step with the reason) and makes
the row the same way when the refusal no longer holds (`batch.row_create`).
"""

from __future__ import annotations

from ..models import JobRun, StepKind
from .batch import step_row_queue
from .kinds import step_kind


@step_kind(StepKind.COMMAND, batched_start=True, batched_dispatch=True)
def command_start(run: JobRun, index: int) -> None:
    """A command step on one device: its queued row asking for the device's lock, one plan."""
    step_row_queue(run, index)
