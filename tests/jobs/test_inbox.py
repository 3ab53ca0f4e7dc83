"""The engine's inbox drain (jobs/inbox.py) with the real batch apply, against the real Redis.

One pipeline after each batch sends its last writes, acknowledges its entries and reads
the next ones (one round trip). These tests append entries while a batch is being applied
(as the bridge does under load) and check that the drain applies them, in order, and
leaves nothing pending under its consumer — also when its time slice ends during the
batch that read them.

The inbox is given a key prefix of its own, so the stack's worker never drains it. The
replies answer no step (command ids nobody issued): the engine records each as
`reply.unknown`, which is what the assertions count.
"""

import json
import time
import uuid

import pytest
from django.db import OperationalError

from iotqueue.redis_conn import redis_connection, redis_key
from jobs import inbox
from jobs.engine import batch
from jobs.models import JobRun, RunEvent, RunStatus
from jobs.services import run_start
from tests.factories import DeviceFactory, template_with_steps

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(60)]


@pytest.fixture
def own_inbox(settings):
    settings.IOTQUEUE_REDIS_KEY_PREFIX = f"{settings.IOTQUEUE_REDIS_KEY_PREFIX}-inbox-{uuid.uuid4().hex[:8]}"
    yield
    conn = redis_connection()
    conn.delete(*conn.keys(f"{settings.IOTQUEUE_REDIS_KEY_PREFIX}:*") or ["none"])


def append(command_id: str) -> None:
    """What the bridge appends for one reply (without waking a worker: the test drains)."""
    reply = ["dev-inbox-test", {"kind": "done", "command_id": command_id, "ok": True}]
    redis_connection().xadd(redis_key("inbox"), {"r": json.dumps([reply])})


def unknown_replies() -> list[str]:
    events = RunEvent.objects.filter(kind="reply.unknown", device="dev-inbox-test").order_by("id")
    return [event.message.rsplit(" ", 1)[-1] for event in events]  # "done for unknown command <id>"


def nothing_left() -> None:
    conn = redis_connection()
    assert conn.xlen(redis_key("inbox")) == 0
    assert conn.xpending(redis_key("inbox"), inbox.GROUP)["pending"] == 0


def test_entries_that_arrive_during_a_batch_are_read_with_its_last_pipeline(own_inbox):
    append("c-1")
    batches = []

    def apply(work):
        batches.append([payload["command_id"] for _, payload in work.replies])
        if len(batches) == 1:
            append("c-2")
            append("c-3")
        return batch.inbox_apply(work)

    applied = inbox.inbox_drain(apply, batch_max=64, linger_ms=0, retried=False)

    assert applied == 3
    assert batches == [["c-1"], ["c-2", "c-3"]]
    assert unknown_replies() == ["c-1", "c-2", "c-3"]
    nothing_left()


def test_entries_read_as_the_time_slice_ends_are_applied_by_that_drain(own_inbox, monkeypatch):
    """A new task reads only new entries: ones this drain read must not be left pending."""
    monkeypatch.setattr(inbox, "DRAIN_SECONDS", 0.2)
    append("s-1")
    batches = []

    def apply(work):
        batches.append([payload["command_id"] for _, payload in work.replies])
        if len(batches) == 1:
            time.sleep(0.3)  # the slice ends during this batch
            append("s-2")
        return batch.inbox_apply(work)

    applied = inbox.inbox_drain(apply, batch_max=64, linger_ms=0, retried=False)

    assert applied == 2
    assert batches == [["s-1"], ["s-2"]]
    assert unknown_replies() == ["s-1", "s-2"]
    nothing_left()


def test_a_poison_reply_is_dropped_alone_and_the_rest_of_its_batch_applies(own_inbox):
    """A reply the engine cannot write (an id with a lone surrogate, as a bridge before the
    text check let through) made the whole batch raise, then be dropped by the monitor with
    every other device's replies and run starts in it."""
    # given a pending run (its start waits in the inbox) and, in one entry as the bridge
    # groups them, a poison reply between two other devices' replies
    device = DeviceFactory()
    run, _ = run_start(template=template_with_steps((device, "noop", {})))
    poison = ["atk-1", {"kind": "done", "command_id": "poison-\ud800", "ok": True}]
    good = [["dev-inbox-test", {"kind": "done", "command_id": f"c-{n}", "ok": True}] for n in (1, 2)]
    redis_connection().xadd(redis_key("inbox"), {"r": json.dumps([good[0], poison, good[1]])})

    # when the drain applies them
    inbox.inbox_drain(batch.inbox_apply, batch_max=64, linger_ms=0, retried=False)

    # then the others were applied: the replies recorded, the run started
    assert unknown_replies() == ["c-1", "c-2"]
    run.refresh_from_db()
    assert run.status == RunStatus.RUNNING
    # and the poison alone was dropped, recorded on its device with what went wrong
    dropped = RunEvent.objects.get(kind="message.dropped", device="atk-1")
    assert "poison-\\ud800 could not be applied" in dropped.message
    nothing_left()


def test_a_run_whose_start_fails_alone_is_failed_and_the_others_start(own_inbox, monkeypatch):
    # given two pending runs, one of which the engine cannot start
    device = DeviceFactory()
    template = template_with_steps((device, "noop", {}))
    first, _ = run_start(template=template)
    second, _ = run_start(template=template)
    JobRun.objects.filter(pk=first.pk).update(plan=[{"kind": "no-such-kind"}])

    # when the drain applies their starts together
    inbox.inbox_drain(batch.inbox_apply, batch_max=64, linger_ms=0, retried=False)

    # then the one that failed alone is failed, saying why, and the other started
    first.refresh_from_db()
    second.refresh_from_db()
    assert first.status == RunStatus.FAILED and "could not be started" in first.error
    assert second.status == RunStatus.RUNNING
    nothing_left()


def test_a_batch_that_fails_as_a_whole_is_not_acknowledged_and_the_retry_applies_it(own_inbox):
    # given an entry, and a batch apply that finds the database away once
    append("t-1")

    def database_away(work):
        raise OperationalError("the database is away (injected)")

    # when the drain applies it
    with pytest.raises(OperationalError):
        inbox.inbox_drain(database_away, batch_max=64, linger_ms=0, retried=False)

    # then the entry is left pending under the drain's consumer, applied by the retried task
    conn = redis_connection()
    assert conn.xpending(redis_key("inbox"), inbox.GROUP)["pending"] == 1
    assert unknown_replies() == []
    applied = inbox.inbox_drain(batch.inbox_apply, batch_max=64, linger_ms=0, retried=True)
    assert applied == 1
    assert unknown_replies() == ["t-1"]
    nothing_left()
