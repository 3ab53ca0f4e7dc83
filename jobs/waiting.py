"""Why a step or a run waits: a reason computed from the rows and the lock state, never stored.

Every unfinished step row is waiting for something: its device to come online, the device's
lock (held by another run's step, with this step's place in the queue), flow control's next
allowed send, the rollout rate, a delay, a back-off before the next attempt, a maintenance
window to open or quiet hours to end (time windows), or the device's `done`.
`steps_waiting` / `runs_waiting` answer for a page of rows or runs with a fixed number
of queries and one pipeline to the lock Redis (lock holders and queues, the
deadlines that say when flow control, a rollout or a back-off lets the step go on); nothing
here writes. `runs_stuck` lists the runs whose oldest unfinished step has waited past
IOTQUEUE_STUCK_AFTER_SECONDS.

How it fails: Redis being unreachable raises redis.RedisError to the caller (a page shows
no reasons rather than wrong ones). Rows and Redis are read at slightly different moments,
so a step that moves on while it is read may show the reason it just left; the next read
is right again.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import Count, Min, OuterRef, Q, Subquery
from django.db.models.functions import Coalesce
from django.utils import timezone
from django.utils.translation import gettext as _

from devices.lock_slots import SLOT_STATE_REPLIES, SlotState, slot_state_parse, slot_state_read
from devices.locks import LOCK_STATE_REPLIES, LockState, device_lock_state_parse, device_lock_state_read
from iotqueue.redis_conn import lock_redis_connection

from .deadlines import Deadline, deadlines_key
from .engine.holds import device_quiet_hours, row_hold, window_groups_read
from .engine.plan import holder_step_id, spec_kind, step_holder, step_spec
from .limits import Limit, limits_applying
from .models import (
    STEP_AT_WORK,
    STEP_IN_FLIGHT,
    ContinuousFanout,
    JobRun,
    Phase,
    Rollout,
    RolloutState,
    RunStatus,
    StepKind,
    StepRun,
    StepStatus,
)
from .timewindows import Hold, zone

# Rows with something still to come: at work, or a fan-out's device not started yet.
UNFINISHED = (StepStatus.PENDING, *STEP_AT_WORK)
# Runs that can wait: not started yet, going forward, or rolling back.
RUN_WAITING = (RunStatus.PENDING, RunStatus.RUNNING, RunStatus.COMPENSATING)

# The reason codes, what each means (docs/operations.md has the same table).
REASONS = {
    "run_pending": "the run was created and no worker has started it yet",
    "run_advancing": "the run is between two steps (the next one is being started)",
    "device_offline": "the step's device is offline; the step waits (up to its queue timeout)",
    "device_disabled": "the step's device was disabled after the step was queued",
    "device_busy": "another run's step holds the device's lock; this step waits in its queue",
    "flow_control": "the step holds the lock; the device's flow limits say when it may be sent",
    "limit_full": "a shared concurrency limit is full for the device's label value; it waits for a slot",
    "dispatching": "the device's lock is free or handed to this step: it is being sent now",
    "rollout_rate": "a fan-out's device not started yet: the rollout rate (a rollback's: "
    "compensation_per_minute) starts it later",
    "rollout_in_flight": "a fan-out's (or its rollback's) device not started yet: max in flight "
    "devices are at work",
    "rollout_wave": "a fan-out's device in a later wave: it starts when its wave opens",
    "rollout_soaking": "a fan-out's wave soaks before its gate; the next wave waits",
    "rollout_gate": "a fan-out's next wave waits for approval, or for its webhook's answer",
    "rollout_paused": "a fan-out in waves is paused (by an operator, its webhook or a failed condition)",
    "delay": "a delay step, over at a known time",
    "wait_online": "a wait-for-online step: its device is not online yet",
    "task_step": "a task step's Celery task is running",
    "device_working": "the command was sent; the device's done is awaited (up to the deadline)",
    "retry_backoff": "an attempt failed; the next one starts after the back-off",
    "fanout_open": "a continuous fan-out whose devices ended stays open for devices to join",
    "window": "the device is outside every maintenance window that applies; it waits for the next opening",
    "quiet_hours": "the device is in its quiet hours (its own time zone); the step is not urgent",
    "run_not_before": "the run was started with a start-not-before still ahead",
}


@dataclass(frozen=True)
class Waiting:
    """What a step (or a run, through its oldest unfinished step) waits for."""

    reason: str  # a code of REASONS
    message: str  # for people, in the active language
    device: str | None = None
    since: datetime | None = None  # when the condition began (offline since, queued, sent)
    until: datetime | None = None  # when it may go on, if known
    blocking_run: uuid.UUID | None = None  # the device is busy with this run...
    blocking_step: int | None = None  # ...at this step index
    queue_position: int | None = None  # this step's place in the device's lock queue (1 = next)
    step: int | None = None  # the index of the step that waits (for a run's waiting)

    def as_dict(self) -> dict[str, Any]:
        return {
            "reason": self.reason,
            "message": self.message,
            "device": self.device,
            "since": self.since.isoformat() if self.since else None,
            "until": self.until.isoformat() if self.until else None,
            "blocking_run": str(self.blocking_run) if self.blocking_run else None,
            "blocking_step": self.blocking_step,
            "queue_position": self.queue_position,
            "step": self.step,
        }


@dataclass(frozen=True)
class StuckRun:
    """A run whose oldest unfinished step has waited `waited`, and why."""

    run: JobRun
    waiting: Waiting
    waited: timedelta


# --- reading what the reasons need, for many rows at once ---------------------------------


@dataclass
class WaitFacts:
    """What the rows' reasons need from the database and Redis, read once for all rows."""

    locks: dict[str, LockState] = field(default_factory=dict)
    # deadline member -> due time (dispatch: flow control; pump: the rollout's next device)
    due: dict[str, datetime] = field(default_factory=dict)
    # (run id, phase, index) of a fan-out (or its rollback) -> (rows at work, first pending row's pk)
    fanouts: dict[tuple[uuid.UUID, str, int], tuple[int, int | None]] = field(default_factory=dict)
    # step row pk -> (run id, index) of the holders of the devices' locks
    holders: dict[int, tuple[uuid.UUID, int]] = field(default_factory=dict)
    # step row pk -> the shared concurrency limits that apply to it, with its label value
    limits: dict[int, list[tuple[Limit, str]]] = field(default_factory=dict)
    # (limit name, label value) -> who holds and who waits for its slots
    slots: dict[tuple[str, str], SlotState] = field(default_factory=dict)
    # step row pk of a slot holder -> its device's name
    slot_devices: dict[int, str] = field(default_factory=dict)
    # (run id, index) of a fan-out in waves -> its rollout (waves and gates)
    rollouts: dict[tuple[uuid.UUID, int], Rollout] = field(default_factory=dict)
    # device name -> its group names, for devices whose run has group maintenance windows
    groups: dict[str, frozenset[str]] = field(default_factory=dict)


