"""Writing the run timeline: one RunEvent per transition or dropped message.

Every transition passes through `event_record`, so it is also where the transition is
logged (with run id, step, device and command id as separate fields for JSON logs) and
counted for /metrics (jobs/metrics.py declares the families): run and step outcomes, step
durations, lock waits and dropped replies, sent to Redis in one round trip once the
transition commits.
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import transaction
from django.dispatch import Signal
from django.utils import timezone
from redis.exceptions import RedisError

from iotqueue.bridge import BRIDGE_MESSAGES
from iotqueue.metrics import MetricsBatch
from iotqueue.redis_conn import redis_connection, redis_key

from .metrics import LOCK_WAIT, RUNS, RUNS_STARTED, STEP_DURATION, STEP_RETRIES, STEPS
from .models import RUN_TERMINAL, STEP_TERMINAL, JobRun, RunEvent, StepRun, StepStatus
from .rows import Writes, row_new, rows_create

log = logging.getLogger("jobs.timeline")

# Sent (with event=, the saved RunEvent) for every `run.<terminal status>` event, in the
# transaction that ended the run: whether the event was saved alone or in a batch's
# INSERT. Other apps hook the end of runs here (e.g. a schedule's waiting fire).
run_ended = Signal()
RUN_END_KINDS = frozenset(f"run.{status}" for status in RUN_TERMINAL)
# Sent (with events=, a non-empty list of saved RunEvents of these kinds) once per
# `event_record`, in the transaction that wrote it, and once per batch, after its commit
# and after its commands left (`EventLog.committed`): the run lifecycle other systems are
# told about (webhooks, MQTT events). Receivers must stay cheap (no query per event on the
# engine's path) and act only after the commit (`transaction.on_commit`, which runs at once
# outside a transaction). step.aborted is a fan-out stopped by one of its abort criteria;
# step.rejected a device that refused.
lifecycle_events = Signal()
LIFECYCLE_KINDS = RUN_END_KINDS | {
    "run.started",
    "step.failed",
    "step.rejected",
    "step.timed_out",
    "step.aborted",
}

# Statuses that end an attempt that was dispatched: its dispatch -> end is a step duration.
ATTEMPT_ENDS = (
    StepStatus.SUCCEEDED,
    StepStatus.FAILED,
    StepStatus.REJECTED,
    StepStatus.TIMED_OUT,
    StepStatus.RETRYING,
)
# Replies the engine (or the bridge) dropped, by the kind they count as on /metrics.
DROPPED_MESSAGE_KINDS = {
    "message.dropped": "malformed",
    "reply.stale": "stale",
    "reply.unknown": "unknown",
    "reply.foreign_device": "foreign_device",
}
# Shown in the log line's fixed fields, not repeated among its details.
LOGGED_FIELDS = ("index", "attempt", "command_id")


def event_new(
    kind: str,
    *,
    run: JobRun | None = None,
    step_run: StepRun | None = None,
    device: str = "",
    message: str = "",
    **data: Any,
) -> RunEvent:
    """An event not yet saved or logged (`event_record` saves and logs it; `EventLog` writes
    it with others and logs it once they are committed)."""
    if step_run is not None:
        run_id = step_run.run_id
        device = device or step_run.device_name
        data.setdefault("index", step_run.index)
        data.setdefault("attempt", step_run.attempt)
        if step_run.command_id:
            data.setdefault("command_id", step_run.command_id)
    else:
        run_id = run.pk if run is not None else None
    event = row_new(
        RunEvent, run_id=run_id, step_run=step_run, kind=kind, device=device, message=message, data=data
    )
    if run is not None:
        event.run = run  # kept for the run_ended receivers (no query to read the run back)
    return event


def event_run(event: RunEvent) -> JobRun | None:
    """The event's run when `event_new` kept it on the event, without a query; else None."""
    return event.run if RunEvent.run.is_cached(event) else None


# A device can send replies that answer nothing current (stale, unknown, another device's)
# as fast as its budget at the bridge allows (200/s): each is counted on /metrics, but only
# the first EVENTS_SAMPLED_FIRST of a kind from one device within EVENTS_SAMPLED_WINDOW
# seconds, then the 100th, 1,000th, ..., become events, so that one device cannot fill the
# timeline. The window is short so that a device that behaves again is heard again soon.
EVENTS_SAMPLED_FIRST = 10
EVENTS_SAMPLED_WINDOW = 60


