"""From the run timeline to the outside: lifecycle events to MQTT, webhooks and admins' mail.

The engine sends `jobs.events.lifecycle_events` in the transaction that wrote the events,
or, for a batched transition, once it committed and its commands left. The receiver here
does no query: it turns the events into JSON and, after the commit, appends them to the
outbox, a Redis stream (iotqueue/workstream.py; nothing when nothing would consume them),
in one round trip. The first entry that finds no drain outstanding sends the
`webhooks.events_out` task, IOTQUEUE_EVENTS_OUT_GATHER_MS later, and that task takes every
entry gathered by then at once: it reads their runs in one query, publishes the MQTT
events, creates a Delivery per matching webhook and enqueues their `webhooks.deliver`
tasks, and the failed-run mail; then takes again until the outbox is empty, and looks
again after the same delay, until a look finds nothing. So while events flow the engine
pays one Redis call per transition for its events and sends no Celery message, and the
events go out in groups, one drain per gathering time at most.

How it fails: an entry is acknowledged only after its events went out. A task that fails
on the database or Redis is retried and takes its own entries again first; entries left
by a worker that died are taken over by the next drain (the next event wakes one) once
they are workstream.RECLAIM_IDLE_SECONDS old. An entry that fails otherwise (a bug, a
malformed entry) is logged and dropped: events are a notification, the run's timeline is
the record. Events whose worker died between the commit and the append are not sent, nor
those waiting in the outbox when Redis loses its data (as Celery's queue would be lost).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from celery import current_app
from django.conf import settings
from django.db import DatabaseError, transaction
from redis.exceptions import RedisError

from devices import protocol
from iotqueue.mqtt import publisher
from iotqueue.redis_conn import redis_connection
from iotqueue.workstream import WorkStream, consumer_name
from jobs.models import JobRun, RunEvent
from jobs.rows import rows_select

from .models import Delivery, Webhook

log = logging.getLogger(__name__)

EVENTS_OUT_TASK = "webhooks.events_out"
DELIVER_TASK = "webhooks.deliver"
FAILED_RUN_MAIL_TASK = "webhooks.failed_run_mail"
# Runs that ended badly: what the failed-run mail is about.
FAILED_RUN_KINDS = frozenset({"run.failed", "run.timed_out", "run.compensated"})
# A process re-reads "is any webhook enabled?" at most this often (seconds) unless a
# webhook is saved in it; a webhook created elsewhere gets events within this long when
# neither MQTT events nor mail would send them out anyway.
WEBHOOKS_ANY_TTL_SECONDS = 5.0
_webhooks_any: tuple[float, bool] = (0.0, False)
# The outbox: each entry is one transaction's lifecycle events, as `event_item`s.
OUTBOX = WorkStream("events-out", EVENTS_OUT_TASK)
# The events_out task takes up to this many entries at once, for at most DRAIN_SECONDS;
# then it hands over to a new task so that other tasks get the worker too.
DRAIN_BATCH = 100
DRAIN_SECONDS = 2.0


def events_topic(run_id: str) -> str:
    """P/events/runs/<run id>: where a run's lifecycle events are published."""
    return f"{protocol.topic_prefix()}/{protocol.RUN_EVENTS}/{run_id}"


def webhooks_changed(sender, **kwargs) -> None:
    """post_save / post_delete of Webhook: this process reads the flag again."""
    global _webhooks_any
    _webhooks_any = (0.0, False)


def webhooks_any_enabled() -> bool:
    """Whether an enabled webhook exists, cached per process (one query per TTL at most)."""
    global _webhooks_any
    read_at, found = _webhooks_any
    now = time.monotonic()
    if now - read_at > WEBHOOKS_ANY_TTL_SECONDS:
        found = Webhook.objects.filter(enabled=True).exists()
        _webhooks_any = (now, found)
    return found


def events_wanted() -> bool:
    return settings.IOTQUEUE_RUN_EVENTS_MQTT or settings.IOTQUEUE_FAILED_RUN_EMAIL or webhooks_any_enabled()


def event_item(event: RunEvent) -> dict[str, Any]:
    """The JSON-safe part of an event that the events_out task needs."""
    return {
        "kind": event.kind,
        "run": str(event.run_id) if event.run_id else None,
        "time": event.created_at.isoformat() if event.created_at else None,
        "message": event.message,
        "step": event.data.get("index"),
        "device": event.device,
    }


def lifecycle_events_received(sender, events: list[RunEvent], **kwargs) -> None:
    """jobs.events.lifecycle_events: into the outbox after the commit, if anyone listens.

    A failure to append is logged (robust on_commit), never raised into the engine.
    """
    if not events_wanted():
        return
    entry = {"e": json.dumps([event_item(event) for event in events], separators=(",", ":"))}
    transaction.on_commit(lambda: _outbox_append(entry), robust=True)


def _outbox_append(entry: dict[str, str]) -> None:
    OUTBOX.append(redis_connection(), entry, wake_delay_ms=settings.IOTQUEUE_EVENTS_OUT_GATHER_MS)


