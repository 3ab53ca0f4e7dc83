"""Fleet fan-out: one step sent to every device of a group or label selector (or to the
devices that succeeded or failed in an earlier fan-out of the run: `devices_from`).

The step expands into one row per device (status `pending`). The pump starts rows while
the rollout rate (devices per minute, stepped up by an exponential ramp if the step has one)
and max-in-flight allow; each started row is an ordinary step (queued on its device's lock,
so busy devices simply queue); the rows a pump starts take their locks and publish their
commands as batches (`batch.rows_start`: one lock call and one transaction per 500 rows).
When a row ends, progress is evaluated: when an abort criterion trips (by cause: failed,
rejected, timed out, any) the pending rows are skipped and the step fails with the
criterion and the failure breakdown; when all rows ended, the success criterion decides.
Pumps of one fan-out are serialized by a row lock on the run (SQLite: by its write lock).
A continuous fan-out (`continuous` on the step) stays open after its rows ended, for the
devices that join it (jobs/engine/continuous.py), and is decided when it closes.

A step with `waves` (jobs/engine/waves.py) has a `Rollout` row: the pump starts only rows of
the open wave (and earlier ones) and only while the rollout runs; when the open wave's rows
all ended its condition is checked (fail: pause, or abort), then it soaks and its gate
opens the next wave (auto), waits for an operator (approval) or asks a webhook (a Celery
task on the io queue, webhooks/gates.py). Operators' actions: jobs/rollouts.py.
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
from django.db.models import Count, Q
from django.utils import timezone

from .. import templating
from ..choices import AbortCause, RolloutIncrementOn, WaveGate
from ..deadlines import FANOUT_CLOSE, Deadline, deadlines_set
from ..events import event_record
from ..models import (
    STEP_AT_WORK,
    STEP_TERMINAL,
    ContinuousFanout,
    JobRun,
    Phase,
    Rollout,
    RolloutState,
    RunStatus,
    StepRun,
    StepStatus,
)
from .batch import rows_start, step_done_apply
from .kinds import deadline_handler, row_ended, step_kind
from .plan import FANOUT, args_renderer, fanout_devices, fanout_target
from .planner import run_ended_by
from .rollback import compensation_next
from .start import StepRefused
from .waves import WAVES_EXPANDED_MAX, wave_aborts, wave_gate, wave_name, wave_verdict, waves_expand

# The wave of a retry's carried rows (succeeded in the run it retries): past any real wave
# (a rollout has at most WAVES_EXPANDED_MAX), so no wave's condition counts them.
CARRIED_WAVE = 32767
# The task that asks a wave's webhook gate (webhooks/tasks.py), named so the engine does not
# import the webhooks app.
WAVE_GATE_TASK = "webhooks.wave_gate"

# The window of the rollout rate.
RATE_WINDOW = timedelta(minutes=1)
# A ramp's shortest pacing window: the monitor claims due deadlines once a second, so a
# shorter window would be paced by the tick, not by the rate.
RAMP_SLICE = timedelta(seconds=1)
# Step-ups counted at most: 5 (the largest factor) to this power exceeds any fleet, and the
# bound keeps the power a small number.
RAMP_MAX_STEPS = 64
ACTIVE = STEP_AT_WORK
# Rows that ended without success (what abort criteria count).
FAILING = (StepStatus.FAILED, StepStatus.REJECTED, StepStatus.TIMED_OUT)
# A fan-out writing this many rows has the database's statistics refreshed (_statistics_refresh).
FANOUT_ANALYZE_ROWS = 1_000
# Rows a pump marks queued per UPDATE (SQLite binds at most 32,766 values in a statement).
PUMP_UPDATE_ROWS = 10_000
# The row statuses each abort cause counts (`any`: every row that ended other than succeeded).
CAUSE_STATUSES = {
    AbortCause.FAILED: (StepStatus.FAILED,),
    AbortCause.REJECTED: (StepStatus.REJECTED,),
    AbortCause.TIMED_OUT: (StepStatus.TIMED_OUT,),
    AbortCause.ANY: (StepStatus.FAILED, StepStatus.REJECTED, StepStatus.TIMED_OUT, StepStatus.CANCELED),
}


def _rows(run: JobRun, index: int, phase: str = Phase.FORWARD):
    return StepRun.objects.filter(run=run, phase=phase, index=index)


def rollout_room(
    *, rows: int, max_in_flight: int, in_flight: int, rollout_per_minute: int, started_in_window: int
) -> int:
    """How many more rows may start now: all of them, less what max-in-flight (rows at work)
    and the rollout rate (rows started within RATE_WINDOW) leave; 0 limits = none."""
    room = rows
    if max_in_flight:
        room = min(room, max_in_flight - in_flight)
    if rollout_per_minute:
        room = min(room, rollout_per_minute - started_in_window)
    return max(0, room)


def rollout_rate(*, base: int, factor: float, every: int, counted: int, maximum: int) -> int:
    """The rollout rate (devices per minute) after `counted` devices succeeded (or were
    notified): `base` times `factor` per `every` of them, at most `maximum` (0 = no maximum).
    A factor of 1 or no `every` is the fixed rate `base`; 0 stays "no limit"."""
    if not base or factor <= 1 or every <= 0:
        return base
    rate = int(base * factor ** min(counted // every, RAMP_MAX_STEPS))
    return min(rate, maximum) if maximum else rate


def ramp_pace(rate: int) -> tuple[int, timedelta]:
    """How a ramp paces `rate` devices a minute: (devices, window) with devices / window ==
    rate, the window no shorter than RAMP_SLICE, so devices go out spread over the minute and
    a step-up shows within seconds (a fixed rate admits its minute's devices at once)."""
    devices = max(1, rate * RAMP_SLICE // RATE_WINDOW)
    return devices, RATE_WINDOW * devices / rate


def rollout_aborted(
    *, failed: int, ended: int, abort_failure_percent: int | None, abort_min_devices: int
) -> bool:
    """One criterion's test: more than `abort_failure_percent` of the rows that ended (skipped
    ones aside) count against it (`failed`), once at least `abort_min_devices` (and one) ended."""
    return (
        abort_failure_percent is not None
        and ended >= max(1, abort_min_devices)
        and failed * 100 > abort_failure_percent * ended
    )


def abort_criteria(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A step's abort criteria in the order they are tested: its `abort_criteria`, then the
    older `abort_failure_percent` / `abort_min_devices` as an `any` criterion."""
    criteria = list(spec.get("abort_criteria") or [])
    if spec.get("abort_failure_percent") is not None:
        criteria.append(
            {
                "cause": AbortCause.ANY.value,
                "threshold_percent": spec["abort_failure_percent"],
                "min_executed": spec.get("abort_min_devices") or 0,
            }
        )
    return criteria


def abort_criterion_tripped(
    *, criteria: list[dict[str, Any]], by_status: Mapping[str, int], executed: int
) -> dict[str, Any] | None:
    """The first criterion past its threshold, with what it counted (`count`, `executed`,
    `percent`); None when the rollout goes on. `executed`: rows that ended, skipped aside."""
    for criterion in criteria:
        count = sum(by_status.get(status, 0) for status in CAUSE_STATUSES[criterion["cause"]])
        if rollout_aborted(
            failed=count,
            ended=executed,
            abort_failure_percent=criterion["threshold_percent"],
            abort_min_devices=criterion.get("min_executed") or 0,
        ):
            percent = round(count * 100 / executed, 1)
            return {**criterion, "count": count, "executed": executed, "percent": percent}
    return None


def rollout_succeeded(*, succeeded: int, total: int, success_percent: int) -> bool:
    """The success criterion, once every row ended: at least `success_percent` of all rows."""
    return succeeded * 100 >= success_percent * total


def failure_reason(error: str, device: str | None) -> str:
    """A row's error with its device name folded out, so one cause counts as one reason:
    "no done from pump-17 within 30s" and "... pump-18 ..." are both "... <device> ..."."""
    return error.replace(device, "<device>") if device else error


# Its rows are commands the batched path dispatches (its pump: batch.rows_start); a rollback
# undoes it on each device that succeeded (jobs/engine/fanout_rollback.py).
@step_kind(FANOUT, batched_dispatch=True)
def fanout_start(run: JobRun, index: int) -> None:
    """Expand the step into one pending row per device, then pump; StepRefused when none
    match (a step targeting an earlier fan-out's devices by outcome succeeds when there are
    none, event `step.fanout_empty`)."""
    spec = run.plan[index]
    # Started before (a redelivered task; a continuous one may have no row yet): just pump.
    if spec.get("continuous") and ContinuousFanout.objects.filter(run=run, index=index).exists():
        fanout_pump(run=run, index=index)
        return
    if _rows(run, index).exists():  # a redelivered task, or a retry's carried-over rows
        if spec.get("waves") and _rollout(run, index) is None:
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


def fanout_open(*, run: JobRun, index: int) -> ContinuousFanout:
    """Open a continuous fan-out: record it (what joining devices look for) and set its
    end-by (`fanout_close` deadline, jobs/engine/continuous.py) when it has `open_seconds`."""
    spec = run.plan[index]
    now = timezone.now()
    seconds = spec.get("open_seconds")
    closes_at = now + timedelta(seconds=seconds) if seconds else None
    opened, created = ContinuousFanout.objects.get_or_create(
        run=run, index=index, defaults={"closes_at": closes_at}
    )
    if created:
        until = f"until {closes_at:%Y-%m-%d %H:%M:%S} UTC" if closes_at else "until closed by hand"
        event_record(
            "step.fanout_opened",
            run=run,
            message=f"continuous: devices that come to match join {until}",
            index=index,
            closes_at=closes_at.isoformat() if closes_at else None,
        )
    if opened.closes_at is not None:
        deadline = Deadline(FANOUT_CLOSE, str(run.pk), index)
        transaction.on_commit(partial(deadlines_set, {deadline: opened.closes_at}))
    return opened


def fanout_is_open(run: JobRun, index: int) -> bool:
    """Whether the step is a continuous fan-out still open (one query, only for those)."""
    if not run.plan[index].get("continuous"):
        return False
    return ContinuousFanout.objects.filter(run=run, index=index, closed_at=None).exists()


def _waves_split_written(run: JobRun, index: int) -> None:
    """A retry wrote the rows (jobs/retry.py: the devices that did not succeed, and the
    successes it carries): split the devices that run again into the step's waves, a canary
    of them first. The carried rows go to CARRIED_WAVE, which no wave's condition counts."""
    spec = run.plan[index]
    rows = _rows(run, index)
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


def _ramped(spec: Mapping[str, Any]) -> bool:
    return (spec.get("rollout_increment_factor") or 1) > 1 and (spec.get("rollout_increment_every") or 0) > 0


def rollout_pace(spec: Mapping[str, Any], counted: int) -> tuple[int, timedelta]:
    """(devices, window) a step's rollout admits once `counted` devices count towards its
    ramp: the fixed rate per minute, or a ramp's current rate paced by ramp_pace. Pure: the
    pump and the preview's estimate (jobs/estimate.py) both ask it."""
    base = spec.get("rollout_per_minute") or 0
    if not base or not _ramped(spec):
        return base, RATE_WINDOW
    rate = rollout_rate(
        base=base,
        factor=spec["rollout_increment_factor"],
        every=spec["rollout_increment_every"],
        counted=counted,
        maximum=spec.get("rollout_max_per_minute") or 0,
    )
    return ramp_pace(rate)


def rollout_counts_notified(spec: Mapping[str, Any]) -> bool:
    """Whether the ramp counts devices sent the command (else: devices that succeeded)."""
    return spec.get("rollout_increment_on") == RolloutIncrementOn.NOTIFIED


def _rollout_pace(spec: Mapping[str, Any], rows) -> tuple[int, timedelta]:
    """rollout_pace with what the ramp counts (one count query, only for ramped steps)."""
    if not spec.get("rollout_per_minute") or not _ramped(spec):
        return rollout_pace(spec, 0)
    if rollout_counts_notified(spec):
        counted = rows.exclude(status=StepStatus.PENDING).exclude(status=StepStatus.SKIPPED).count()
    else:
        counted = rows.filter(status=StepStatus.SUCCEEDED).count()
    return rollout_pace(spec, counted)


def _status_counts(rows) -> Counter:
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
        rows = _rows(run, index, phase)
        rollout = _rollout(run, index) if spec.get("waves") and phase == Phase.FORWARD else None
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
    rows = _rows(run, index)
    by_status = _status_counts(rows)
    reasons: Counter = Counter()
    if any(by_status[s] for s in FAILING):
        failed = rows.filter(status__in=FAILING).values_list("error", "device__name")
        reasons.update(failure_reason(error, device) for error, device in failed)
    return by_status, reasons


@row_ended(FANOUT)
def fanout_row_ended(step_run: StepRun) -> None:
    run, index = step_run.run, step_run.index
    if fanout_progress(run=run, index=index):
        return
    # The run moved on. Rolling back, it waited for this step's rows at work to end (their
    # outcome says whether they are undone): the last one lets the rollback go on.
    if (
        JobRun.objects.filter(pk=run.pk, status=RunStatus.COMPENSATING).exists()
        and not _rows(run, index).filter(status__in=ACTIVE).exists()
    ):
        compensation_next(run=run)


def fanout_progress(*, run: JobRun, index: int) -> bool:
    """A device's row ended for good: abort, pump more, or decide the step; False when the
    run is no longer running at this step (nothing done).

    Under the run's row lock (SQLite: its write lock), so of two workers whose rows ended
    together, one decides and the other finds the run moved on and does nothing.
    """
    with transaction.atomic():
        locked = JobRun.objects.select_for_update().filter(pk=run.pk, status=RunStatus.RUNNING, cursor=index)
        if not locked.exists():
            return False
        fanout_decide(run=run, index=index)
    return True


def fanout_decide(*, run: JobRun, index: int) -> None:
    """Abort, pump or decide, from what each needs: abort criteria are counted only once a
    row failed (none can trip before), and the whole step is counted once, at its end.
    Call it under the run's row lock, with the run at this step (fanout_progress does)."""
    spec = run.plan[index]
    rows = _rows(run, index)
    if abort_criteria(spec) and rows.filter(status__in=FAILING).exists():
        by_status, reasons = fanout_summary(run, index)
        ended = sum(by_status[s] for s in STEP_TERMINAL if s != StepStatus.SKIPPED)
        tripped = abort_criterion_tripped(criteria=abort_criteria(spec), by_status=by_status, executed=ended)
        if tripped is not None:
            breakdown = ", ".join(f"{n}x {reason}" for reason, n in reasons.most_common(5))
            fanout_abort(run=run, index=index, tripped=tripped, breakdown=breakdown)
            return
    rollout = _rollout(run, index) if spec.get("waves") else None
    if rollout is not None and run_ended_by(run, timezone.now()):
        rollout = None  # past an end-by that lets what started finish: no wave opens any more
    if rollout is not None and not _rollout_progress(run=run, index=index, rollout=rollout, rows=rows):
        return
    if rows.filter(status=StepStatus.PENDING).exists():
        fanout_pump(run=run, index=index)
        return
    if rows.filter(status__in=ACTIVE).exists():
        return
    if fanout_is_open(run, index):
        return  # its rows ended, but devices may still join: it ends when it closes
    by_status, reasons = fanout_summary(run, index)
    total = sum(by_status.values())
    succeeded = by_status[StepStatus.SUCCEEDED]
    ended = sum(by_status[s] for s in STEP_TERMINAL if s != StepStatus.SKIPPED)
    failed = ended - succeeded
    breakdown = ", ".join(f"{n}x {reason}" for reason, n in reasons.most_common(5))
    ok = rollout_succeeded(succeeded=succeeded, total=total, success_percent=spec.get("success_percent", 100))
    message = f"{succeeded} of {total} devices succeeded" + (f"; failures: {breakdown}" if failed else "")
    event_record("step.fanout_done", run=run, message=message, index=index, by_status=dict(by_status))
    Rollout.objects.filter(run=run, index=index).update(state=RolloutState.ENDED)
    step_done_apply(
        str(run.pk),
        index,
        ok=ok,
        status=StepStatus.SUCCEEDED if ok else StepStatus.FAILED,
        error=f"step {index}: {message}",
    )


def fanout_abort(*, run: JobRun, index: int, tripped: dict[str, Any], breakdown: str) -> None:
    """An abort criterion tripped: skip the rows not started, fail the step saying which
    criterion and what it counted. Rows already at work finish (their outcome is recorded)."""
    cause = tripped["cause"]
    counted = "failed, rejected or timed out" if cause == AbortCause.ANY else cause.replace("_", " ")
    error = (
        f"step {index}: rollout aborted by criterion {cause}: {tripped['count']} of "
        f"{tripped['executed']} devices {counted} ({tripped['percent']}% > "
        f"{tripped['threshold_percent']}%): {breakdown}"
    )
    fanout_stop(run=run, index=index, error=error, criterion=tripped)


def fanout_stop(*, run: JobRun, index: int, error: str, **data: Any) -> None:
    """Abort the rollout: skip the rows not started and fail the step with `error` (a
    `step.aborted` event with `data`). Rows already at work finish. Call it under the run's
    row lock, with the run at this step."""
    skipped = (
        _rows(run, index)
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


# --- waves and gates ----------------------------------------------------------------------


def _rollout(run: JobRun, index: int) -> Rollout | None:
    return Rollout.objects.filter(run=run, index=index).first()


def _rollout_progress(*, run: JobRun, index: int, rollout: Rollout, rows) -> bool:
    """A waved fan-out's progress: True when the step may be decided (its last wave ended
    and passed); else it pumped the open wave, waits for it, or decided the wave's end."""
    if rollout.state != RolloutState.RUNNING:
        return False  # rows that end meanwhile are counted when it goes on
    open_rows = rows.filter(wave__lte=rollout.wave)
    if open_rows.filter(status=StepStatus.PENDING).exists():
        fanout_pump(run=run, index=index)
        return False
    if open_rows.filter(status__in=ACTIVE).exists():
        return False
    if not rollout.wave_checked and not _wave_end(run=run, index=index, rollout=rollout, rows=rows):
        return False
    if rollout.wave == len(rollout.waves) - 1:
        return True
    rollout.wave += 1
    rollout.wave_checked = False
    rollout.state, rollout.reason, rollout.soak_until = RolloutState.RUNNING, "", None
    rollout.save()
    message = f"{wave_name(rollout.wave, rollout.waves)}: {rollout.waves[rollout.wave]['size']} devices"
    event_record(
        "wave.started",
        run=run,
        message=message,
        index=index,
        wave=rollout.wave + 1,
        by=rollout.decided_by or "auto",
    )
    fanout_pump(run=run, index=index)
    return False


def _wave_end(*, run: JobRun, index: int, rollout: Rollout, rows) -> bool:
    """The open wave's rows all ended: check its condition, then pause, abort, soak or ask
    its gate. True when the rollout goes on at once (the last wave passed, or an auto gate)."""
    wave = rollout.waves[rollout.wave]
    name = wave_name(rollout.wave, rollout.waves)
    by_status = _status_counts(rows.filter(wave=rollout.wave))
    passed, counted = wave_verdict(wave, by_status)
    rollout.wave_checked = True
    rollout.decided_by = "auto"
    message = f"{name} ended: {counted}" + ("" if passed else "; its condition failed")
    event_record(
        "wave.ended",
        run=run,
        message=message,
        index=index,
        wave=rollout.wave + 1,
        by_status=dict(by_status),
        passed=passed,
        by="auto",
    )
    if not passed and wave_aborts(wave):
        rollout.save()
        fanout_stop(
            run=run, index=index, error=f"step {index}: rollout aborted: {name} failed: {counted}", by="auto"
        )
        return False
    if not passed:
        rollout_pause(run=run, rollout=rollout, by="auto", reason=f"{name} failed: {counted}")
        return False
    if rollout.wave == len(rollout.waves) - 1:
        rollout.save()
        return True
    soak = wave.get("soak_seconds") or 0
    # The member names the next wave's first row (pending: attempt 0), as a pump's does.
    anchor = rows.filter(wave=rollout.wave + 1).order_by("pk").values_list("pk", flat=True).first()
    if soak and anchor is not None:
        rollout.state = RolloutState.SOAKING
        rollout.soak_until = timezone.now() + timedelta(seconds=soak)
        rollout.save()
        deadlines_set({Deadline("soak", anchor, 0): rollout.soak_until})
        until = rollout.soak_until.isoformat(timespec="seconds")
        event_record(
            "rollout.soaking", run=run, message=f"{name} soaks until {until}", index=index, by="auto"
        )
        return False
    return wave_gate_ask(run=run, rollout=rollout)


def wave_gate_ask(*, run: JobRun, rollout: Rollout) -> bool:
    """The open wave passed (and soaked): its gate decides. True for an auto gate (go on);
    an approval gate waits for an operator, a webhook gate for the webhook's answer (asked
    by a task on the io queue after the commit: the engine never waits on HTTP)."""
    wave = rollout.waves[rollout.wave]
    gate, index = wave_gate(wave), rollout.index
    name, following = wave_name(rollout.wave, rollout.waves), rollout.wave + 2
    if gate == WaveGate.AUTO:
        rollout.state, rollout.decided_by = RolloutState.RUNNING, "auto"
        rollout.save()
        event_record(
            "rollout.approved",
            run=run,
            message=f"{name} passed: wave {following} opens",
            index=index,
            by="auto",
        )
        return True
    if gate == WaveGate.APPROVAL:
        rollout.state, rollout.reason = (
            RolloutState.AWAITING_APPROVAL,
            f"awaiting approval of wave {following}",
        )
        rollout.save()
        event_record(
            "rollout.awaiting_approval",
            run=run,
            message=f"{name} passed: {rollout.reason}",
            index=index,
            by="auto",
        )
        return False
    rollout.state, rollout.reason = (
        RolloutState.AWAITING_WEBHOOK,
        f"asking {wave['webhook_url']} for wave {following}",
    )
    rollout.save()
    event_record(
        "rollout.awaiting_webhook",
        run=run,
        message=f"{name} passed: {rollout.reason}",
        index=index,
        by="auto",
    )
    kwargs = {"run_id": str(run.pk), "index": index, "wave": rollout.wave}
    transaction.on_commit(lambda: current_app.signature(WAVE_GATE_TASK, kwargs=kwargs).apply_async())
    return False


def rollout_pause(*, run: JobRun, rollout: Rollout, by: str, reason: str) -> None:
    """Pause the rollout: no row starts until it is resumed (rows at work finish)."""
    rollout.state, rollout.reason, rollout.decided_by = RolloutState.PAUSED, reason[:500], by
    rollout.save()
    message = f"paused by {by}" + (f": {reason}" if reason else "")
    event_record("rollout.paused", run=run, message=message, index=rollout.index, by=by, reason=reason)


@deadline_handler("soak")
def soak_due(step_run: StepRun, deadline: Deadline) -> None:
    """A wave's soak time is over: its gate decides (unless the rollout moved on meanwhile)."""
    run, index = step_run.run, step_run.index
    with transaction.atomic():
        if (
            not JobRun.objects.select_for_update()
            .filter(pk=run.pk, status=RunStatus.RUNNING, cursor=index)
            .exists()
        ):
            return
        rollout = _rollout(run, index)
        if rollout is None or rollout.state != RolloutState.SOAKING or rollout.wave != step_run.wave - 1:
            return
        if wave_gate_ask(run=run, rollout=rollout):
            fanout_decide(run=run, index=index)


# Rollouts one reconcile pass looks at per kind: the next pass takes the rest.
ROLLOUTS_SWEPT = 500


def soaks_overdue(*, before) -> int:
    """Soaking rollouts whose soak ended before `before` (or that have no end) and whose
    `soak` deadline was lost (a Redis restart): the monitor's reconcile pass asks, the
    database being the authority, and sets the deadline again, due now. Its handler
    (`soak_due`) decides under the run's row lock, and only while the rollout still soaks at
    that wave, so a late deadline and the sweep never both decide. Returns how many."""
    soaking = (
        Rollout.objects.filter(state=RolloutState.SOAKING, run__status=RunStatus.RUNNING)
        .filter(Q(soak_until__lt=before) | Q(soak_until=None))
        .values_list("run_id", "index", "wave")[:ROLLOUTS_SWEPT]
    )
    now, due = timezone.now(), {}
    for run_id, index, wave in soaking:
        # The member names the next wave's first row, as `_wave_end` set it.
        anchor = (
            StepRun.objects.filter(run_id=run_id, phase=Phase.FORWARD, index=index, wave=wave + 1)
            .order_by("pk")
            .values_list("pk", flat=True)
            .first()
        )
        if anchor is not None:
            due[Deadline("soak", anchor, 0)] = now
    deadlines_set(due)
    return len(due)


def gates_unanswered(*, before) -> int:
    """Rollouts awaiting their webhook since before `before` (the gate's timeout and a sweep
    interval ago): its task was lost (a broker away, a Redis restart), as an answer or a
    refusal would have moved the rollout on by now. Ask the webhook again, under the run's
    row lock (an answer, an operator or another pass that decided first wins). Returns how
    many were asked again."""
    waiting = Rollout.objects.filter(
        state=RolloutState.AWAITING_WEBHOOK, updated_at__lt=before, run__status=RunStatus.RUNNING
    ).values_list("pk", flat=True)[:ROLLOUTS_SWEPT]
    asked = 0
    for pk in waiting:
        with transaction.atomic():
            rollout = Rollout.objects.select_related("run").filter(pk=pk).first()
            if rollout is None:
                continue
            run = (
                JobRun.objects.select_for_update()
                .filter(pk=rollout.run_id, status=RunStatus.RUNNING, cursor=rollout.index)
                .first()
            )
            rollout.refresh_from_db()
            if run is None or rollout.state != RolloutState.AWAITING_WEBHOOK or rollout.updated_at >= before:
                continue
            asked_at = rollout.updated_at.isoformat(timespec="seconds")
            rollout.save(update_fields=["updated_at"])
            wave = rollout.waves[rollout.wave]
            event_record(
                "rollout.gate_asked_again",
                run=run,
                message=(
                    f"{wave_name(rollout.wave, rollout.waves)}: its webhook gate, asked at {asked_at}, "
                    f"never answered: asking {wave['webhook_url']} again"
                ),
                index=rollout.index,
                by="auto",
            )
            kwargs = {"run_id": str(run.pk), "index": rollout.index, "wave": rollout.wave}
            transaction.on_commit(
                lambda kwargs=kwargs: current_app.signature(WAVE_GATE_TASK, kwargs=kwargs).apply_async()
            )
            asked += 1
    return asked
