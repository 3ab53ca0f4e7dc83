"""Fleet fan-out: one step sent to every device of a group or label selector (or to the
devices that succeeded or failed in an earlier fan-out of the run: `devices_from`).

The step expands into one row per device (status `pending`). The pump starts rows while
the rollout rate (devices per minute, stepped up by an exponential ramp if the step has one)
and max-in-flight allow (the arithmetic: jobs/engine/rollout_pace.py); each started row is
an ordinary step (queued on its device's lock, so busy devices simply queue); the rows a
pump starts take their locks and publish their commands as batches (`batch.rows_start`: one
lock call and one transaction per 500 rows). Pumps of one fan-out are serialized by a row
lock on the run (SQLite: by its write lock). Stopping a rollout skips the rows not started.

What a row's end decides (abort, pump more, the next wave, the step's outcome) is
jobs/engine/fanout_progress.py, which sits above this module and jobs/engine/wave_gates.py
(a rollout's waves as it runs); a continuous fan-out (`continuous` on the step) is opened
here (jobs/engine/continuous_open.py) and joined and closed by jobs/engine/continuous.py.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from datetime import timedelta
from functools import partial
from typing import Any

from celery import current_app
from django.conf import settings
from django.db import connection, transaction
from django.db.models import Count
from django.utils import timezone

from .. import templating
from ..deadlines import Deadline, deadlines_set
from ..events import event_record
from ..models import (
    STEP_AT_WORK,
    ContinuousFanout,
    JobRun,
    Phase,
    Rollout,
    RolloutState,
    RunStatus,
    StepRun,
    StepStatus,
)
from .batch import rows_start, step_done_apply, step_refused_apply
from .continuous_open import fanout_open
from .kinds import deadline_handler, step_kind
from .plan import FANOUT, args_renderer, fanout_devices, fanout_target
from .rollout_pace import (
    FAILING,
    RATE_WINDOW,
    failure_reason,
    rollout_counts_notified,
    rollout_pace,
    rollout_ramped,
    rollout_room,
)
from .start import StepRefused
from .waves import WAVES_EXPANDED_MAX, wave_name, waves_expand

# The task that makes a fan-out's rows (jobs/tasks.py), and its time limits: sized for
# IOTQUEUE_FANOUT_MAX_DEVICES rows on a small, busy machine (100,000 took about 40 s on two
# shared cores), not for the engine's other tasks (CELERY_TASK_SOFT_TIME_LIMIT).
FANOUT_START_TASK = "jobs.fanout_start"
FANOUT_START_SOFT_SECONDS = 600
FANOUT_START_HARD_SECONDS = 660

# The wave of a retry's carried rows (succeeded in the run it retries): past any real wave
# (a rollout has at most WAVES_EXPANDED_MAX), so no wave's condition counts them.
CARRIED_WAVE = 32767

ACTIVE = STEP_AT_WORK
# A fan-out writing this many rows has the database's statistics refreshed (_statistics_refresh).
FANOUT_ANALYZE_ROWS = 1_000
# Rows a pump marks queued per UPDATE (SQLite binds at most 32,766 values in a statement).
PUMP_UPDATE_ROWS = 10_000


def fanout_rows(run: JobRun, index: int, phase: str = Phase.FORWARD):
    """The rows of fan-out step `index` in `phase` (a queryset: nothing read yet)."""
    return StepRun.objects.filter(run=run, phase=phase, index=index)


def fanout_rollout(run: JobRun, index: int) -> Rollout | None:
    """The `Rollout` row of a fan-out step in waves (None: no waves, or not split yet)."""
    return Rollout.objects.filter(run=run, index=index).first()


# Its rows are commands the batched path dispatches (its pump: batch.rows_start); a rollback
# undoes it on each device that succeeded (jobs/engine/fanout_rollback.py).
@step_kind(FANOUT, batched_dispatch=True)
def fanout_start(run: JobRun, index: int) -> None:
    """A fan-out step starts in a task of its own (`fanout_expand`), after the commit of
    the transition that reached it: expanding 100,000 devices into rows takes tens of
    seconds, which must hold up neither the inbox's drain (every other device's replies)
    nor fit its time limit."""
    task = current_app.signature(FANOUT_START_TASK, kwargs={"run_id": str(run.pk), "index": index})
    transaction.on_commit(partial(task.apply_async, argsrepr=f"runs=[{run.pk}], step={index}"))


def fanout_expand(*, run_id: str, index: int) -> None:
    """The `jobs.fanout_start` task: make the fan-out's rows (`fanout_rows_make`) and pump,
    under the run's row lock; the rows, their event and the first pump commit together or
    not at all. A second start of the same step while the first still works (the monitor's
    sweep sees no row yet) does nothing rather than hold a worker waiting for that lock: if
    the first is cut, the sweep starts the step again. A refused step fails at once."""
    run = None
    try:
        with transaction.atomic():
            # (SQLite takes no row lock: its one writer at a time serializes the two starts.)
            run = JobRun.objects.select_for_update(skip_locked=True).filter(pk=run_id).first()
            if run is None or run.status != RunStatus.RUNNING or run.cursor != index:
                return  # being started by another task, ended, canceled or moved on meanwhile
            fanout_rows_make(run, index)
    except StepRefused as refused:  # (nothing of the step was written)
        step_refused_apply(run, index, refused)


def fanout_rows_make(run: JobRun, index: int) -> None:
    """Expand the step into one pending row per device, then pump; StepRefused when none
    match (a step targeting an earlier fan-out's devices by outcome succeeds when there are
    none, event `step.fanout_empty`). Rows made before (a second start, a retry's carried
    rows) are pumped, not made again."""
    spec = run.plan[index]
    # Started before (a redelivered task; a continuous one may have no row yet): just pump.
    if spec.get("continuous") and ContinuousFanout.objects.filter(run=run, index=index).exists():
        fanout_pump(run=run, index=index)
        return
    if fanout_rows(run, index).exists():  # a redelivered task, or a retry's carried-over rows
        if spec.get("waves") and fanout_rollout(run, index) is None:
            _waves_split_written(run, index)
        if spec.get("continuous"):
            fanout_open(run=run, index=index)
        fanout_pump(run=run, index=index)
        return
    target = fanout_target(spec)
    try:
        devices = fanout_devices(spec, run)
    except ValueError as exc:
        raise StepRefused("", f"{target}: {exc}") from None
    if not devices and spec.get("devices_from"):
        # "Retry on the devices that failed" when none did is a success, not a refusal.
        source = spec["devices_from"]
        message = f"no device to target: no device {source['outcome']} in step {source['step']}"
        event_record("step.fanout_empty", run=run, message=message, index=index, devices_from=source)
        step_done_apply(str(run.pk), index, ok=True, status=StepStatus.SUCCEEDED, error="")
        return
    # A continuous fan-out may start with no device: those that come to match it join.
    if not devices and not spec.get("continuous"):
        raise StepRefused("", f"no enabled device matches {target}")
    limit = settings.IOTQUEUE_FANOUT_MAX_DEVICES
    if len(devices) > limit:
        raise StepRefused(
            "", f"{len(devices)} devices match {target}, more than IOTQUEUE_FANOUT_MAX_DEVICES ({limit})"
        )
    assigned, waves = waves_expand(spec.get("waves") or [], devices)
    if len(waves) > WAVES_EXPANDED_MAX:
        raise StepRefused(
            "", f"{target}: the waves split into {len(waves)} waves, more than {WAVES_EXPANDED_MAX}"
        )
    rows = []
    try:
        render = args_renderer(run, spec["args"])
    except templating.TemplateError as exc:
        raise StepRefused("", str(exc)) from None
    for device, wave in zip(devices, assigned, strict=True):
        try:
            args = render(device)
        except templating.TemplateError as exc:
            raise StepRefused(device.name, str(exc)) from None
        rows.append(StepRun(run=run, index=index, device=device, action=spec["action"], args=args, wave=wave))
    # In wave order, so ids follow the waves and the pump's next rows are the open wave's.
    rows.sort(key=lambda row: row.wave)
    StepRun.objects.bulk_create(rows, ignore_conflicts=True)
    _statistics_refresh(len(rows))
    event_record("step.fanout", run=run, message=f"{spec['action']} to {len(devices)} devices", index=index)
    if spec.get("continuous"):
        fanout_open(run=run, index=index)
    if spec.get("waves"):
        Rollout.objects.get_or_create(run=run, index=index, defaults={"waves": waves})
        message = f"{wave_name(0, waves)}: {waves[0]['size']} devices"
        event_record("wave.started", run=run, message=message, index=index, wave=1, by="auto")
    fanout_pump(run=run, index=index)


def _waves_split_written(run: JobRun, index: int) -> None:
    """A retry wrote the rows (jobs/retry.py: the devices that did not succeed, and the
    successes it carries): split the devices that run again into the step's waves, a canary
    of them first. The carried rows go to CARRIED_WAVE, which no wave's condition counts."""
    spec = run.plan[index]
    rows = fanout_rows(run, index)
    rows.exclude(status=StepStatus.PENDING).update(wave=CARRIED_WAVE)
    rows.filter(status=StepStatus.PENDING).update(wave=0)
    pending = list(rows.filter(status=StepStatus.PENDING).select_related("device").order_by("device__name"))
    assigned, waves = waves_expand(spec["waves"], [row.device for row in pending])
    for number in range(1, len(waves)):
        rows.filter(
            pk__in=[row.pk for row, wave in zip(pending, assigned, strict=True) if wave == number]
        ).update(wave=number)
    Rollout.objects.create(run=run, index=index, waves=waves)
    message = f"{wave_name(0, waves)}: {waves[0]['size']} devices"
    event_record("wave.started", run=run, message=message, index=index, wave=1, by="auto")