def _needs_lock(row: StepRun) -> bool:
    return (
        row.status == StepStatus.QUEUED
        and row.device_id is not None
        and row.device.reachable
        and row.device.enabled
        and step_spec(row).get("kind") != StepKind.WAIT_ONLINE
    )


def wait_facts_read(rows: Sequence[StepRun]) -> WaitFacts:
    """Four queries at most (fan-out counts, rollouts in waves, lock holders' rows, devices'
    groups when a group's maintenance window applies) and one Redis pipeline."""
    facts = WaitFacts()
    facts.groups = window_groups_read(
        (row.run, row.device.name) for row in rows if row.status == StepStatus.QUEUED and row.device_id
    )
    fanout_keys = {(row.run_id, row.phase, row.index) for row in rows if row.status == StepStatus.PENDING}
    waved = {
        (row.run_id, row.index)
        for row in rows
        if row.status == StepStatus.PENDING and step_spec(row).get("waves")
    }
    if waved:
        found = Rollout.objects.filter(
            run_id__in={run_id for run_id, _index in waved}, index__in={index for _run, index in waved}
        )
        facts.rollouts = {(r.run_id, r.index): r for r in found if (r.run_id, r.index) in waved}
    if fanout_keys:
        runs = {run_id for run_id, _phase, _index in fanout_keys}
        counted = (
            StepRun.objects.filter(
                run_id__in=runs,
                phase__in={phase for _run, phase, _index in fanout_keys},
                index__in={index for _run, _phase, index in fanout_keys},
                status__in=UNFINISHED,
            )
            .order_by()
            .values_list("run_id", "phase", "index")
            .annotate(
                at_work=Count("pk", filter=Q(status__in=STEP_AT_WORK)),
                first=Min("pk", filter=Q(status=StepStatus.PENDING)),
            )
        )
        facts.fanouts = {(r, p, i): (n, first) for r, p, i, n, first in counted if (r, p, i) in fanout_keys}
    devices = sorted({row.device.name for row in rows if _needs_lock(row)})
    members = [Deadline.of("dispatch", row) for row in rows if _needs_lock(row)]
    members += [Deadline("pump", first, 0) for _count, first in facts.fanouts.values() if first is not None]
    if not devices and not members:
        return facts
    for row in rows:
        if _needs_lock(row):
            applying = limits_applying(
                action=row.action, template_id=row.run.template_id, labels=row.device.labels
            )
            if applying:
                facts.limits[row.pk] = applying
    pairs = sorted({(limit.name, value) for applying in facts.limits.values() for limit, value in applying})
    with lock_redis_connection().pipeline(transaction=False) as pipe:
        for device in devices:
            device_lock_state_read(device, pipe=pipe)
        for deadline in members:
            pipe.zscore(deadlines_key(deadline.shard), deadline.member)
        for limit, value in pairs:
            slot_state_read(limit, value, pipe=pipe)
        replies = pipe.execute()
    n = LOCK_STATE_REPLIES
    facts.locks = {d: device_lock_state_parse(d, replies[n * i : n * i + n]) for i, d in enumerate(devices)}
    at, m = n * len(devices) + len(members), SLOT_STATE_REPLIES
    facts.slots = {
        pair: slot_state_parse(*pair, replies[at + m * i : at + m * i + m]) for i, pair in enumerate(pairs)
    }
    scores = replies[n * len(devices) : at]
    facts.due = {
        d.member: datetime.fromtimestamp(score / 1000, UTC)
        for d, score in zip(members, scores, strict=True)
        if score is not None
    }
    held = {holder_step_id(s.holder) for s in facts.locks.values() if s.holder}
    held.discard(None)
    in_slots = {holder_step_id(h) for state in facts.slots.values() for h in state.holders} - {None}
    if in_slots:
        facts.slot_devices = dict(StepRun.objects.filter(pk__in=in_slots).values_list("pk", "device__name"))
    if held:
        facts.holders = {
            pk: (run_id, index)
            for pk, run_id, index in StepRun.objects.filter(pk__in=held).values_list("pk", "run_id", "index")
        }
    return facts


