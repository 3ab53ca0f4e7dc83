"""Due deadlines: what the monitor's claim of a deadline does, by kind (jobs/deadlines.py).

`ack`, `done`, `retry`, `dispatch` and `queue` are planned (jobs/engine/planner.py
`dues_plan`, applied by `batch.deadlines_apply`: no handler). The other kinds have one
handler each, declared with `@kinds.deadline_handler` beside what it acts on: `send` here,
`wake` with the delay step (waits.py), `pump` with the fan-out (fanout.py), `soak` with what
a fan-out row's end decides (fanout_progress.py). A step kind may take over every due
deadline of its rows (`@kinds.row_deadline`: a delay ends whatever found it due). A handler
acts only if the step is still where the deadline expected it (same attempt, the status the
deadline guards): a deadline that fires late, twice, or after its step moved on changes
nothing. Kinds that name a run (`run`: max_duration) have their handler declared by the
module that owns the action (`@kinds.run_deadline`, jobs/cancel.py), which checks the run
likewise.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from ..deadlines import RUN_KINDS, Deadline, deadlines_clear, deadlines_set
from ..events import event_record
from ..models import StepRun, StepStatus
from .batch import deadlines_apply
from .dispatch import SEND_CHECK_SECONDS
from .kinds import REGISTRY, deadline_handler
from .plan import spec_kind
from .publish import attempts_send, publications_open


@deadline_handler("send")
def _send_due(step_run: StepRun, deadline: Deadline) -> None:
    """Send again an attempt whose send was never confirmed, while it is current and its
    deadline ahead (past it, the `done` deadline times it out). The `send` deadline is set
    again first: it stays until this send is confirmed (jobs/engine/publish.py)."""
    if step_run.status != StepStatus.DISPATCHED:
        return
    now = timezone.now()
    if step_run.deadline is not None and step_run.deadline <= now:
        return
    event_record("step.resent", step_run=step_run, message="publish was not confirmed; sending again")
    deadlines_set({deadline: now + timedelta(seconds=SEND_CHECK_SECONDS)})
    with publications_open() as publications:
        confirmed, failed = attempts_send(publications, [step_run])
    deadlines_clear(confirmed)
    for row, failure in failed:
        event_record("step.publish_failed", step_run=row, message=failure)


log = logging.getLogger(__name__)


def step_deadlines(deadlines: list[Deadline]) -> None:
    """Due deadlines claimed together: the attempts they time out and the retries they
    start as one transition (jobs/engine/batch.py `deadlines_apply`), the rest one at a
    time; one failing does not stop the others."""
    try:
        left = deadlines_apply(deadlines)
    except Exception:
        # Each is applied on its own instead (a batch of one for those a plan decides): one
        # whose row moved meanwhile changes nothing.
        log.exception("a batch of %d deadlines failed; applying them one at a time", len(deadlines))
        left = []
        for deadline in deadlines:
            try:
                left += deadlines_apply([deadline])
            except Exception:
                log.exception("deadline %s failed; the database sweep will find its step again", deadline)
    for deadline in left:
        try:
            step_deadline(deadline=deadline)
        except Exception:
            log.exception("deadline %s failed; the database sweep will find its step again", deadline.member)


def step_deadline(*, deadline: Deadline) -> None:
    """Act on a due deadline if the step (or run) is still where the deadline expected it.

    A run's deadline is a transition of its own (it publishes after its commit); a row's is
    handled in one transaction."""
    if deadline.kind in RUN_KINDS:
        REGISTRY.run_deadlines[deadline.kind](str(deadline.step_run_id))
        return
    _row_deadline(deadline)


@transaction.atomic
def _row_deadline(deadline: Deadline) -> None:
    step_run = StepRun.objects.select_related("run", "device").filter(pk=deadline.step_run_id).first()
    if step_run is None or step_run.attempt != deadline.attempt:
        return
    kind = spec_kind(step_run.run.plan[step_run.index])
    handler = REGISTRY.row_deadlines.get(kind) or REGISTRY.deadline_handlers[deadline.kind]
    handler(step_run, deadline)
