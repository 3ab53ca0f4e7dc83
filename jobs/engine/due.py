"""Due deadlines: what the monitor's claim of a deadline does, by kind (jobs/deadlines.py).

Each kind has one handler in `DEADLINE_HANDLERS`. A handler acts only if the step is still
where the deadline expected it (same attempt, the status the deadline guards): a deadline
that fires late, twice, or after its step moved on changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable

from django.db import transaction

from ..deadlines import Deadline
from ..models import STEP_IN_FLIGHT, StepRun, StepStatus
from .attempts import step_queue_timeout, step_requeue
from .dispatch import command_resend, dispatch_if_holding
from .fanout import fanout_pump
from .plan import step_spec
from .runs import attempt_end_continue, run_continue
from .waits import delay_end


def _send_due(step_run: StepRun, deadline: Deadline) -> None:
    command_resend(step_run=step_run, attempt=deadline.attempt)


def _answer_due(step_run: StepRun, deadline: Deadline) -> None:
    """No ack / no done in time: the attempt times out (retried if it has budget)."""
    if step_run.status not in STEP_IN_FLIGHT:
        return
    spec = step_spec(step_run)
    waited = spec["ack_timeout_seconds"] if deadline.kind == "ack" else spec["timeout_seconds"]
    attempt_end_continue(
        step_run=step_run,
        command_id=step_run.command_id,
        ok=False,
        error=f"no {deadline.kind} from {step_run.device.name} within {waited}s",
        retryable=True,
        timed_out=True,
    )


def _retry_due(step_run: StepRun, deadline: Deadline) -> None:
    if step_run.status == StepStatus.RETRYING:
        step_requeue(step_run=step_run)


def _queue_due(step_run: StepRun, deadline: Deadline) -> None:
    if step_run.status == StepStatus.QUEUED and step_queue_timeout(step_run=step_run):
        run_continue(step_run=step_run)


def _dispatch_due(step_run: StepRun, deadline: Deadline) -> None:
    if step_run.status == StepStatus.QUEUED:
        dispatch_if_holding(step_run)


def _pump_due(step_run: StepRun, deadline: Deadline) -> None:
    fanout_pump(run=step_run.run, index=step_run.index)


def _wake_due(step_run: StepRun, deadline: Deadline) -> None:
    delay_end(step_run=step_run)


DeadlineHandler = Callable[[StepRun, Deadline], None]
DEADLINE_HANDLERS: dict[str, DeadlineHandler] = {
    "send": _send_due,
    "ack": _answer_due,
    "done": _answer_due,
    "retry": _retry_due,
    "queue": _queue_due,
    "dispatch": _dispatch_due,
    "pump": _pump_due,
    "wake": _wake_due,
}


@transaction.atomic
def step_deadline(*, deadline: Deadline) -> None:
    """Act on a due deadline if the step is still where the deadline expected it."""
    step_run = StepRun.objects.select_related("run", "device").filter(pk=deadline.step_run_id).first()
    if step_run is None or step_run.attempt != deadline.attempt:
        return
    if step_run.device_id is None:  # a delay step: whatever found it due (wake, sweep), it is over
        delay_end(step_run=step_run)
        return
    DEADLINE_HANDLERS[deadline.kind](step_run, deadline)