# --- the reasons ---------------------------------------------------------------------------


def clock(when: datetime | None, *, now: datetime | None = None) -> str:
    """A time for a sentence: 14:02:11, with the date when it is not today."""
    if when is None:
        return "-"
    local = timezone.localtime(when)
    today = timezone.localtime(now or timezone.now()).date()
    return local.strftime("%H:%M:%S" if local.date() == today else "%Y-%m-%d %H:%M:%S")


def _offline(row: StepRun, now: datetime) -> Waiting:
    device = row.device
    offline_since = device.presence_since or device.last_seen
    if offline_since is None:
        message = _("Device %(device)s is offline (never seen online)") % {"device": device.name}
    else:
        message = _("Device %(device)s is offline since %(since)s") % {
            "device": device.name,
            "since": clock(offline_since, now=now),
        }
    if row.status in STEP_IN_FLIGHT:
        message += " " + _("(it went offline during the attempt; the deadline at %(until)s decides)") % {
            "until": clock(row.deadline, now=now)
        }
    return Waiting(
        "device_offline",
        message,
        device=device.name,
        since=offline_since or row.queued_at,
        until=row.deadline if row.status in STEP_IN_FLIGHT else None,
    )


def _queued(row: StepRun, facts: WaitFacts, now: datetime) -> Waiting:
    """A queued row: for presence, a disabled device, the lock, or flow control."""
    if row.device_id is None:
        return Waiting("dispatching", _("Being sent to its task"), since=row.queued_at)
    device = row.device
    if step_spec(row).get("kind") == StepKind.WAIT_ONLINE:
        return _wait_online(row, now)
    if not device.enabled:
        return Waiting(
            "device_disabled",
            _("Device %(device)s is disabled") % {"device": device.name},
            device=device.name,
            since=row.queued_at,
        )
    hold = row_hold(row, now, facts.groups)
    if hold is not None:
        return _held(row, hold, now)
    if not device.reachable:
        return _offline(row, now)
    state = facts.locks.get(device.name)
    holder = step_holder(row)
    full = _limit_full(row, facts, holder)
    if full is not None:
        return full
    if state is None or state.holder is None or state.holder == holder:
        until = facts.due.get(Deadline.of("dispatch", row).member)
        if state is not None and state.holder == holder and until is not None:
            return Waiting(
                "flow_control",
                _("Flow control on %(device)s: the next command may be sent at %(until)s")
                % {"device": device.name, "until": clock(until, now=now)},
                device=device.name,
                since=row.queued_at,
                until=until,
            )
        return Waiting(
            "dispatching", _("Being sent to %(device)s") % {"device": device.name}, device=device.name
        )
    position = state.queue.index(holder) + 1 if holder in state.queue else None
    blocker = facts.holders.get(holder_step_id(state.holder) or -1)
    values = {"device": device.name, "position": position or "?", "holder": state.holder}
    if blocker is not None:
        values.update(run=str(blocker[0])[:8], step=blocker[1])
        message = _(
            "Device %(device)s is busy with run %(run)s step #%(step)s; this run is number "
            "%(position)s in its queue"
        )
    else:
        message = _(
            "Device %(device)s is busy (held by %(holder)s); this run is number %(position)s in its queue"
        )
    return Waiting(
        "device_busy",
        message % values,
        device=device.name,
        since=row.queued_at,
        blocking_run=blocker[0] if blocker else None,
        blocking_step=blocker[1] if blocker else None,
        queue_position=position,
    )


