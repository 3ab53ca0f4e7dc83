"""A rollout's waves as it runs: the open wave's end (its condition, then pause, abort, soak
or its gate), the next wave opening, an operator's pause, and the reconcile passes that
find a soak's deadline or a webhook gate's task lost.

A step with `waves` (jobs/engine/waves.py: devices into waves, a wave's condition) has a
`Rollout` row: the pump (jobs/engine/fanout.py) starts only rows of the open wave (and
earlier ones) and only while the rollout runs. When the open wave's rows all ended, a row's
end (jobs/engine/fanout_progress.py) asks `rollout_progress`: the wave's condition is
checked (fail: pause, or abort), then it soaks (the `soak` deadline, whose handler is
fanout_progress.soak_due: a soak's end decides the step as a row's end does) and its gate
opens the next wave (auto), waits for an operator (approval) or asks a webhook (a Celery
task on the io queue, webhooks/gates.py). Operators' actions: jobs/rollouts.py.
"""

from __future__ import annotations

from datetime import timedelta

from celery import current_app
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from ..choices import WaveGate
from ..deadlines import Deadline, deadlines_set
from ..events import event_record
from ..models import JobRun, Phase, Rollout, RolloutState, RunStatus, StepRun, StepStatus
from .fanout import ACTIVE, fanout_pump, fanout_stop, rows_by_status
from .waves import wave_aborts, wave_gate, wave_name, wave_verdict

# The task that asks a wave's webhook gate (webhooks/tasks.py), named so the engine does not
# import the webhooks app.
WAVE_GATE_TASK = "webhooks.wave_gate"


def rollout_progress(*, run: JobRun, index: int, rollout: Rollout, rows) -> bool:
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
    by_status = rows_by_status(rows.filter(wave=rollout.wave))
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
