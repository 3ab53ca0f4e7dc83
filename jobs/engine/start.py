"""Starting steps: the row of the step at a run's cursor, by kind, then its dispatch.

A step kind (command, delay, wait_online, fanout, task) declares how it starts with
`@kinds.step_kind` beside its definition; `step_start` looks the kind up instead of
branching on it. A starter
either starts the step (rows created once: a redelivered task changes nothing) or refuses
it with a reason (no such device, a reference with no value), which the caller turns into
the step's failure (jobs/engine/runs.py).
"""

from __future__ import annotations

from django.db import IntegrityError, transaction
from django.utils import timezone

from devices.models import Device

from .. import templating
from ..events import event_record
from ..models import JobRun, Phase, StepRun
from .kinds import spec_behaviour
from .plan import queued_message, queued_row, step_args, step_target


class StepRefused(Exception):
    """The step cannot start; `device` and the message say why (it fails at once)."""

    def __init__(self, device: str, reason: str) -> None:
        super().__init__(reason)
        self.device = device


def step_start(*, run: JobRun, index: int) -> None:
    """Start the run's step at `index` by its kind; raises StepRefused."""
    spec_behaviour(run.plan[index]).start(run, index)


def step_row_start(run: JobRun, index: int) -> StepRun:
    """The row of a one-device step at `index`, its target and args resolved; StepRefused."""
    spec = run.plan[index]
    device, problem = step_target(run, spec)
    if device is None:
        raise StepRefused(spec["device"] or spec.get("device_param", ""), problem)
    try:
        args = step_args(run, spec["args"], device)
    except templating.TemplateError as exc:
        raise StepRefused(device.name, str(exc)) from None
    return step_row_create(run=run, index=index, device=device, action=spec["action"], args=args)


def step_row_create(
    *, run: JobRun, index: int, device: Device | None, action: str, args: dict, phase: str = Phase.FORWARD
) -> StepRun:
    """The queued row of a step (once), with its queue deadline; `device` None for a task
    step without one."""
    if device is None:
        # The unique constraint does not hold for a NULL device: look for the row first.
        existing = StepRun.objects.filter(run=run, phase=phase, index=index, device=None).first()
        if existing is not None:
            existing.run = run
            return existing
    fields = queued_row(run, index, device=device, action=action, args=args, phase=phase, now=timezone.now())
    try:
        # Insert first: the row usually does not exist yet. A redelivered task hits the
        # unique (run, phase, index, device) constraint and reads the row it made before.
        with transaction.atomic():
            step_run = StepRun.objects.create(**fields)
            event_record("step.queued", step_run=step_run, message=queued_message(step_run))
    except IntegrityError:
        step_run = StepRun.objects.select_related("device").get(
            run=run, phase=phase, index=index, device=device
        )
    step_run.run = run
    # Its queue deadline goes to Redis only if it has to wait (batch.rows_start): most steps get
    # their device at once. Should this process die first, the database sweep finds the row.
    return step_run
