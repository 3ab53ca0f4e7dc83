"""A light fleet simulator for `python -m bench.fleet`: thousands of devices on a few connections.

devtools.simulator runs one paho client (and its network thread) per device: fine for the
tests' dozens, but 10,000 of them do not fit on 2 cores. Here a few dozen MQTT connections
each serve a slice of the fleet: a connection subscribes to `P/<device>/cmd/#` of each of its
devices and answers every command at once on that device's topics, as the device would
(`ack`, then `done` with `"ok": true`, both carrying the command's id and its fence), per
docs/protocol.md. It also publishes each device's retained `online` status and its
heartbeats. The broker and the bridges cannot tell these devices from real ones; only their
last wills are missing (no device drops off here).

It is the bench's oracle too: every command is recorded with the device, run, step, attempt
and token it carried and when it arrived, so the bench can count devices commanded more
than once (a second command id for the same device and step) and redeliveries (the same id
again, which is answered again with the same `done`, as an idempotent device would).
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as mqtt

# Topics per SUBSCRIBE packet: a connection subscribes to its few hundred devices in a few packets.
SUBSCRIBE_CHUNK = 200
# Outgoing QoS 1 messages a connection keeps unconfirmed (paho's default is 20): replies of a
# burst of commands go out without waiting for the broker's PUBACKs one window at a time.
MAX_INFLIGHT = 200
# Heartbeats go out in small batches this often, spreading each device's beat over its interval.
HEARTBEAT_TICK_SECONDS = 0.1
# Retained statuses are published in chunks; the next chunk waits while the bridges are this
# many devices behind (every bridge replica receives every status, outside the shared group).
STATUS_CHUNK = 500
STATUS_BACKLOG_MAX = 1000
STOP_TIMEOUT_SECONDS = 5.0


@dataclass(frozen=True)
class Command:
    """One command as a device received it; `at` is time.time() on arrival."""

    device: str
    id: str
    run: str
    step: int
    attempt: int
    token: int | None
    at: float
    redelivery: bool


def _json(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


class FleetSimulator:
    """`names` devices served by `connections` MQTT connections, answering every command at
    once (its `done` `done_after_seconds` later, when set)."""

    def __init__(
        self,
        names: list[str],
        *,
        url: str,
        prefix: str,
        username: str | None = None,
        password: str | None = None,
        connections: int = 24,
        heartbeat_seconds: float = 60.0,
        done_after_seconds: float = 0.0,
    ) -> None:
        from devtools.simulator import _Timers
        from iotqueue.mqtt import client_create

        self.names, self.url, self.prefix = names, url, prefix
        self.heartbeat_seconds = heartbeat_seconds
        # A command's `done` goes this long after its `ack` (0: at once, in the network
        # thread); later ones from devtools.simulator's one timer thread, which never sleeps
        # in a connection's network thread (bench.preview_eta's 2-second commands).
        self.done_after_seconds = done_after_seconds
        self._timers = _Timers() if done_after_seconds > 0 else None
        self.shards = [names[i::connections] for i in range(min(connections, len(names)))]
        self.clients: list[mqtt.Client] = []
        for i, shard in enumerate(self.shards):
            client = client_create(f"bench-fleet-{i}", url=url)
            if username:
                client.username_pw_set(username, password)
            client.max_inflight_messages_set(MAX_INFLIGHT)
            client.user_data_set({"shard": shard, "pending": set(), "ready": threading.Event()})
            client.on_connect, client.on_subscribe = self._on_connect, self._on_subscribe
            client.on_message = self._on_message
            self.clients.append(client)
        self.commands: list[Command] = []
        self.refused_subscriptions = 0
        self.malformed = 0
        self.heartbeats = 0
        self._done: dict[str, bytes] = {}  # command id -> its done, answered again on redelivery
        self._cmd_start = len(prefix) + 1
        self._stop = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None

    # --- connections ------------------------------------------------------------------------

    def start(self, *, timeout: float = 120.0) -> None:
        """Connect every connection and wait until each is subscribed to all its devices."""
        from iotqueue.mqtt import client_connect

        if self._timers is not None:
            self._timers.start()
        for client in self.clients:
            client_connect(client, url=self.url)
        deadline = time.monotonic() + timeout
        for client in self.clients:
            if not client.user_data_get()["ready"].wait(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"fleet connections not subscribed within {timeout}s")
        if self.refused_subscriptions:
            raise RuntimeError(f"the broker refused {self.refused_subscriptions} command subscriptions")

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            return
        shard = userdata["shard"]
        for start in range(0, len(shard), SUBSCRIBE_CHUNK):
            topics = [(f"{self.prefix}/{name}/cmd/#", 1) for name in shard[start : start + SUBSCRIBE_CHUNK]]
            _, mid = client.subscribe(topics)
            userdata["pending"].add(mid)

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:
        self.refused_subscriptions += sum(1 for code in reason_codes if code.is_failure)
        userdata["pending"].discard(mid)
        if not userdata["pending"]:
            userdata["ready"].set()

    def _on_message(self, client, userdata, message: mqtt.MQTTMessage) -> None:
        """A command: record it, answer ack and done on the device's topics (QoS 1); the done
        `done_after_seconds` later when set (a redelivered command's done at once)."""
        topic = message.topic
        device = topic[self._cmd_start : topic.find("/cmd/", self._cmd_start)]
        try:
            body = json.loads(message.payload)
            command_id = body["id"]
        except (ValueError, KeyError, TypeError):
            self.malformed += 1
            return
        token = body.get("token")
        again = self._done.get(command_id)
        self.commands.append(
            Command(
                device,
                command_id,
                str(body.get("run")),
                int(body.get("step") or 0),
                int(body.get("attempt") or 0),
                token,
                time.time(),
                again is not None,
            )
        )
        base = f"{self.prefix}/{device}/"
        if again is None:
            client.publish(base + "ack", _json({"id": command_id, "token": token}), qos=1)
            again = _json({"id": command_id, "ok": True, "token": token, "result": {"device": device}})
            self._done[command_id] = again
            if self._timers is not None:
                self._timers.call_later(self.done_after_seconds, client.publish, base + "done", again, 1)
                return
        client.publish(base + "done", again, qos=1)

    # --- presence -----------------------------------------------------------------------------

    def statuses_publish(self, online_count: Callable[[], int], *, timeout: float = 600.0) -> None:
        """Each device's retained "online", never far ahead of what the bridges recorded."""
        base = online_count()
        for start in range(0, len(self.names), STATUS_CHUNK):
            chunk = self.names[start : start + STATUS_CHUNK]
            for i, name in enumerate(chunk):
                client = self.clients[i % len(self.clients)]
                client.publish(f"{self.prefix}/{name}/status", b"online", qos=1, retain=True)
            published = start + len(chunk)
            deadline = time.monotonic() + timeout
            while online_count() - base < published - STATUS_BACKLOG_MAX:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"bridges stuck at {online_count() - base}/{published} statuses")
                time.sleep(0.1)

    def heartbeats_start(self) -> None:
        if self.heartbeat_seconds > 0:
            self._heartbeat_thread = threading.Thread(target=self._heartbeats, name="fleet-hb", daemon=True)
            self._heartbeat_thread.start()

    def _heartbeats(self) -> None:
        per_tick = len(self.names) * HEARTBEAT_TICK_SECONDS / self.heartbeat_seconds
        owed, index, next_tick = 0.0, 0, time.monotonic()
        while not self._stop.is_set():
            owed += per_tick
            while owed >= 1:
                name = self.names[index % len(self.names)]
                client = self.clients[index % len(self.clients)]
                client.publish(f"{self.prefix}/{name}/heartbeat", _json({"ts": time.time()}), qos=0)
                index, owed, self.heartbeats = index + 1, owed - 1, self.heartbeats + 1
            next_tick += HEARTBEAT_TICK_SECONDS
            self._stop.wait(max(0.0, next_tick - time.monotonic()))

    def stop(self) -> None:
        self._stop.set()
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join(STOP_TIMEOUT_SECONDS)
        if self._timers is not None:
            self._timers.stop()
        for client in self.clients:
            client.disconnect()
            client.loop_stop()

    # --- the oracle ---------------------------------------------------------------------------

    def oracle(self, run_id: str) -> dict[str, Any]:
        """What the devices saw of one run: commands, devices commanded twice, redeliveries."""
        ids_by_step: dict[tuple[str, int], set[str]] = defaultdict(set)
        deliveries: Counter[str] = Counter()
        for command in list(self.commands):
            if command.run != run_id:
                continue
            ids_by_step[(command.device, command.step)].add(command.id)
            deliveries[command.id] += 1
        doubled = sorted(device for (device, _), ids in ids_by_step.items() if len(ids) > 1)
        return {
            "devices_commanded": len({device for device, _ in ids_by_step}),
            "commands": sum(len(ids) for ids in ids_by_step.values()),
            "double_commands": len(doubled),
            "double_commanded_devices": doubled[:20],
            "redeliveries": sum(n - 1 for n in deliveries.values()),
        }

    def first_arrival(self, run_id: str) -> dict[str, float]:
        """When each command of the run first reached its device (time.time())."""
        arrived: dict[str, float] = {}
        for command in list(self.commands):
            if command.run == run_id and command.id not in arrived:
                arrived[command.id] = command.at
        return arrived