def _limit_full(row: StepRun, facts: WaitFacts, holder: str) -> Waiting | None:
    """A queued row waiting for a slot of a shared concurrency limit (its device left free):
    which limit, for which label value, and what holds its slots."""
    for limit, value in facts.limits.get(row.pk, []):
        state = facts.slots.get((limit.name, value))
        if state is None or holder not in state.waiting:
            continue
        held = [facts.slot_devices.get(holder_step_id(h) or -1, h) for h in state.holders]
        message = _(
            "%(limit)s: %(label)s=%(value)s has %(count)s of %(most)s in flight (%(held)s); "
            "this step is number %(position)s in its queue"
        ) % {
            "limit": limit.describe(),
            "label": limit.label,
            "value": value,
            "count": len(state.holders),
            "most": limit.most,
            "held": ", ".join(held) or "-",
            "position": state.waiting.index(holder) + 1,
        }
        return Waiting(
            "limit_full",
            message,
            device=row.device.name,
            since=row.queued_at,
            queue_position=state.waiting.index(holder) + 1,
        )
    return None


def _held(row: StepRun, hold: Hold, now: datetime) -> Waiting:
    """A command its time windows hold (jobs/engine/holds.py): until when, and why."""
    device = row.device
    values = {"device": device.name, "window": hold.window, "until": clock(hold.until, now=now)}
    if hold.reason == "window":
        message = _("Outside maintenance window %(window)s, opens at %(until)s") % values
    else:
        quiet = device_quiet_hours(device)
        values["local"] = hold.until.astimezone(zone(quiet.tz)).strftime("%H:%M") if quiet else "-"
        values["tz"] = quiet.tz if quiet else "-"
        message = _("Quiet hours on %(device)s until %(until)s (%(local)s %(tz)s)") % values
    return Waiting(hold.reason, message, device=device.name, until=hold.until)


def _wait_online(row: StepRun, now: datetime) -> Waiting:
    device = row.device
    since = (device.presence_since or device.last_seen) if not device.reachable else None
    message = _("Waiting for device %(device)s to come online") % {"device": device.name}
    if since is not None:
        message += " " + _("(offline since %(since)s)") % {"since": clock(since, now=now)}
    return Waiting(
        "wait_online", message, device=device.name, since=since or row.queued_at, until=row.deadline
    )


