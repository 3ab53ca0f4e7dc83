"""How runs react to a device's presence: resume waiting steps, record a dropout mid-step."""

from __future__ import annotations

from django.db import transaction

from .engine.dispatch import step_acquire
from .engine.plan import step_spec
from .engine.waits import wait_online_check
from .events import event_record
from .models import STEP_IN_FLIGHT, StepKind, StepRun, StepStatus


@transaction.atomic
def device_online(*, name: str) -> int:
    """The device is back: its waiting steps ask for the lock, oldest first."""
    waiting = (
        StepRun.objects.select_related("run", "device")
        .filter(device__name=name, status=StepStatus.QUEUED)
        .order_by("queued_at", "pk")
    )
    count = 0
    for step_run in waiting:
        step_resume(step_run=step_run)
        count += 1
    return count


def step_resume(*, step_run: StepRun, quiet: bool = False) -> None:
    """A queued step gets another chance: a wait-for-online step checks, a command asks for the lock."""
    if step_spec(step_run).get("kind") == StepKind.WAIT_ONLINE:
        wait_online_check(step_run=step_run)
    else:
        step_acquire(step_run=step_run, quiet=quiet)


@transaction.atomic
def device_offline(*, name: str) -> int:
    """The device dropped off mid-step: recorded; the attempt ends by its own deadline.

    The attempt is not ended (nor the device handed on) at once: "offline" may be a network
    blip while the device goes on executing, and a next command sent then would run beside
    it. If the device comes back and answers before the deadline, the step succeeds; if not,
    the timeout retries it (or ends it) per the step's policy.
    """
    in_flight = StepRun.objects.select_related("run", "device").filter(
        device__name=name, status__in=STEP_IN_FLIGHT
    )
    count = 0
    for step_run in in_flight:
        event_record(
            "step.device_offline",
            step_run=step_run,
            message=f"device {name} went offline during the attempt; its deadline decides",
        )
        count += 1
    return count