def event_record_sampled(kind: str, *, device: str, **fields: Any) -> RunEvent | None:
    """`event_record` for what a device may repeat at will: recorded for the first few of
    its kind from `device` in a window, then at each power of ten (saying how many came);
    always counted. How it fails: without Redis every one is recorded."""
    try:
        (count,) = sampled_counts([(kind, device)])
    except RedisError:
        count = 1
    kept = sampled_fields(kind, device, count, fields)
    if kept is not None:
        return event_record(kind, device=device, **kept)
    transaction.on_commit(event_metrics(kind, fields.get("step_run")).send)
    return None


def sampled_fields(kind: str, device: str, count: int, fields: dict[str, Any]) -> dict[str, Any] | None:
    """The fields of the `count`th sampled `kind` from `device` in its window, recorded
    (with a note when past the first few); None when it is only counted."""
    if count <= EVENTS_SAMPLED_FIRST:
        return fields
    if not _power_of_ten(count):
        return None
    return {
        **fields,
        "message": f"{fields.get('message', '')} (the {count}th {kind} from {device} within "
        f"{EVENTS_SAMPLED_WINDOW} s; only the first {EVENTS_SAMPLED_FIRST}, then every power "
        "of ten, are recorded)",
        "sampled_count": count,
    }


def sampled_counts(pairs: list[tuple[str, str]]) -> list[int]:
    """Count one more of each (kind, device) in its window, in one round trip."""
    with redis_connection().pipeline(transaction=False) as pipe:
        for kind, device in pairs:
            key = redis_key("events-sampled", kind, device)
            pipe.incr(key)
            pipe.expire(key, EVENTS_SAMPLED_WINDOW, nx=True)
        answers = pipe.execute()
    return [int(count) for count in answers[::2]]


def _power_of_ten(count: int) -> bool:
    while count >= 10 and count % 10 == 0:
        count //= 10
    return count == 1


def event_record(kind: str, **fields: Any) -> RunEvent:
    """Append an event (fields as `event_new`), log it with the run, step, device and
    command id, count it."""
    event = event_new(kind, **fields)
    rows_create(RunEvent, [event])
    _event_log(event)
    if kind in RUN_END_KINDS:
        run_ended.send(sender=RunEvent, event=event)
    if kind in LIFECYCLE_KINDS:
        lifecycle_events.send(sender=RunEvent, events=[event])
    batch = event_metrics(kind, fields.get("step_run"))
    if batch:
        # Counted once the transition is committed: a rolled-back one never happened.
        transaction.on_commit(batch.send)
    return event


# What a batch writes of each event (its id is not read back; nothing refers to it).
EVENT_FIELDS = ["run", "step_run", "kind", "device", "message", "data", "created_at"]


