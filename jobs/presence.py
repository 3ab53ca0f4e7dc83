"""How runs react to a device's presence: resume waiting steps, record a dropout mid-step."""

from __future__ import annotations

from django.db import transaction

from .engine.batch import rows_start
from .engine.continuous import fanouts_join_names
from .engine.kinds import row_resume_handler
from .events import event_record
from .models import STEP_IN_FLIGHT, StepRun, StepStatus


def devices_presence(changes: list[list]) -> None:
    """Devices whose presence changed ([[name, online], ...], one presence group of the bridge's):
    those back online resume their waiting steps and join the open continuous fan-outs that
    target them (one query for the batch while none is open), those gone offline have a
    dropout recorded."""
    back = [name for name, online in changes if online]
    devices_online(back)
    fanouts_join_names(back)
    devices_offline([name for name, online in changes if not online])


def devices_online(names: list[str]) -> int:
    """The devices are back: their waiting steps ask for the lock, oldest first per device.

    One query finds the waiting steps of all of them; the commands among them take their
    locks as batched transitions (`rows_start`: one transaction and one lock call per 500
    rows), a step of another kind (wait_online) resumes its own way."""
    if not names:
        return 0
    waiting = list(
        StepRun.objects.select_related("run", "device")
        .filter(device__name__in=names, status=StepStatus.QUEUED)
        .order_by("device_id", "queued_at", "pk")
    )
    steps_resume(waiting)
    return len(waiting)


def steps_resume(step_runs: list[StepRun], *, quiet: bool = False) -> None:
    """Queued steps get another chance, in the given order: a wait-for-online step checks,
    the others ask for their locks together (`rows_start`: one transition per 500 rows)."""
    asking = []
    for step_run in step_runs:
        resume = row_resume_handler(step_run)
        if resume is not None:
            resume(step_run=step_run)
        else:
            asking.append(step_run.pk)
    rows_start(asking, quiet=quiet)


@transaction.atomic
def devices_offline(names: list[str]) -> int:
    """The devices dropped off mid-step: recorded; each attempt ends by its own deadline.

    The attempt is not ended (nor the device handed on) at once: "offline" may be a network
    blip while the device goes on executing, and a next command sent then would run beside
    it. If the device comes back and answers before the deadline, the step succeeds; if not,
    the timeout retries it (or ends it) per the step's policy.
    """
    if not names:
        return 0
    in_flight = StepRun.objects.select_related("run", "device").filter(
        device__name__in=names, status__in=STEP_IN_FLIGHT
    )
    count = 0
    for step_run in in_flight:
        name = step_run.device.name
        event_record(
            "step.device_offline",
            step_run=step_run,
            message=f"device {name} went offline during the attempt; its deadline decides",
        )
        count += 1
    return count
