"""The beat's tick record for its health check (iotqueue/beat_lease.py TickRecorder), on a fake
Redis client and clock: at most one write a second, naming the owner and whether it holds."""

from __future__ import annotations

import socket

import redis

from iotqueue.beat_lease import TICK_LUA, TICK_RECORD_SECONDS, Lease, LeaseGate, TickRecorder, beat_tick_key


class ScriptClient:
    """Records each call of a registered script; `down` makes the tick script fail."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], list[object]]] = []
        self.down = False

    def register_script(self, text: str):
        def run(keys: list[str], args: list[object]) -> int:
            if text == TICK_LUA:
                if self.down:
                    raise redis.ConnectionError("Redis is down")
                self.calls.append((keys, args))
            return 1

        return run


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def recorder(client: ScriptClient, clock: Clock) -> TickRecorder:
    gate = LeaseGate(Lease(client, "k", 9.0, owner="host:1:ab"), clock=clock)
    gate.holding = True
    return TickRecorder(gate, clock=clock)


def test_ticks_are_recorded_at_most_once_a_second_with_owner_and_holding():
    # given a holder's recorder
    client, clock = ScriptClient(), Clock()
    ticks = recorder(client, clock)

    # when it ticks three times within a second, then once more a second later
    ticks.tick()
    clock.now += TICK_RECORD_SECONDS / 2
    ticks.tick()
    ticks.tick()
    clock.now += TICK_RECORD_SECONDS
    ticks.tick()

    # then two records were written, each naming the owner, holding, and an expiry of 3 leases
    assert len(client.calls) == 2
    keys, args = client.calls[0]
    assert keys == [beat_tick_key(socket.gethostname())]
    assert args[0] == "host:1:ab" and args[1] == 1 and args[3] == 27


def test_a_redis_error_is_swallowed():
    # given Redis down
    client, clock = ScriptClient(), Clock()
    client.down = True

    # when the beat ticks, nothing is raised (the record just ages)
    recorder(client, clock).tick()
    assert client.calls == []