class EventLog:
    """The events of one batched transition: written in one INSERT, counted in one batch.

    Metrics are taken when an event is added (from the step row as it is then), and sent
    by the caller once the transaction committed. The events are logged, and the lifecycle
    ones told to `lifecycle_events`, by `committed`, which the caller calls once the
    transaction committed and its commands left: the log and the outside hear only of
    transitions that happened, and neither delays the next command. (`run_ended` is sent
    as they are written: its receivers write in the same transaction.)
    """

    def __init__(self) -> None:
        self.events: list[RunEvent] = []
        self.written: list[RunEvent] = []
        self.metrics = MetricsBatch()
        # What a device may repeat at will (stale, unknown, foreign replies; extensions):
        # kept until `sampled_decide` counts them and records those `sampled_fields` keeps.
        self.sampled: list[tuple[str, str, dict[str, Any]]] = []

    def add(self, kind: str, **fields: Any) -> None:
        self.events.append(event_new(kind, **fields))
        self.metrics.extend(event_metrics(kind, fields.get("step_run")))

    def add_sampled(self, kind: str, *, device: str, **fields: Any) -> None:
        """An event as `event_record_sampled` records it, decided by `sampled_decide`."""
        self.sampled.append((kind, device, fields))

    def sampled_decide(self) -> None:
        """Count the sampled events in one round trip and add those kept (every one when
        Redis does not answer); the others are only counted on /metrics."""
        if not self.sampled:
            return
        sampled, self.sampled = self.sampled, []
        try:
            counts = sampled_counts([(kind, device) for kind, device, _ in sampled])
        except RedisError:
            counts = [1] * len(sampled)
        for (kind, device, fields), count in zip(sampled, counts, strict=True):
            kept = sampled_fields(kind, device, count, fields)
            if kept is not None:
                self.add(kind, device=device, **kept)
            else:
                self.metrics.extend(event_metrics(kind, fields.get("step_run")))

    def insert(self, writes: Writes) -> None:
        """Queue the events gathered so far in `writes` (one INSERT, sent when the caller
        sends them) and start afresh."""
        if self.events:
            events, self.events = self.events, []
            now = timezone.now()
            for event in events:
                event.created_at = now
            writes.insert(RunEvent, events, EVENT_FIELDS)
            self.written.extend(events)
            for event in events:
                if event.kind in RUN_END_KINDS:
                    run_ended.send(sender=RunEvent, event=event)

    def committed(self) -> None:
        """The events written are committed: log them, and send the lifecycle ones (a
        receiver that raises is logged)."""
        written, self.written = self.written, []
        for event in written:
            _event_log(event)
        lifecycle = [event for event in written if event.kind in LIFECYCLE_KINDS]
        if lifecycle:
            # After the commit a receiver's failure must not stop the batch's remaining work.
            for receiver, answer in lifecycle_events.send_robust(sender=RunEvent, events=lifecycle):
                if isinstance(answer, Exception):
                    log.error("lifecycle_events receiver %s failed", receiver, exc_info=answer)


def _event_log(event: RunEvent) -> None:
    """One `jobs.timeline` line for an event, with its run, step, device and command id also
    as separate fields (for JSON logs)."""
    if not log.isEnabledFor(logging.INFO):
        return
    kind, run_id, device, message, data = event.kind, event.run_id, event.device, event.message, event.data
    index, command_id = data.get("index"), data.get("command_id")
    details = {k: v for k, v in data.items() if k not in LOGGED_FIELDS}
    log.info(
        "%s run=%s step=%s device=%s command=%s %s%s",
        kind,
        run_id or "-",
        "-" if index is None else index,
        device or "-",
        command_id or "-",
        message,
        f" {details}" if details else "",
        extra={
            "event": kind,
            "run_id": str(run_id) if run_id else None,
            "step": index,
            "attempt": data.get("attempt"),
            "device": device or None,
            "command_id": command_id,
            "details": details,
        },
    )


def event_metrics(kind: str, step_run: StepRun | None) -> MetricsBatch:
    """What an event adds to /metrics (an empty batch for most kinds)."""
    batch = MetricsBatch()
    subject, _, name = kind.partition(".")
    if kind == "run.started":
        batch.count(RUNS_STARTED)
    elif subject == "run" and name in RUN_TERMINAL:
        batch.count(RUNS, name)
    elif subject == "step":
        if name in STEP_TERMINAL:
            batch.count(STEPS, name)
        elif name == StepStatus.RETRYING:
            batch.count(STEP_RETRIES)
        if step_run is not None:
            _step_timings(batch, name, step_run)
    elif kind in DROPPED_MESSAGE_KINDS:
        batch.count(BRIDGE_MESSAGES, DROPPED_MESSAGE_KINDS[kind])
    return batch


def _step_timings(batch: MetricsBatch, name: str, step_run: StepRun) -> None:
    queued, dispatched = step_run.queued_at, step_run.dispatched_at
    # dispatched_at before queued_at is an earlier attempt's (the step was queued again).
    dispatched_now = dispatched is not None and (queued is None or dispatched >= queued)
    if name == StepStatus.DISPATCHED and dispatched_now and queued is not None:
        batch.observe(LOCK_WAIT, (dispatched - queued).total_seconds())
    elif name in ATTEMPT_ENDS and dispatched_now:
        ended = step_run.finished_at or timezone.now()
        batch.observe(STEP_DURATION, max(0.0, (ended - dispatched).total_seconds()), name)