def _pending(row: StepRun, facts: WaitFacts, now: datetime) -> Waiting:
    """A fan-out's device not started yet: max in flight, or the rollout rate (a rollback's
    device: max in flight, or compensation_per_minute)."""
    at_work, first = facts.fanouts.get((row.run_id, row.phase, row.index), (0, None))
    spec = row.run.plan[row.index]
    device = row.device_name or None
    undo = row.phase == Phase.COMPENSATION
    rollout = None if undo else facts.rollouts.get((row.run_id, row.index))
    if rollout is not None and (rollout.state != RolloutState.RUNNING or row.wave > rollout.wave):
        return _wave_waiting(row, rollout, now)
    limit = spec.get("max_in_flight") or 0
    if limit and at_work >= limit:
        message = (
            _("Rollback: %(count)s devices at work, the most this step allows at once")
            if undo
            else _("Rollout: %(count)s devices at work, the most this step allows at once")
        )
        return Waiting("rollout_in_flight", message % {"count": at_work}, device=device)
    until = facts.due.get(Deadline("pump", first, 0).member) if first is not None else None
    if until is None and undo:
        message = _("Rollback: this device's compensation starts when compensation_per_minute allows")
    elif until is None:
        message = _("Rollout: this device starts when the rollout rate allows")
    elif undo:
        message = _("Rollback rate: the next device's compensation starts at %(until)s") % {
            "until": clock(until, now=now)
        }
    else:
        message = _("Rollout rate: the next device starts at %(until)s") % {"until": clock(until, now=now)}
    return Waiting("rollout_rate", message, device=device, until=until)


def _wave_waiting(row: StepRun, rollout: Rollout, now: datetime) -> Waiting:
    """A fan-out's device whose wave is not open, or whose rollout is paused or at a gate."""
    device = row.device_name or None
    following = rollout.wave + 2
    if rollout.state == RolloutState.PAUSED:
        message = _("Rollout paused by %(who)s: %(reason)s") % {
            "who": rollout.decided_by or "-",
            "reason": rollout.reason or "-",
        }
        return Waiting("rollout_paused", message, device=device, since=rollout.updated_at)
    if rollout.state == RolloutState.AWAITING_APPROVAL:
        message = _("Rollout: awaiting approval of wave %(wave)s") % {"wave": following}
        return Waiting("rollout_gate", message, device=device, since=rollout.updated_at)
    if rollout.state == RolloutState.AWAITING_WEBHOOK:
        message = _("Rollout: awaiting the webhook's answer for wave %(wave)s") % {"wave": following}
        return Waiting("rollout_gate", message, device=device, since=rollout.updated_at)
    if rollout.state == RolloutState.SOAKING:
        message = _("Rollout: wave %(wave)s soaks until %(until)s") % {
            "wave": rollout.wave + 1,
            "until": clock(rollout.soak_until, now=now),
        }
        return Waiting("rollout_soaking", message, device=device, until=rollout.soak_until)
    message = _("Rollout: this device is in wave %(wave)s; wave %(open)s of %(waves)s is open") % {
        "wave": row.wave + 1,
        "open": rollout.wave + 1,
        "waves": len(rollout.waves),
    }
    return Waiting("rollout_wave", message, device=device)


def _in_flight(row: StepRun, now: datetime) -> Waiting:
    kind = spec_kind(step_spec(row))
    if kind == StepKind.DELAY:
        return Waiting(
            "delay",
            _("Delay until %(until)s") % {"until": clock(row.deadline, now=now)},
            since=row.queued_at,
            until=row.deadline,
        )
    if kind == StepKind.TASK:
        return Waiting(
            "task_step",
            _("Waiting on task %(task)s (attempt %(attempt)s, deadline %(until)s)")
            % {"task": row.action, "attempt": row.attempt, "until": clock(row.deadline, now=now)},
            device=row.device_name or None,
            since=row.dispatched_at,
            until=row.deadline,
        )
    if not row.device.reachable:
        return _offline(row, now)
    values = {"device": row.device_name, "since": clock(row.dispatched_at, now=now)}
    values["until"] = clock(row.deadline, now=now)
    if row.status == StepStatus.IN_PROGRESS:
        values["progress"] = row.progress or 0
        message = _("Device %(device)s is working on it (%(progress)s%%); deadline %(until)s")
    else:
        message = _("Sent to %(device)s at %(since)s; waiting for its done (deadline %(until)s)")
    return Waiting(
        "device_working",
        message % values,
        device=row.device_name,
        since=row.dispatched_at,
        until=row.deadline,
    )


