"""The run events' outbox (webhooks/outbox.py): events of many transactions wait in a
Redis stream and go out in groups; nothing is lost when a drain fails or its worker dies.

The drains here run in the test process against the real Redis and database, on entries
appended without a wake-up (so the worker leaves them alone); the first test goes the
whole way through the worker."""

from __future__ import annotations

import json
import logging

import pytest
from django.db import OperationalError

from iotqueue.redis_conn import redis_connection
from iotqueue.workstream import consumer_name
from jobs.events import lifecycle_events
from jobs.models import JobRun, RunEvent
from tests.conftest import wait_for
from tests.factories import template_with_steps
from webhooks import outbox
from webhooks.models import Delivery, Webhook
from webhooks.tasks import events_out_task

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(60)]

SECRET = "a-test-secret-of-some-length"


@pytest.fixture
def runs(stack, receiver) -> list[JobRun]:
    """Five runs, and a webhook that wants their starts (delivered to `receiver`); the
    outbox is empty (no entry left by an earlier test)."""
    no_drain_outstanding()
    redis_connection().delete(outbox.OUTBOX.key())
    template = template_with_steps()
    Webhook.objects.create(name="ops", url=receiver.url, secret=SECRET, events=["run.started"])
    return [JobRun.objects.create(template=template) for _ in range(5)]


def item(run: JobRun) -> dict:
    """What the receiver appends for a run's run.started event."""
    return outbox.event_item(RunEvent(run=run, kind="run.started", data={}))


def no_drain_outstanding() -> None:
    wait_for(lambda: not redis_connection().exists(outbox.OUTBOX.wake_key()), what="no drain outstanding")


def appended_unwoken(*entries: dict) -> list[str]:
    """Append outbox entries without waking a drain (the worker leaves them alone)."""
    no_drain_outstanding()
    return [redis_connection().xadd(outbox.OUTBOX.key(), entry) for entry in entries]


def entry(*items: dict) -> dict:
    return {"e": json.dumps(list(items))}


def delivered_runs() -> list[str]:
    return sorted(str(run_id) for run_id in Delivery.objects.values_list("run_id", flat=True))


def outbox_settled() -> bool:
    conn = redis_connection()
    return (
        conn.xlen(outbox.OUTBOX.key()) == 0
        and conn.xpending(outbox.OUTBOX.key(), outbox.OUTBOX.group)["pending"] == 0
    )


def test_the_events_of_many_transactions_go_out_once_each_through_the_worker(runs, receiver):
    # when five transactions tell their events, one after the other
    for run in runs:
        event = RunEvent(run=run, kind="run.started", data={})
        lifecycle_events.send(sender=RunEvent, events=[event])
    # then the worker delivers each once, and the outbox is left empty
    wait_for(lambda: len(receiver.requests) == 5, what="five deliveries")
    assert delivered_runs() == sorted(str(run.pk) for run in runs)
    wait_for(outbox_settled, what="the outbox emptied")


def test_a_drain_takes_every_entry_waiting_at_once(runs, monkeypatch):
    # given five transactions' events waiting, three in one entry
    appended_unwoken(entry(*(item(run) for run in runs[:3])), entry(item(runs[3])), entry(item(runs[4])))
    calls = []
    real = outbox.events_out

    def counted(*, events):
        calls.append(len(events))
        real(events=events)

    # when a drain runs
    monkeypatch.setattr(outbox, "events_out", counted)
    taken = outbox.events_out_drain()
    # then it sent them out together, and acknowledged and deleted the entries
    assert taken == 3 and calls == [5]
    assert delivered_runs() == sorted(str(run.pk) for run in runs)
    assert outbox_settled()


def test_a_drain_that_fails_on_the_database_leaves_its_entries_and_the_retry_sends_them(runs, monkeypatch):
    appended_unwoken(entry(item(runs[0])), entry(item(runs[1])))

    def database_gone(*, events):
        raise OperationalError("the database went away")

    # when the drain fails on the database
    monkeypatch.setattr(outbox, "events_out", database_gone)
    with pytest.raises(OperationalError):
        outbox.events_out_drain()
    # then nothing went out and both entries wait under this consumer
    pending = redis_connection().xpending_range(outbox.OUTBOX.key(), outbox.OUTBOX.group, "-", "+", 10)
    assert [p["consumer"] for p in pending] == [consumer_name()] * 2
    assert delivered_runs() == []
    # and the retried task sends them, once
    monkeypatch.undo()
    assert outbox.events_out_drain() == 2
    assert delivered_runs() == sorted(str(run.pk) for run in runs[:2])
    assert outbox_settled()


def test_the_entries_of_a_worker_that_died_are_taken_over_by_the_next_drain(runs):
    conn = redis_connection()
    ids = appended_unwoken(entry(item(runs[0])), entry(item(runs[1])))
    # given a worker that read both entries and died (their idle time says: long ago)
    outbox.OUTBOX.group_ensure(conn)
    conn.xreadgroup(outbox.OUTBOX.group, "worker-that-died", {outbox.OUTBOX.key(): ">"}, count=10)
    conn.xclaim(outbox.OUTBOX.key(), outbox.OUTBOX.group, "worker-that-died", 0, ids, idle=60_000)
    # when another drain runs, it sends them
    assert outbox.events_out_drain() == 2
    assert delivered_runs() == sorted(str(run.pk) for run in runs[:2])
    assert outbox_settled()


def test_a_malformed_entry_is_logged_and_dropped_and_the_others_go_out(runs, caplog):
    appended_unwoken({"e": "{not json"}, {"x": "1"}, entry(item(runs[0])))
    with caplog.at_level(logging.ERROR, logger="webhooks.outbox"):
        assert outbox.events_out_drain() == 3
    assert sum("malformed" in record.getMessage() for record in caplog.records) == 2
    assert delivered_runs() == [str(runs[0].pk)]
    assert outbox_settled()


def test_a_message_with_its_events_queued_by_an_earlier_version_still_goes_out(runs):
    assert events_out_task(events=[item(runs[0])]) == 1
    assert delivered_runs() == [str(runs[0].pk)]


def test_a_drain_that_sent_events_looks_again_and_takes_what_came_meanwhile(runs):
    appended_unwoken(entry(item(runs[0])))
    assert outbox.events_out_drain() == 1
    # then the wake flag stays set: the next transition's events send no task of their own
    assert redis_connection().exists(outbox.OUTBOX.wake_key())
    lifecycle_events.send(sender=RunEvent, events=[RunEvent(run=runs[1], kind="run.started", data={})])
    # and the drain's next look, in the worker, takes them; a look that finds nothing more
    # clears the flag
    wait_for(lambda: delivered_runs() == sorted(str(run.pk) for run in runs[:2]), what="both delivered")
    wait_for(lambda: not redis_connection().exists(outbox.OUTBOX.wake_key()), what="the flag cleared")
    assert outbox_settled()