def _statistics_refresh(written: int) -> None:
    """After a large fan-out's rows are written, have PostgreSQL sample the table at once.

    Every row end of the step asks for the rows at work or pending by status; the planner
    answers that from the (run, phase, index, status, id) index only once its statistics
    know the rows exist. Until autovacuum analyzes the table (a minute or more later; never
    where it is off) it walks all the step's rows instead: half a second per row end at
    100,000 devices. ANALYZE reads a sample (30,000 rows), takes no lock that writers wait
    for, and may run inside the transaction.
    """
    if written >= FANOUT_ANALYZE_ROWS and connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(f"ANALYZE {connection.ops.quote_name(StepRun._meta.db_table)}")


def _rollout_pace(spec: Mapping[str, Any], rows) -> tuple[int, timedelta]:
    """rollout_pace with what the ramp counts (one count query, only for ramped steps)."""
    if not spec.get("rollout_per_minute") or not rollout_ramped(spec):
        return rollout_pace(spec, 0)
    if rollout_counts_notified(spec):
        counted = rows.exclude(status=StepStatus.PENDING).exclude(status=StepStatus.SKIPPED).count()
    else:
        counted = rows.filter(status=StepStatus.SUCCEEDED).count()
    return rollout_pace(spec, counted)


def rows_by_status(rows) -> Counter:
    """Rows by status, counted by the database (one GROUP BY, not a row per device)."""
    return Counter(dict(rows.order_by().values_list("status").annotate(n=Count("pk"))))