def _retrying(row: StepRun, now: datetime) -> Waiting:
    return Waiting(
        "retry_backoff",
        _("Attempt %(attempt)s failed; the next one starts at %(until)s")
        % {"attempt": row.attempt, "until": clock(row.deadline, now=now)},
        device=row.device_name or None,
        since=row.dispatched_at,
        until=row.deadline,
    )


def row_waiting(row: StepRun, facts: WaitFacts, now: datetime) -> Waiting:
    """The reason of one unfinished row, from what `wait_facts_read` read: no I/O."""
    if row.status == StepStatus.PENDING:
        waiting = _pending(row, facts, now)
    elif row.status == StepStatus.QUEUED:
        waiting = _queued(row, facts, now)
    elif row.status == StepStatus.RETRYING:
        waiting = _retrying(row, now)
    else:
        waiting = _in_flight(row, now)
    return replace(waiting, step=row.index)


# --- public API ------------------------------------------------------------------------------


def steps_waiting(steps: Iterable[StepRun], *, now: datetime | None = None) -> dict[int, Waiting]:
    """What each unfinished row waits for, by row pk (finished rows are left out).

    The rows need their run (with its plan) and device loaded, as `select_related("run",
    "device")` or a prefetch from the run does. Two queries at most and one Redis pipeline,
    however many rows.
    """
    now = now or timezone.now()
    rows = [row for row in steps if row.status in UNFINISHED]
    facts = wait_facts_read(rows)
    return {row.pk: row_waiting(row, facts, now) for row in rows}


def step_waiting(step: StepRun, *, now: datetime | None = None) -> Waiting | None:
    """What one step row waits for; None when it has finished."""
    return steps_waiting([step], now=now).get(step.pk)


def runs_current_rows(runs: Sequence[JobRun]) -> dict[uuid.UUID, StepRun]:
    """Each run's oldest unfinished row (at work first, by queued time; else its first pending
    fan-out row), with the run and device attached: two queries for any number of runs."""
    if not runs:
        return {}
    rows = StepRun.objects.filter(run=OuterRef("pk"))
    at_work = rows.filter(status__in=STEP_AT_WORK).order_by("queued_at", "pk").values("pk")[:1]
    pending = rows.filter(status=StepStatus.PENDING).order_by("pk").values("pk")[:1]
    current = dict(
        JobRun.objects.filter(pk__in=[run.pk for run in runs])
        .annotate(row=Coalesce(Subquery(at_work), Subquery(pending)))
        .exclude(row=None)
        .values_list("pk", "row")
    )
    if not current:
        return {}
    by_pk = {run.pk: run for run in runs}
    loaded = {}
    for row in StepRun.objects.select_related("device").filter(pk__in=current.values()):
        row.run = by_pk[row.run_id]
        loaded[row.run_id] = row
    return loaded


def run_current_row(rows: Iterable[StepRun]) -> StepRun | None:
    """Of a run's rows, the one its waiting is told by (as `runs_current_rows` picks it)."""
    rows = list(rows)
    at_work = [row for row in rows if row.status in STEP_AT_WORK and row.queued_at is not None]
    if at_work:
        return min(at_work, key=lambda row: (row.queued_at, row.pk))
    return min(
        (row for row in rows if row.status == StepStatus.PENDING), key=lambda row: row.pk, default=None
    )


def runs_waiting(runs: Sequence[JobRun], *, now: datetime | None = None) -> dict[uuid.UUID, Waiting]:
    """What each pending or running run waits for (its oldest unfinished step's reason), by
    run id; finished runs are left out. Four queries at most and one Redis pipeline for a
    page of runs, never one per run. The runs need their plan loaded."""
    now = now or timezone.now()
    active = [run for run in runs if run.status in RUN_WAITING]
    current = runs_current_rows(active)
    return _runs_told(active, current, steps_waiting(current.values(), now=now))


