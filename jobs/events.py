"""Writing the run timeline: one RunEvent per transition or dropped message."""

from __future__ import annotations

import logging
from typing import Any

from .models import JobRun, RunEvent, StepRun

log = logging.getLogger("jobs.timeline")


def event_record(
    kind: str,
    *,
    run: JobRun | None = None,
    step_run: StepRun | None = None,
    device: str = "",
    message: str = "",
    **data: Any,
) -> RunEvent:
    """Append an event and log it with the run, step, device and command id it concerns."""
    if step_run is not None:
        run_id = step_run.run_id
        device = device or step_run.device_name
        data.setdefault("index", step_run.index)
        data.setdefault("attempt", step_run.attempt)
        if step_run.command_id:
            data.setdefault("command_id", step_run.command_id)
    else:
        run_id = run.pk if run is not None else None
    log.info(
        "%s run=%s device=%s %s %s",
        kind,
        run_id or "-",
        device or "-",
        message,
        data,
        extra={"run_id": str(run_id or ""), "device": device, "event": kind},
    )
    return RunEvent.objects.create(
        run_id=run_id, step_run=step_run, kind=kind, device=device, message=message, data=data
    )
