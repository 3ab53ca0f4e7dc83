"""Dropped device messages are tallied, not written one row each (issue 31, finding 5):
jobs/replies.py notes them in the bridge's tally and writes its summaries as events."""

from __future__ import annotations

import pytest

from iotqueue import budget
from iotqueue.metrics import CounterBuffer
from jobs import replies
from jobs.models import RunEvent

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def tally(monkeypatch) -> budget.DropTally:
    """A fresh tally, and counts kept in the process (no Redis in this tier)."""
    fresh = budget.DropTally()
    monkeypatch.setattr(budget, "drop_tally", fresh)
    monkeypatch.setattr(replies, "counter_buffer", CounterBuffer(flush_seconds=3600))
    return fresh


def test_a_flood_of_garbage_writes_no_row_on_the_bridge_thread(settings, tally):
    # when a device sends a thousand malformed replies
    for _ in range(1000):
        replies.reply_message_handle(f"{settings.IOTQUEUE_TOPIC_PREFIX}/flood/done", b"\xff not json")

    # then nothing is written yet, and the tally holds one entry for them
    assert not RunEvent.objects.exists()
    [summary] = tally.summaries_take()
    assert (summary.device, summary.count) == ("flood", 1000)


@pytest.mark.django_db(transaction=True)  # the sink recycles the connection, as between ticks
def test_summaries_are_written_as_one_event_each_naming_the_count():
    flood = budget.DropSummary("flood", "over budget", 41398, "over the budget", "P/flood/done", 9, 10.0)
    once = budget.DropSummary("lamp", "done: not JSON", 1, "done: not JSON", "P/lamp/done", 3, 0.0)

    replies.dropped_summaries_record([flood, once])

    events = {event.device: event for event in RunEvent.objects.filter(kind="message.dropped")}
    expected = "41398 messages dropped in 10 s (over budget); the last: over the budget"
    assert events["flood"].message == expected
    assert events["flood"].data == {"topic": "P/flood/done", "size": 9, "count": 41398}
    assert events["lamp"].message == "done: not JSON"


def test_a_device_asking_jobs_get_in_a_loop_is_answered_at_most_its_rate(settings, tally, monkeypatch):
    sent = []
    monkeypatch.setattr(replies, "current_app", type("App", (), {"signature": lambda *a, **k: Sent(sent)})())
    monkeypatch.setattr(replies, "jobs_get_budget", budget.MessageBudget(rate=0.001, burst=3))

    for _ in range(50):
        replies.jobs_get_handle(f"{settings.IOTQUEUE_TOPIC_PREFIX}/chatty/jobs/get", b"")

    assert len(sent) == 3
    [summary] = tally.summaries_take()
    assert (summary.device, summary.count) == ("chatty", 47)


class Sent:
    def __init__(self, sent: list) -> None:
        self.sent = sent

    def delay(self) -> None:
        self.sent.append(1)

    def apply_async(self, **options) -> None:
        self.sent.append(options)