def runs_steps_waiting(
    runs: Sequence[JobRun], rows: Iterable[StepRun], *, now: datetime | None = None
) -> tuple[dict[uuid.UUID, Waiting], dict[int, Waiting]]:
    """`runs_waiting` and `steps_waiting` at once, for runs whose rows are loaded already
    (a page of runs with their steps prefetched): (by run id, by row pk), with no query for
    the runs' current rows and one Redis pipeline for all."""
    now = now or timezone.now()
    rows = list(rows)
    by_row = steps_waiting(rows, now=now)
    by_run: dict[uuid.UUID, list[StepRun]] = {}
    for row in rows:
        by_run.setdefault(row.run_id, []).append(row)
    active = [run for run in runs if run.status in RUN_WAITING]
    current = {run.pk: row for run in active if (row := run_current_row(by_run.get(run.pk, ()))) is not None}
    return _runs_told(active, current, by_row), by_row


def _runs_told(
    active: Sequence[JobRun], current: dict[uuid.UUID, StepRun], by_row: dict[int, Waiting]
) -> dict[uuid.UUID, Waiting]:
    waiting = {}
    opened = _fanouts_open([run for run in active if run.pk not in current])
    for run in active:
        row = current.get(run.pk)
        if row is not None:
            waiting[run.pk] = by_row[row.pk]
        elif (run.pk, run.cursor) in opened:
            until = opened[run.pk, run.cursor]
            message = (
                _("Continuous fan-out open until %(until)s: devices that come to match it join")
                % {"until": timezone.localtime(until).strftime("%Y-%m-%d %H:%M:%S")}
                if until
                else _("Continuous fan-out open until closed by hand: devices that come to match it join")
            )
            waiting[run.pk] = Waiting("fanout_open", message, until=until, step=run.cursor)
        elif (
            run.status == RunStatus.PENDING and run.not_before is not None and run.not_before > timezone.now()
        ):
            waiting[run.pk] = Waiting(
                "run_not_before",
                _("The run starts at %(until)s (its start-not-before)") % {"until": clock(run.not_before)},
                since=run.created_at,
                until=run.not_before,
            )
        elif run.status == RunStatus.PENDING:
            waiting[run.pk] = Waiting(
                "run_pending", _("Waiting for a worker to start the run"), since=run.created_at
            )
        else:
            waiting[run.pk] = Waiting(
                "run_advancing", _("Moving on to step #%(step)s") % {"step": run.cursor}, step=run.cursor
            )
    return waiting


def _fanouts_open(runs: Sequence[JobRun]) -> dict[tuple[uuid.UUID, int], datetime | None]:
    """The open continuous fan-outs at these runs' cursors, with their end-by: one query, and
    none when no run's current step is continuous (read from the plans)."""
    continuous = [
        run.pk
        for run in runs
        if run.status == RunStatus.RUNNING
        and run.cursor < len(run.plan)
        and run.plan[run.cursor].get("continuous")
    ]
    if not continuous:
        return {}
    rows = ContinuousFanout.objects.filter(run_id__in=continuous, closed_at=None)
    return {
        (run_id, index): until for run_id, index, until in rows.values_list("run_id", "index", "closes_at")
    }


def stuck_after() -> timedelta:
    return timedelta(seconds=settings.IOTQUEUE_STUCK_AFTER_SECONDS)


def runs_stuck(
    *, older_than: timedelta | None = None, limit: int = 50, now: datetime | None = None
) -> list[StuckRun]:
    """Pending and running runs whose oldest unfinished step has waited longer than
    `older_than` (default IOTQUEUE_STUCK_AFTER_SECONDS), newest problem first, at most `limit`.

    A step's wait is counted from when it was queued (a retried step: from its requeue); a
    run that no worker has started, from its creation. Indexed reads only: the at-work rows
    through the step status index (steprun_status_deadline: rows at work are a small part
    of the table however many finished ones it holds), pending runs through
    jobrun_status_created; then `runs_waiting` for the reasons.
    """
    now = now or timezone.now()
    cutoff = now - (stuck_after() if older_than is None else older_than)
    oldest = list(
        StepRun.objects.filter(status__in=STEP_AT_WORK, queued_at__lt=cutoff, run__status__in=RUN_WAITING)
        .order_by()
        .values("run_id")
        .annotate(oldest=Min("queued_at"))
        .order_by("-oldest")
        .values_list("run_id", "oldest")[:limit]
    )
    unstarted = list(
        JobRun.objects.filter(status=RunStatus.PENDING, created_at__lt=cutoff)
        .filter(Q(not_before__isnull=True) | Q(not_before__lt=now))
        .order_by("-created_at")
        .values_list("pk", "created_at")[:limit]
    )
    since = dict(unstarted)
    since.update(oldest)
    chosen = sorted(since.items(), key=lambda item: item[1], reverse=True)[:limit]
    runs = {
        run.pk: run
        for run in JobRun.objects.select_related("template").filter(pk__in=[pk for pk, _when in chosen])
    }
    found = [runs[pk] for pk, _when in chosen if pk in runs]
    waiting = runs_waiting(found, now=now)
    return [StuckRun(run, waiting[run.pk], now - since[run.pk]) for run in found if run.pk in waiting]