def fanout_pace(spec: Mapping[str, Any], rows, phase: str) -> tuple[int, timedelta]:
    """(devices, window) the pump of `phase`'s rows admits: the rollout's pace, or the
    rollback's own fixed rate (`compensation_per_minute`, no ramp)."""
    if phase == Phase.COMPENSATION:
        return spec.get("compensation_per_minute") or 0, RATE_WINDOW
    return _rollout_pace(spec, rows)


def fanout_pump(*, run: JobRun, index: int, phase: str = Phase.FORWARD) -> int:
    """Start as many pending rows as the rollout rate and max-in-flight allow.

    Reads only what the limits need (the rows at work when max-in-flight is set, the rows
    started within the rate's window when a rate is set), never the whole step's counts: a
    pump runs at every row's end, and a fan-out may have 100,000 rows. The rows of a
    rollback (`phase` compensation) are pumped the same way at `compensation_per_minute`.
    """
    spec = run.plan[index]
    now = timezone.now()
    with transaction.atomic():
        JobRun.objects.select_for_update().filter(pk=run.pk).first()
        rows = fanout_rows(run, index, phase)
        rollout = fanout_rollout(run, index) if spec.get("waves") and phase == Phase.FORWARD else None
        if rollout is not None and rollout.state != RolloutState.RUNNING:
            return 0  # paused, soaking or at a gate: nothing starts
        max_in_flight = spec.get("max_in_flight") or 0
        allowed, rate_window = fanout_pace(spec, rows, phase)
        window = rows.filter(queued_at__gt=now - rate_window)
        room = rollout_room(
            # As many as may be pending: the query below takes those there are.
            rows=settings.IOTQUEUE_FANOUT_MAX_DEVICES,
            max_in_flight=max_in_flight,
            in_flight=rows.filter(status__in=ACTIVE).count() if max_in_flight else 0,
            rollout_per_minute=allowed,
            started_in_window=window.count() if allowed else 0,
        )
        # The rows to start, and the first one left pending (the next pump's anchor).
        pending = rows.filter(status=StepStatus.PENDING)
        if rollout is not None:
            pending = pending.filter(wave__lte=rollout.wave)
        pending = pending.order_by("pk").values_list("pk", flat=True)
        chosen = list(pending[: room + 1])
        start, left = chosen[:room], chosen[room:]
        deadline = now + timedelta(seconds=spec["queue_timeout_seconds"])
        for first in range(0, len(start), PUMP_UPDATE_ROWS):
            rows.filter(pk__in=start[first : first + PUMP_UPDATE_ROWS], status=StepStatus.PENDING).update(
                status=StepStatus.QUEUED, queued_at=now, deadline=deadline
            )
        if allowed and left and window.exists():
            oldest = window.order_by("queued_at").values_list("queued_at", flat=True).first()
            deadlines_set({Deadline("pump", left[0], 0): oldest + rate_window})
    # After the commit of whatever transaction the pump is part of (a row's end deciding the
    # step): the rows' locks are taken and their commands published as batches.
    transaction.on_commit(partial(rows_start, start))
    return len(start)


