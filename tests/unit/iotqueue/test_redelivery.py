"""Messages held through an outage (iotqueue/redelivery.py): order per device, pauses per
device, bounds, and the thread that tries them. The bridge's use of it against a real
database restart is in the stack tier (tests/jobs/test_database_restart.py)."""

from __future__ import annotations

import threading

import pytest

from iotqueue import redelivery
from iotqueue.redelivery import Held, Redelivery


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Server:
    """What the handlers reach: down or up; records what went through, in order."""

    def __init__(self) -> None:
        self.down: set[str] = {"*"}
        self.applied: list[str] = []
        self.tries: list[str] = []
        self.acked: list[str] = []

    def attempt(self, held: Held) -> bool:
        self.tries.append(held.topic)
        if "*" in self.down or held.device in self.down:
            return False
        self.applied.append(held.topic)
        held.ack()
        return True


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def server() -> Server:
    return Server()


def message(server: Server, device: str, topic: str, size: int = 1) -> Held:
    return Held(device=device, topic=topic, payload=b"x" * size, ack=lambda: server.acked.append(topic))


def make(server: Server, clock: Clock, **bounds) -> tuple[Redelivery, list[tuple[str, str]]]:
    dropped: list[tuple[str, str]] = []

    def drop(held: Held, why: str) -> None:
        dropped.append((held.topic, why))
        held.ack()

    return Redelivery(server.attempt, drop, clock=clock, **bounds), dropped


def test_a_held_message_is_tried_after_a_pause_and_again_until_the_server_is_back(server, clock):
    held, _ = make(server, clock)
    held.hold(message(server, "gate-1", "gate-1/status"))

    assert held.tick() == pytest.approx(redelivery.RETRY_FIRST_SECONDS)  # not due yet
    assert server.tries == []
    clock.now += redelivery.RETRY_FIRST_SECONDS
    assert held.tick() == pytest.approx(redelivery.RETRY_FIRST_SECONDS * 2)  # failed: pause doubled
    assert server.tries == ["gate-1/status"]

    server.down.clear()
    clock.now += redelivery.RETRY_FIRST_SECONDS * 2
    assert held.tick() is None
    assert server.applied == ["gate-1/status"]
    assert server.acked == ["gate-1/status"]
    assert held.held_count() == 0


def test_pauses_grow_to_the_maximum_and_never_beyond(server, clock):
    held, _ = make(server, clock)
    held.hold(message(server, "gate-1", "a"))
    pauses = []
    for _ in range(8):
        clock.now += 60
        pauses.append(held.tick())
    assert pauses[0] == pytest.approx(0.5)
    assert max(pauses) == pytest.approx(redelivery.RETRY_MAX_SECONDS)
    assert pauses[-1] == pytest.approx(redelivery.RETRY_MAX_SECONDS)


def test_a_devices_later_messages_wait_behind_its_held_one_and_keep_their_order(server, clock):
    held, _ = make(server, clock)
    assert held.hold_behind(message(server, "lamp-2", "online")) is False  # nothing held: handle now
    held.hold(message(server, "lamp-2", "online"))
    assert held.hold_behind(message(server, "lamp-2", "heartbeat")) is True
    assert held.hold_behind(message(server, "lamp-2", "offline")) is True
    assert held.hold_behind(message(server, "cam-3", "online")) is False  # another device: not held up

    server.down.clear()
    clock.now += 1
    held.tick()
    assert server.applied == ["online", "heartbeat", "offline"]
    assert held.hold_behind(message(server, "lamp-2", "online")) is False  # all through: direct again


def test_one_device_still_failing_does_not_hold_up_another(server, clock):
    held, _ = make(server, clock)
    held.hold(message(server, "bad", "bad/1"))
    held.hold(message(server, "good", "good/1"))
    server.down = {"bad"}
    clock.now += 1
    held.tick()
    assert server.applied == ["good/1"]
    assert held.held_count() == 1
    # The failing device's pause grew; the good device is gone from the schedule.
    assert held.tick() == pytest.approx(0.5)


def test_a_device_over_its_bound_loses_its_oldest_message_for_the_newest(server, clock):
    held, dropped = make(server, clock, per_device=2)
    held.hold(message(server, "gate-1", "first"))
    held.hold_behind(message(server, "gate-1", "second"))
    held.hold_behind(message(server, "gate-1", "third"))
    assert [topic for topic, _ in dropped] == ["first"]
    assert "more than 2 messages of one device" in dropped[0][1]
    assert server.acked == ["first"]  # dropped means acknowledged: the broker's window is freed

    server.down.clear()
    clock.now += 1
    held.tick()
    assert server.applied == ["second", "third"]


def test_past_the_byte_bound_a_new_message_is_dropped(server, clock):
    held, dropped = make(server, clock, max_bytes=10)
    held.hold(message(server, "gate-1", "fits", size=8))
    held.hold(message(server, "cam-3", "too-big", size=8))
    assert [topic for topic, _ in dropped] == ["too-big"]
    assert held.held_count() == 1


def test_the_thread_tries_what_is_held_and_stop_leaves_the_rest_unacknowledged(server):
    went_through = threading.Event()

    def attempt(held: Held) -> bool:
        if held.topic == "stays":
            return False
        went_through.set()
        held.ack()
        return True

    held = Redelivery(attempt, lambda held, why: None)
    held.start()
    try:
        held.hold(message(server, "gate-1", "goes"))
        assert went_through.wait(5.0), "the redelivery thread never tried the held message"
        held.hold(message(server, "cam-3", "stays"))
    finally:
        left = held.stop()
    assert left == 1
    assert server.acked == ["goes"]