def events_out_drain() -> int:
    """The events_out task: send out what waits in the outbox; returns the entries taken.

    Entries of consumers that are gone become this one's first, then its own pending
    entries (a retried task's) are taken, then new ones until the outbox is empty. A drain
    that sent something looks again IOTQUEUE_EVENTS_OUT_GATHER_MS later (a task it sends
    itself, the wake flag still set): while events keep coming, they send no task of their
    own and go out together. A look that finds nothing clears the flag, so that the next
    event wakes a new drain. A database or Redis error is raised with the entries still
    pending (the task is retried).
    """
    conn = redis_connection()
    OUTBOX.reclaim(conn, count=DRAIN_BATCH, consumer=consumer_name())
    own_pending = True
    taken = 0
    stop = time.monotonic() + DRAIN_SECONDS
    while time.monotonic() < stop:
        entries = OUTBOX.read(conn, count=DRAIN_BATCH, own_pending=own_pending)
        if not entries and own_pending:
            own_pending = False
            continue
        if not entries and not taken:
            # Nothing came since the last look: clear the wake flag with this read (an
            # entry appended after it wakes a new task; one appended before is read here).
            entries = OUTBOX.read(conn, count=DRAIN_BATCH, own_pending=False, last=True)
            if not entries:
                return 0
        if not entries:
            break
        _entries_out(entries)
        with conn.pipeline(transaction=False) as pipe:
            OUTBOX.done([entry_id for entry_id, _ in entries], pipe)
            pipe.execute()
        taken += len(entries)
    # Events came (or the time slice is over): look again after the gathering time. The wake
    # flag stays set, so this task is the only drain sent.
    countdown = settings.IOTQUEUE_EVENTS_OUT_GATHER_MS / 1000
    current_app.signature(EVENTS_OUT_TASK).apply_async(countdown=countdown)
    return taken


def _entries_out(entries: list[tuple[str, dict]]) -> None:
    events = []
    for entry_id, fields in entries:
        try:
            events.extend(json.loads(fields["e"]))
        except (KeyError, TypeError, ValueError):
            log.error("run events: outbox entry %s is malformed; dropped: %r", entry_id, fields)
    if not events:
        return
    try:
        events_out(events=events)
    except (DatabaseError, RedisError):
        raise  # the task is retried; the entries stay pending
    except Exception:
        log.exception("run events: %d events failed to go out; dropped", len(events))


def event_payload(item: dict[str, Any], run: JobRun | None) -> dict[str, Any]:
    """What a webhook receives and the MQTT event carries (docs/orchestration.md).

    `status`: for a run.* event, the run status it reports (running for run.started); for a
    step.* event, the step's outcome (failed, timed_out, aborted).
    """
    kind = item["kind"]
    subject, _, name = kind.partition(".")
    status = "running" if kind == "run.started" else name
    quiet = kind in ("run.started", "run.succeeded")  # their message is not an error
    return {
        "kind": kind,
        "run": item["run"],
        "template": run.template.name if run is not None else None,
        "status": status,
        "time": item["time"],
        "error": "" if quiet else item["message"],
        "step": None if subject == "run" else {"index": item["step"], "device": item["device"]},
    }


def events_out(*, events: list[dict[str, Any]]) -> None:
    """Publish, deliver and mail a group of lifecycle events (the events_out task).

    Runs and webhooks are read as the engine reads its rows (jobs.rows.rows_select): a
    drain of a few events costs a fraction of the ORM's query compilation."""
    run_ids = {item["run"] for item in events if item["run"]}
    runs = {str(run.pk): run for run in rows_select(JobRun, "id", run_ids, related=("template",))}
    payloads = [(event_payload(item, runs.get(item["run"])), runs.get(item["run"])) for item in events]
    if settings.IOTQUEUE_RUN_EVENTS_MQTT:
        mqtt_events_publish([payload for payload, _ in payloads])
    deliveries_create(payloads)
    if settings.IOTQUEUE_FAILED_RUN_EMAIL:
        for payload, _ in payloads:
            if payload["kind"] in FAILED_RUN_KINDS:
                current_app.signature(FAILED_RUN_MAIL_TASK, kwargs={"event": payload}).delay()


def mqtt_events_publish(payloads: list[dict[str, Any]]) -> None:
    """Hand the events to this process's MQTT client (QoS 1) without waiting for the broker.

    A message that cannot even be queued is logged and dropped: events are a notification,
    the run's timeline is the record.
    """
    messages = [
        (events_topic(payload["run"]), json.dumps(payload, separators=(",", ":")).encode())
        for payload in payloads
        if payload["run"]
    ]
    try:
        outcomes = publisher.publish_nowait(messages)
    except Exception:
        log.exception("run events: MQTT publish failed")
        return
    for (topic, _), outcome in zip(messages, outcomes, strict=True):
        if isinstance(outcome, str):
            log.warning("run events: %s not published: %s", topic, outcome)


def deliveries_create(payloads: list[tuple[dict[str, Any], JobRun | None]]) -> list[Delivery]:
    """A Delivery per (event, enabled webhook that wants it); their tasks go after commit."""
    webhooks = rows_select(Webhook, "enabled", [True])
    deliveries = [
        Delivery(webhook=webhook, kind=payload["kind"], run_id=payload["run"], payload=payload)
        for payload, run in payloads
        for webhook in webhooks
        if payload["kind"] in webhook.events
        and (webhook.template_id is None or (run is not None and run.template_id == webhook.template_id))
    ]
    if not deliveries:
        return []
    with transaction.atomic():
        deliveries = Delivery.objects.bulk_create(deliveries)
        ids = [delivery.pk for delivery in deliveries]
        transaction.on_commit(lambda: _deliver_enqueue(ids))
    return deliveries


def _deliver_enqueue(ids: list[int]) -> None:
    for delivery_id in ids:
        current_app.signature(DELIVER_TASK, kwargs={"delivery_id": delivery_id, "attempt": 1}).delay()
