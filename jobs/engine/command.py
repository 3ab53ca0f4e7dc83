"""The step kind `command`: one command to one device, the kind most steps are.

A plan (jobs/engine/planner.py) starts a run's next command step itself when the step
before it ended in the same transition (`rows_name`). When the general path starts one
(after a fan-out or a rollback decided the run's next step, or the step at a running run's
cursor is restarted by hand), this is its starter: the queued row, then the device's lock
as a transition of its own (`batch.rows_start`).
"""

from __future__ import annotations

from ..models import JobRun, StepKind, StepStatus
from .batch import rows_start
from .kinds import step_kind
from .start import step_row_start


@step_kind(StepKind.COMMAND, batched_start=True, batched_dispatch=True)
def command_start(run: JobRun, index: int) -> None:
    """A command step on one device: its queued row, then the device's lock."""
    step_run = step_row_start(run, index)
    if step_run.status == StepStatus.QUEUED:
        rows_start([step_run.pk])
