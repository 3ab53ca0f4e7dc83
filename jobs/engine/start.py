"""Starting steps the general way: the step at a run's cursor, by kind.

A step kind (command, delay, wait_online, fanout, task) declares how it starts with
`@kinds.step_kind` beside its definition; `step_start` looks the kind up instead of
branching on it. A starter either starts the step (its rows made once, as a plan:
jobs/engine/batch.py `row_create`; a redelivered task changes nothing) or refuses it with a
reason (no such device, a reference with no value), which the caller turns into the step's
failure (jobs/engine/batch.py `run_step_enter`).
"""

from __future__ import annotations

from devices.models import Device

from .. import templating
from ..models import JobRun
from .kinds import spec_behaviour
from .plan import step_args, step_target


class StepRefused(Exception):
    """The step cannot start; `device` and the message say why (it fails at once)."""

    def __init__(self, device: str, reason: str) -> None:
        super().__init__(reason)
        self.device = device


def step_start(*, run: JobRun, index: int) -> None:
    """Start the run's step at `index` by its kind; raises StepRefused."""
    spec_behaviour(run.plan[index]).start(run, index)


def step_row_inputs(run: JobRun, index: int) -> tuple[Device | None, dict]:
    """The device of the step at `index` (None: a task step with no target) and its
    rendered args, for its row (`batch.row_create`); raises StepRefused."""
    spec = run.plan[index]
    device = None
    if spec.get("device") or spec.get("device_param"):
        device, problem = step_target(run, spec)
        if device is None:
            raise StepRefused(spec["device"] or spec.get("device_param", ""), problem)
    try:
        args = step_args(run, spec["args"], device)
    except templating.TemplateError as exc:
        raise StepRefused(device.name if device is not None else "", str(exc)) from None
    return device, args