# --- events a device being offline explains -----------------------------------------------

# The engine records a step waiting for an offline device as `step.waiting` "device <name> is
# offline" (jobs/engine/dispatch.py, planner.py) and a wait-for-online step's wait as
# "until <name> is online" (waits.py); other `step.waiting` events (a busy device, a delay)
# are routine. A filter on kind first, so `kind` is read through its index.
OFFLINE_WAIT_EVENTS = Q(kind="step.waiting") & (
    Q(message__endswith=" is offline") | Q(message__startswith="until ", message__endswith=" is online")
)


def event_is_offline_wait(kind: str, message: str) -> bool:
    """Whether an event is a step waiting for an offline device (as OFFLINE_WAIT_EVENTS)."""
    return kind == "step.waiting" and (
        message.endswith(" is offline") or (message.startswith("until ") and message.endswith(" is online"))
    )


# --- a device's work: who holds it, who waits for it ---------------------------------------


@dataclass(frozen=True)
class StepRef:
    """A step row named for people: run, step index, action, template."""

    step_run: int
    run: uuid.UUID
    index: int
    action: str
    template: str
    queue_position: int | None = None  # in the device's lock queue; None: waiting outside it

    def label(self) -> str:
        return _("run %(run)s step #%(step)s %(action)s") % {
            "run": str(self.run)[:8],
            "step": self.index,
            "action": self.action,
        }


@dataclass(frozen=True)
class DeviceWork:
    """A device's lock and the steps waiting for the device.

    `queued` lists the lock queue in its order, then the steps queued for the device outside
    the lock queue (it is offline: they ask for the lock when it is back), oldest first;
    `others` are lock holders that are not step rows (a locked Celery task), by name.
    """

    device: str
    lock: LockState
    holder: StepRef | None
    queued: list[StepRef]
    others: list[str]

    @property
    def queue_length(self) -> int:
        return len(self.queued) + len(self.others)


def devices_work(devices: Sequence[str]) -> dict[str, DeviceWork]:
    """`DeviceWork` of each named device: one Redis pipeline and one query for all of them."""
    if not devices:
        return {}
    with lock_redis_connection().pipeline(transaction=False) as pipe:
        for device in devices:
            device_lock_state_read(device, pipe=pipe)
        replies = pipe.execute()
    n = LOCK_STATE_REPLIES
    locks = {d: device_lock_state_parse(d, replies[n * i : n * i + n]) for i, d in enumerate(devices)}
    held = {holder_step_id(lock.holder) for lock in locks.values() if lock.holder}
    held.discard(None)
    rows = list(
        StepRun.objects.filter(Q(pk__in=held) | Q(device__name__in=devices, status=StepStatus.QUEUED))
        .order_by("queued_at", "pk")
        .values_list("pk", "run_id", "index", "action", "run__template__name", "device__name")
    )
    refs = {pk: StepRef(pk, run, index, action, template) for pk, run, index, action, template, _d in rows}
    queued_for: dict[str, list[int]] = {}
    for pk, *_rest, device in rows:
        queued_for.setdefault(device, []).append(pk)
    work = {}
    for device, lock in locks.items():
        in_queue, others = [], []
        for position, holder in enumerate(lock.queue, start=1):
            ref = refs.get(holder_step_id(holder) or -1)
            if ref is None:
                others.append(holder)
            else:
                in_queue.append(replace(ref, queue_position=position))
        holder = refs.get(holder_step_id(lock.holder) or -1) if lock.holder else None
        listed = {ref.step_run for ref in in_queue} | ({holder.step_run} if holder else set())
        outside = [refs[pk] for pk in queued_for.get(device, []) if pk not in listed]
        work[device] = DeviceWork(device, lock, holder, in_queue + outside, others)
    return work