@deadline_handler("pump")
def pump_due(step_run: StepRun, deadline: Deadline) -> None:
    """The rollout rate (or its rollback's rate) allows more rows of the fan-out `step_run`
    belongs to."""
    fanout_pump(run=step_run.run, index=step_run.index, phase=step_run.phase)


def fanout_summary(run: JobRun, index: int) -> tuple[Counter, Counter]:
    """(rows by status, failure reasons by count) of one fan-out step."""
    rows = fanout_rows(run, index)
    by_status = rows_by_status(rows)
    reasons: Counter = Counter()
    if any(by_status[s] for s in FAILING):
        failed = rows.filter(status__in=FAILING).values_list("error", "device__name")
        reasons.update(failure_reason(error, device) for error, device in failed)
    return by_status, reasons


def fanout_stop(*, run: JobRun, index: int, error: str, **data: Any) -> None:
    """Abort the rollout: skip the rows not started and fail the step with `error` (a
    `step.aborted` event with `data`). Rows already at work finish. Call it under the run's
    row lock, with the run at this step."""
    skipped = (
        fanout_rows(run, index)
        .filter(status=StepStatus.PENDING)
        .update(status=StepStatus.SKIPPED, error="rollout aborted", finished_at=timezone.now())
    )
    event_record(
        "step.aborted",
        run=run,
        message=f"{error}; {skipped} devices not started",
        index=index,
        skipped=skipped,
        **data,
    )
    Rollout.objects.filter(run=run, index=index).update(state=RolloutState.ENDED)
    if run.plan[index].get("continuous"):
        # An aborted continuous fan-out takes no one any more, whatever the run does next.
        ContinuousFanout.objects.filter(run=run, index=index, closed_at=None).update(closed_at=timezone.now())
    step_done_apply(str(run.pk), index, ok=False, status=StepStatus.FAILED, error=error)
