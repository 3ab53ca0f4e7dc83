"""The engine's inbox drain (jobs/inbox.py) with the real batch apply, against the real Redis.

Each batch's last pipeline acknowledges its entries and reads the next ones in the same
round trip. These tests append entries while a batch is being applied (as the bridge does
under load) and check that the drain applies them, in order, and leaves nothing pending
under its consumer — also when its time slice ends during the batch that read them.

The inbox is given a key prefix of its own, so the stack's worker never drains it. The
replies answer no step (command ids nobody issued): the engine records each as
`reply.unknown`, which is what the assertions count.
"""

import json
import time
import uuid

import pytest

from iotqueue.redis_conn import redis_connection, redis_key
from jobs import inbox
from jobs.engine import batch
from jobs.models import RunEvent

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

    def apply(work, *, finally_=None):
        batches.append([payload["command_id"] for _, payload in work.replies])
        if len(batches) == 1:
            append("c-2")
            append("c-3")
        batch.inbox_apply(work, finally_=finally_)

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

    def apply(work, *, finally_=None):
        batches.append([payload["command_id"] for _, payload in work.replies])
        if len(batches) == 1:
            time.sleep(0.3)  # the slice ends during this batch
            append("s-2")
        batch.inbox_apply(work, finally_=finally_)

    applied = inbox.inbox_drain(apply, batch_max=64, linger_ms=0, retried=False)

    assert applied == 2
    assert batches == [["s-1"], ["s-2"]]
    assert unknown_replies() == ["s-1", "s-2"]
    nothing_left()
