"""Fleet fan-out: one step sent to every device of a group or label selector.

The step expands into one row per device (status `pending`). The pump starts rows while
the rollout rate (devices per minute) and max-in-flight allow; each started row is an
ordinary step (queued on its device's lock, so busy devices simply queue). When a row
ends, progress is evaluated: past the abort threshold the pending rows are skipped and the
step fails with the failure breakdown; when all rows ended, the success criterion decides.
Pumps of one fan-out are serialized by a row lock on the run (SQLite: by its write lock).
"""

from __future__ import annotations

from collections import Counter
from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from .. import templating
from ..deadlines import Deadline, deadlines_set
from ..events import event_record
from ..models import STEP_TERMINAL, JobRun, Phase, StepRun, StepStatus
from .dispatch import step_acquire
from .plan import fanout_devices, step_args
from .runs import row_ended_register, run_step_done
from .start import StepRefused, step_kind_register

# The window of the rollout rate.
RATE_WINDOW = timedelta(minutes=1)
ACTIVE = (StepStatus.QUEUED, StepStatus.DISPATCHED, StepStatus.IN_PROGRESS, StepStatus.RETRYING)


def _rows(run: JobRun, index: int):
    return StepRun.objects.filter(run=run, phase=Phase.FORWARD, index=index)


def fanout_start(run: JobRun, index: int) -> None:
    """Expand the step into one pending row per device, then pump; StepRefused when none."""
    spec = run.plan[index]
    if _rows(run, index).exists():  # started before (a redelivered task): just pump
        fanout_pump(run=run, index=index)
        return
    devices = fanout_devices(spec)
    if not devices:
        target = f"group {spec['group']}" if spec.get("group") else f"labels {spec['labels']}"
        raise StepRefused("", f"no enabled device matches {target}")
    rows = []
    for device in devices:
        try:
            args = step_args(run, spec["args"], device)
        except templating.TemplateError as exc:
            raise StepRefused(device.name, str(exc)) from None
        rows.append(StepRun(run=run, index=index, device=device, action=spec["action"], args=args))
    StepRun.objects.bulk_create(rows, ignore_conflicts=True)
    event_record("step.fanout", run=run, message=f"{spec['action']} to {len(devices)} devices", index=index)
    fanout_pump(run=run, index=index)


def fanout_pump(*, run: JobRun, index: int) -> int:
    """Start as many pending rows as the rollout rate and max-in-flight allow."""
    spec = run.plan[index]
    now = timezone.now()
    with transaction.atomic():
        JobRun.objects.select_for_update().filter(pk=run.pk).first()
        rows = _rows(run, index)
        room = len(rows)
        if spec.get("max_in_flight"):
            room = min(room, spec["max_in_flight"] - rows.filter(status__in=ACTIVE).count())
        rate = spec.get("rollout_per_minute") or 0
        window = rows.filter(queued_at__gt=now - RATE_WINDOW)
        if rate:
            room = min(room, rate - window.count())
        pending = list(rows.filter(status=StepStatus.PENDING).order_by("pk").values_list("pk", flat=True))
        start = pending[: max(0, room)]
        deadline = now + timedelta(seconds=spec["queue_timeout_seconds"])
        rows.filter(pk__in=start, status=StepStatus.PENDING).update(
            status=StepStatus.QUEUED, queued_at=now, deadline=deadline
        )
        if rate and len(pending) > len(start) and window.exists():
            oldest = window.order_by("queued_at").values_list("queued_at", flat=True).first()
            anchor = pending[len(start)]
            deadlines_set({Deadline("pump", anchor, 0): oldest + RATE_WINDOW})
    for step_run in StepRun.objects.select_related("run", "device").filter(pk__in=start):
        step_acquire(step_run=step_run)
    return len(start)


def fanout_summary(run: JobRun, index: int) -> tuple[Counter, Counter]:
    """(rows by status, failure reasons by count) of one fan-out step."""
    rows = _rows(run, index)
    by_status = Counter(rows.values_list("status", flat=True))
    failed = rows.filter(status__in=(StepStatus.FAILED, StepStatus.TIMED_OUT)).values_list(
        "error", "device__name"
    )
    # "no done from pump-17 within 30s" and "... pump-18 ..." are one reason, not two.
    reasons = Counter(error.replace(device, "<device>") if device else error for error, device in failed)
    return by_status, reasons


def fanout_row_ended(step_run: StepRun) -> None:
    fanout_progress(run=step_run.run, index=step_run.index)


def fanout_progress(*, run: JobRun, index: int) -> None:
    """A device's row ended for good: abort, pump more, or decide the step."""
    spec = run.plan[index]
    by_status, reasons = fanout_summary(run, index)
    total = sum(by_status.values())
    succeeded = by_status[StepStatus.SUCCEEDED]
    ended = sum(by_status[s] for s in STEP_TERMINAL if s != StepStatus.SKIPPED)
    failed = ended - succeeded
    breakdown = ", ".join(f"{n}x {reason}" for reason, n in reasons.most_common(5))
    threshold = spec.get("abort_failure_percent")
    if (
        threshold is not None
        and ended >= max(1, spec.get("abort_min_devices") or 0)
        and failed * 100 > threshold * ended
    ):
        skipped = (
            _rows(run, index)
            .filter(status=StepStatus.PENDING)
            .update(status=StepStatus.SKIPPED, error="rollout aborted", finished_at=timezone.now())
        )
        error = (
            f"step {index}: rollout aborted, {failed} of {ended} devices failed (> {threshold}%): {breakdown}"
        )
        if skipped:
            event_record(
                "step.aborted", run=run, message=f"{error}; {skipped} devices not started", index=index
            )
        run_step_done(run=run, index=index, ok=False, status=StepStatus.FAILED, error=error)
        return
    if by_status[StepStatus.PENDING] or any(by_status[s] for s in ACTIVE):
        if by_status[StepStatus.PENDING]:
            fanout_pump(run=run, index=index)
        return
    ok = succeeded * 100 >= spec.get("success_percent", 100) * total
    message = f"{succeeded} of {total} devices succeeded" + (f"; failures: {breakdown}" if failed else "")
    event_record("step.fanout_done", run=run, message=message, index=index, by_status=dict(by_status))
    run_step_done(
        run=run,
        index=index,
        ok=ok,
        status=StepStatus.SUCCEEDED if ok else StepStatus.FAILED,
        error=f"step {index}: {message}",
    )


step_kind_register("fanout", fanout_start)
row_ended_register("fanout", fanout_row_ended)
