"""Per-device message budgets and dropped-message tallies (iotqueue/budget.py), on a fake clock."""

from __future__ import annotations

import pytest

from iotqueue import budget


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_device_gets_its_burst_then_its_rate():
    clock = Clock()
    subject = budget.MessageBudget(rate=10, burst=5, clock=clock)

    assert [subject.admit("flood") for _ in range(7)] == [True] * 5 + [False] * 2
    clock.now += 0.2  # two tokens' worth
    assert [subject.admit("flood") for _ in range(3)] == [True, True, False]


def test_one_device_over_its_budget_leaves_the_others_theirs():
    subject = budget.MessageBudget(rate=1, burst=2, clock=Clock())
    for _ in range(100):
        subject.admit("flood")

    assert subject.admit("quiet") and subject.admit("quiet")


def test_idle_buckets_are_forgotten():
    clock = Clock()
    subject = budget.MessageBudget(rate=1, burst=2, clock=clock)
    subject.admit("gone")
    clock.now += budget.BUCKET_IDLE_SECONDS / 2
    subject.admit("here")
    clock.now += budget.BUCKET_IDLE_SECONDS / 2 + 1

    assert subject.idle_forget() == 1 and len(subject) == 1


def test_a_budget_nobody_sweeps_forgets_idle_buckets_itself():
    # given a budget whose owner never calls idle_forget, and many devices that went quiet
    clock = Clock()
    subject = budget.MessageBudget(rate=1, burst=2, clock=clock)
    for n in range(1000):
        subject.admit(f"device-{n}")
    clock.now += budget.BUCKET_IDLE_SECONDS + 1

    # when one more device talks
    subject.admit("here")

    # then the quiet ones are gone
    assert len(subject) == 1


def test_a_budget_needs_a_positive_rate():
    with pytest.raises(ValueError):
        budget.MessageBudget(rate=0, burst=5)


def note(tally: budget.DropTally, device: str, reason: str = "malformed", message: str = "not JSON") -> None:
    tally.note(device=device, reason=reason, message=message, topic=f"P/{device}/done", size=9)


def test_the_first_drop_is_reported_at_once_and_the_rest_once_a_window():
    clock = Clock()
    tally = budget.DropTally(clock=clock)

    # when a device floods garbage
    note(tally, "flood")
    first = tally.summaries_take()
    for _ in range(10_000):
        note(tally, "flood", message="done: payload is not JSON")
    clock.now += 1
    assert tally.summaries_take() == []  # inside the window: nothing yet
    clock.now += budget.DROP_WINDOW_SECONDS

    # then one summary for the first and one for the other 10,000, naming the count
    [rest] = tally.summaries_take()
    assert [(s.device, s.count) for s in first] == [("flood", 1)]
    assert (rest.device, rest.count, rest.message, rest.topic) == (
        "flood",
        10_000,
        "done: payload is not JSON",
        "P/flood/done",
    )


def test_a_quiet_entry_goes_after_a_window():
    clock = Clock()
    tally = budget.DropTally(clock=clock)
    note(tally, "once")
    tally.summaries_take()
    clock.now += budget.DROP_WINDOW_SECONDS

    assert tally.summaries_take() == [] and len(tally) == 0


def test_a_device_cannot_grow_the_tally_by_varying_its_reasons():
    tally = budget.DropTally(clock=Clock())
    for number in range(50):
        note(tally, "flood", reason=f"reason {number}")

    assert len(tally) == budget.REASONS_PER_DEVICE + 1
    counts = {s.reason: s.count for s in tally.summaries_take()}
    assert counts[budget.OTHER_REASONS] == 50 - budget.REASONS_PER_DEVICE


def test_summaries_go_to_every_sink_and_a_failing_sink_does_not_stop_the_others(monkeypatch):
    monkeypatch.setattr(budget, "_sinks", [])
    tally, received = budget.DropTally(clock=Clock()), []
    budget.drop_sink_register(lambda summaries: 1 / 0)
    budget.drop_sink_register(received.extend)
    note(tally, "flood")

    assert budget.drop_summaries_report(tally) == 1
    assert [s.device for s in received] == ["flood"]


def test_after_a_reconnect_what_a_device_sent_meanwhile_is_admitted_not_taken_for_a_flood():
    # given a device that used its burst, then the bridge was away ten minutes
    clock = Clock()
    subject = budget.MessageBudget(rate=1, burst=10, clock=clock)
    while subject.admit("flashing"):
        pass
    clock.now += 600

    # when the bridge reconnects and the broker replays 100 queued messages at once
    subject.surge(seconds=60, factor=10)
    admitted = sum(subject.admit("flashing") for _ in range(100))

    # then they pass (the time away is credited, up to ten bursts), and a flood still stops
    assert admitted == 100
    assert sum(subject.admit("flashing") for _ in range(100)) == 0
    # and once the surge is over the burst is the normal one again
    clock.now += 600
    assert sum(subject.admit("flashing") for _ in range(100)) == 10
