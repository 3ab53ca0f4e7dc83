"""Simulated devices speaking device protocol v1.1 over real MQTT, and the device-lock oracle.

Each simulated device is a real paho client: it subscribes to its command topic, keeps a
retained online/offline status (offline is also its last will), sends heartbeats, and answers
commands with ack / progress / done after a random latency, and it keeps the rules of
docs/protocol.md for late commands: one from an attempt the server has moved past (a lower
token, or its deadline gone) is not started, and a command with a higher token supersedes
the one in flight. Above all it is the test oracle for the device lock: it records, and logs
at ERROR, every command that arrives while another the server may still count as in flight
(no done yet, deadline not passed) is on the same device, and every fencing token that goes
backwards on a command the server may still count as current.

What to do with each command (run it, a duplicate, stale, expired, superseding the one in
flight) is decided by the device agent library's core, `iotqueue_device.core.CommandBook`,
the same rules a device built on that library keeps; this module adds the connections, the
timed answers and the oracle. The light fleet simulator of `bench.fleet` (bench/fleet_sim.py)
is separate and unchanged.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import random
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import paho.mqtt.client as mqtt
from iotqueue_device import protocol as device_protocol
from iotqueue_device.core import CommandBook, Decision, Verdict

from devices import protocol
from iotqueue.mqtt import client_connect, client_create

log = logging.getLogger(__name__)

# Commands kept per device for received(): plenty for any test's assertions, bounded so a long
# soak does not grow the simulator. The counters in stats() are never truncated.
RECEIVED_KEPT = 1000
# How long stop() waits for the broker's PUBACKs of the final "offline" statuses.
STOP_TIMEOUT_SECONDS = 5.0
ONLINE, OFFLINE = b"online", b"offline"
# "late": commands not started because the server had moved past them (docs/protocol.md,
# late commands); "superseded": commands abandoned when one with a higher token came.
COUNTERS = (
    "commands",
    "duplicates",
    "failures",
    "rejected",
    "canceled",
    "malformed",
    "reboots",
    "late",
    "superseded",
)


@dataclass(frozen=True)
class DeviceBehaviour:
    """How one simulated device answers; the defaults are a healthy, modern device."""

    latency_min_ms: float = 20.0
    latency_max_ms: float = 80.0
    failure_rate: float = 0.0  # probability that a command's done says ok=false (retryable)
    failing_actions: frozenset[str] = frozenset()  # these actions always fail (e.g. one broken operation)
    silent: bool = False  # online and subscribed, but never replies to a command
    progress: bool = True  # send one progress message halfway through
    command_topic: str = ""  # legacy firmware: the one fixed topic commands arrive on
    reply_topic: str = ""  # legacy firmware: the one topic replies go to (done only)
    # v1.1: loses its connection (and its memory) once per command right after receiving it,
    # reconnects, asks with jobs/get and finishes the command jobs/current names.
    reboots: bool = False
    rejecting_actions: frozenset[str] = frozenset()  # v1.1: done says "status": "rejected"
    extend_seconds: float = 0.0  # v1.1: early in each command, a progress asking for this much
    # (action, ms) pairs: these actions take this long instead of the latency (a slow
    # command, e.g. a firmware download, that another can preempt while it is in flight)
    action_latency_ms: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.latency_min_ms <= self.latency_max_ms:
            raise ValueError(
                f"latency must satisfy 0 <= min <= max, not {self.latency_min_ms}..{self.latency_max_ms}"
            )
        if not 0.0 <= self.failure_rate <= 1.0:
            raise ValueError(f"failure_rate must be within 0..1, not {self.failure_rate}")

    def configured(self, knobs: dict[str, Any]) -> DeviceBehaviour:
        """This behaviour with a Device.config["simulator"] dict applied.

        Example: {"latency_ms": [20, 80], "failure_rate": 0.1, "silent": false, "progress": true}.
        Raises ValueError on a malformed value; unknown keys are logged and ignored.
        """
        changes: dict[str, Any] = {}
        for key, value in knobs.items():
            if key == "latency_ms" and isinstance(value, (list, tuple)) and len(value) == 2:
                changes["latency_min_ms"], changes["latency_max_ms"] = float(value[0]), float(value[1])
            elif key in ("latency_min_ms", "latency_max_ms", "failure_rate"):
                changes[key] = float(value)
            elif key in ("silent", "progress", "reboots") and isinstance(value, bool):
                changes[key] = value
            elif key == "extend_seconds" and isinstance(value, (int, float)) and not isinstance(value, bool):
                changes[key] = float(value)
            elif key in ("latency_ms", "silent", "progress", "reboots", "extend_seconds"):
                raise ValueError(f"simulator knob {key!r} has a malformed value {value!r}")
            else:
                log.warning("ignoring unknown simulator knob %r", key)
        return replace(self, **changes)


class Overlap(NamedTuple):
    """A lock violation: new_id arrived on device while in_flight_id had no done yet and its
    deadline had not passed, i.e. while the server could still count it in flight."""

    device: str
    in_flight_id: str
    new_id: str


class TokenRegression(NamedTuple):
    """A fencing violation: command_id carried a token lower than one the device already saw,
    and its deadline had not passed (a command the server could still count as current)."""

    device: str
    command_id: str
    previous: int
    token: int


def _command_parse(body: Any, topic: str) -> tuple[dict[str, Any], device_protocol.Command]:
    """A received command as a record and as the core reads it; raise ProtocolError when it
    has no usable id or args."""
    try:
        command = device_protocol.command_parse(body, action=topic.partition("/cmd/")[2])
    except device_protocol.ProtocolError as exc:
        raise protocol.ProtocolError(str(exc)) from None
    record = {name: body.get(name) for name in ("id", "run", "step", "attempt", "token", "deadline")}
    record = {**record, "action": command.action, "args": command.args, "topic": topic, "at": time.time()}
    return record, command


def _json(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


@dataclass(order=True)
class _Timer:
    due: float
    seq: int
    fn: Callable[..., None] = field(compare=False)
    args: tuple = field(compare=False)
    canceled: bool = field(default=False, compare=False)

    def cancel(self) -> None:
        self.canceled = True


class _Timers:
    """One daemon thread running callbacks when due, shared by all devices (one thread, not N).

    Callbacks run one at a time and must not block; an exception is logged, never fatal.
    """

    def __init__(self) -> None:
        self._heap: list[_Timer] = []
        self._cond = threading.Condition()
        self._seq = itertools.count()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="simulator-timers", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def call_later(self, delay: float, fn: Callable[..., None], *args: Any) -> _Timer:
        timer = _Timer(time.monotonic() + delay, next(self._seq), fn, args)
        with self._cond:
            heapq.heappush(self._heap, timer)
            if self._heap[0] is timer:
                self._cond.notify()
        return timer

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(STOP_TIMEOUT_SECONDS)

    def _next(self) -> _Timer | None:
        with self._cond:
            while not self._stopped:
                delay = self._heap[0].due - time.monotonic() if self._heap else None
                if delay is not None and delay <= 0:
                    return heapq.heappop(self._heap)
                self._cond.wait(delay)
            return None

    def _run(self) -> None:
        while (timer := self._next()) is not None:
            if not timer.canceled:
                try:
                    timer.fn(*timer.args)
                except Exception:
                    log.exception("simulator timer %r failed", timer.fn)


class SimulatedDevice:
    """One simulated device: a real MQTT client plus the lock oracle's records for it.

    paho calls on_message in this device's network thread, which records the command and
    publishes the ack; progress and done are published later by the shared timer thread, so
    the network thread never sleeps. One lock guards the records and the in-flight set.
    """

    def __init__(
        self,
        name: str,
        behaviour: DeviceBehaviour,
        *,
        timers: _Timers,
        rng: random.Random,
        url: str | None,
        password: str | None = None,
    ) -> None:
        self.name, self.behaviour = name, behaviour
        self._timers, self._rng, self._url, self._password = timers, rng, url, password
        self._status_topic = protocol.device_topic(name, "status")
        self._heartbeat_topic = protocol.device_topic(name, "heartbeat")
        # "#", not "+": actions may span levels (resource/check), and so may their command topics.
        self._subscription = behaviour.command_topic or protocol.command_topic(name, "#")
        self._reply_topics = {kind: protocol.device_topic(name, kind) for kind in protocol.REPLY_KINDS}
        self._jobs_get = protocol.device_topic(name, protocol.JOBS_GET)
        self._jobs_current = protocol.device_topic(name, protocol.JOBS_CURRENT)
        self._rebooted: set[str] = set()  # commands this device rebooted in the middle of
        self.jobs_current: list[dict[str, Any]] = []  # v1.1 answers to its jobs/get, in order
        self._lock = threading.Lock()
        # What the device knows (fence, commands in flight, finished ids and their done) and
        # the decisions drawn from it; the timers of each command in flight beside it.
        self._book = CommandBook()
        self._in_flight: dict[str, list[_Timer]] = {}
        self._client: mqtt.Client | None = None
        self.subscribed = threading.Event()
        self._received: deque[dict[str, Any]] = deque(maxlen=RECEIVED_KEPT)
        self.overlaps: list[Overlap] = []
        self.token_regressions: list[TokenRegression] = []
        self.counts = dict.fromkeys(COUNTERS, 0)

    def connect(self) -> None:
        """Start a fresh client (last will: offline, retained) connecting in its network thread."""
        client = client_create(f"sim-{self.name}", url=self._url)
        if self._password is not None:  # log in as the device itself, not as the URL's user
            client.username_pw_set(self.name, self._password)
        client.will_set(self._status_topic, OFFLINE, qos=1, retain=True)
        client.on_connect, client.on_subscribe = self._on_connect, self._on_subscribe
        client.on_disconnect, client.on_message = self._on_disconnect, self._on_message
        self._client = client
        client_connect(client, url=self._url)

    def disconnect(self, *, deadline: float) -> None:
        """Publish a retained "offline", wait for its PUBACK until deadline, then disconnect."""
        client, self._client = self._client, None
        if client is None:
            return
        self._abandon()
        info = client.publish(self._status_topic, OFFLINE, qos=1, retain=True)
        try:
            info.wait_for_publish(timeout=max(0.0, deadline - time.monotonic()))
        except (RuntimeError, ValueError) as exc:
            log.warning("simulated device %s: offline status not confirmed: %s", self.name, exc)
        client.disconnect()
        client.loop_stop()
        self.subscribed.clear()

    def kill(self) -> None:
        """Drop the TCP connection without DISCONNECT, as a power cut would: the broker then
        publishes the last will. In-flight commands are lost; connect() brings the device back."""
        client, self._client = self._client, None
        if client is None:
            return
        self._abandon()
        sock = client.socket()
        # The flag loop_stop() sets, set before the socket dies so paho exits instead of reconnecting.
        client._thread_terminate = True
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        client.loop_stop()
        if sock is not None:
            sock.close()
        self.subscribed.clear()

    def received(self) -> list[dict[str, Any]]:
        """The commands this device received, in order, duplicates included (flagged)."""
        with self._lock:
            return list(self._received)

    def heartbeat(self) -> None:
        client = self._client
        if client is not None and self.subscribed.is_set():
            client.publish(self._heartbeat_topic, _json({"ts": time.time()}), qos=0)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                **self.counts,
                "overlaps": len(self.overlaps),
                "token_regressions": len(self.token_regressions),
                "in_flight": len(self._book.flights),
                "online": self.subscribed.is_set(),
            }

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log.warning("simulated device %s: connect refused: %s", self.name, reason_code)
            return
        if self.behaviour.reboots:
            client.subscribe([(self._subscription, 1), (self._jobs_current, 1)])
        else:
            client.subscribe(self._subscription, qos=1)
        client.publish(self._status_topic, ONLINE, qos=1, retain=True)

    def _on_subscribe(self, client, userdata, mid, reason_code_list, properties) -> None:
        if any(code.is_failure for code in reason_code_list):
            log.error("simulated device %s: subscription to %s refused", self.name, self._subscription)
        else:
            self.subscribed.set()
            if self.behaviour.reboots:
                # A v1.1 device asks what it should be doing every time it (re)connects.
                client.publish(self._jobs_get, b"{}", qos=1)

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        self.subscribed.clear()
        if reason_code.is_failure:
            log.info("simulated device %s disconnected: %s", self.name, reason_code)

    def _on_message(self, client, userdata, message: mqtt.MQTTMessage) -> None:
        if message.topic == self._jobs_current:
            self._command_resume(message.payload)
            return
        if not mqtt.topic_matches_sub(self._subscription, message.topic):
            # amqtt 0.12 re-sends retained messages to later subscribers of unrelated filters.
            log.debug("simulated device %s: ignoring stray message on %s", self.name, message.topic)
            return
        try:
            record, command = _command_parse(protocol.payload_json(message.payload), message.topic)
        except protocol.ProtocolError as exc:
            with self._lock:
                self.counts["malformed"] += 1
            log.warning("simulated device %s: malformed command on %s: %s", self.name, message.topic, exc)
            return
        if command.action == protocol.CANCEL_ACTION:
            self._cancel(record)
        else:
            self._command_start(record, command)

    def _command_start(self, record: dict[str, Any], command: device_protocol.Command) -> None:
        command_id = command.id
        with self._lock:
            now = time.time()
            decision = self._book.command(command, now)
            duplicate = decision.verdict is Verdict.DUPLICATE
            # received_at (monotonic seconds): when it arrived, for tests that measure a pace;
            # late: not started, the server had moved past it.
            record = {**record, "duplicate": duplicate, "late": False, "received_at": time.monotonic()}
            self._received.append(record)
            if duplicate:
                self.counts["duplicates"] += 1
                log.info("simulated device %s: duplicate command %s", self.name, command_id)
                if decision.replay is not None:  # an idempotent device answers a finished command again
                    self._reply("done", _json(decision.replay))
                return
            if not self._admitted(record, decision, now):
                record["late"] = True
                return
            self.counts["commands"] += 1
            if self.behaviour.silent:
                self._book.abandon(command_id)
                return
            self._reply("ack", _json({"id": command_id}))
            if self.behaviour.reboots and command_id not in self._rebooted:
                self._rebooted.add(command_id)
                self.counts["reboots"] += 1
                # Not from paho's network thread: kill() joins that thread.
                self._timers.call_later(0, self._reboot)
                return
            self._in_flight[command_id] = self._schedule(record)

    def _reboot(self) -> None:
        """Timer callback: power-cycle; the command in hand is forgotten, jobs/get recovers it."""
        log.info("simulated device %s reboots", self.name)
        self.kill()
        self.connect()

    def _command_resume(self, payload: bytes) -> None:
        """A jobs/current answer: finish the command it names, unless already at it or done."""
        try:
            answer = protocol.payload_json(payload)
            body = answer.get("command") if isinstance(answer, dict) else None
            record, command = _command_parse(body, "") if body is not None else (None, None)
        except protocol.ProtocolError as exc:
            log.warning("simulated device %s: malformed jobs/current: %s", self.name, exc)
            return
        with self._lock:
            self.jobs_current.append(answer)
            if command is None:
                return
            now = time.time()
            decision = self._book.current(command, now)
            if decision.verdict is Verdict.DUPLICATE:
                return  # at it already, or done: the server has (or will have) its done
            if self._admitted(record, decision, now):
                self._in_flight[command.id] = self._schedule(record)

    def _admitted(self, record: dict[str, Any], decision: Decision, now: float) -> bool:
        """Whether the core let the command start (docs/protocol.md, late commands), checking
        the lock and the fence on the way; called with the lock held.

        Not started (counted "late", never answered: the server has moved past it): a token
        lower than one already seen, or a deadline already passed. A higher token superseded
        the commands in flight: the server only grants it once their attempts ended.
        """
        if decision.verdict is Verdict.STALE:
            deadline = decision.command.deadline if decision.command else None
            if deadline is None or now < deadline:
                fence = self._book.fence if self._book.fence is not None else -1
                regression = TokenRegression(self.name, record["id"], fence, int(record["token"]))
                self.token_regressions.append(regression)
                log.error("FENCING VIOLATION %s, run %s step %s", regression, record["run"], record["step"])
            return self._late(record, decision.reason)
        if decision.verdict is Verdict.EXPIRED:
            return self._late(record, decision.reason)
        if decision.live:
            overlap = Overlap(self.name, decision.live[0], record["id"])
            self.overlaps.append(overlap)
            log.error("LOCK VIOLATION %s, run %s step %s", overlap, record["run"], record["step"])
        for command_id in decision.superseded:
            for timer in self._in_flight.pop(command_id, []):
                timer.cancel()
            self.counts["superseded"] += 1
            log.info("simulated device %s: command %s superseded by %s", self.name, command_id, record["id"])
        return True

    def _late(self, record: dict[str, Any], why: str) -> bool:
        self.counts["late"] += 1
        log.info("simulated device %s: late command %s not started: %s", self.name, record["id"], why)
        return False

    def _schedule(self, command: dict[str, Any]) -> list[_Timer]:
        behaviour = self.behaviour
        latency = self._rng.uniform(behaviour.latency_min_ms, behaviour.latency_max_ms) / 1000
        latency = dict(behaviour.action_latency_ms).get(command["action"], latency * 1000) / 1000
        timers = [self._timers.call_later(latency, self._command_finish, command)]
        if behaviour.progress and not behaviour.reply_topic:
            body = _json({"id": command["id"], "progress": 50})
            timers.append(self._timers.call_later(latency / 2, self._reply, "progress", body))
        if behaviour.extend_seconds and not behaviour.reply_topic:
            body = _json(
                {
                    "id": command["id"],
                    "progress": 10,
                    "extend_seconds": behaviour.extend_seconds,
                    "detail": "working; asking for more time",
                }
            )
            timers.append(self._timers.call_later(latency / 10, self._reply, "progress", body))
        if behaviour.extend_seconds and not behaviour.reply_topic:
            # The oracle errs towards counting an overlap: live for the time asked for,
            # whether or not the server grants it.
            self._book.extend(command["id"], time.time() + latency / 10 + behaviour.extend_seconds)
        return timers

    def _command_finish(self, command: dict[str, Any]) -> None:
        """Timer callback: the command is done; it leaves the in-flight set before done is sent,
        so the next command the done unblocks can never look like an overlap."""
        rejected = command["action"] in self.behaviour.rejecting_actions
        ok = (
            not rejected
            and self._rng.random() >= self.behaviour.failure_rate
            and command["action"] not in self.behaviour.failing_actions
        )
        if rejected:
            body = {"id": command["id"], "ok": False, "status": "rejected", "error": "simulated refusal"}
        elif ok:
            result = {"device": self.name, "action": command["action"], "echo": command["args"]}
            if command["action"] == "read_info":
                result["serial"] = f"SN-{self.name}"
            body = {"id": command["id"], "ok": True, "result": result}
        else:
            body = {"id": command["id"], "ok": False, "error": "simulated failure", "retryable": True}
        with self._lock:
            self._in_flight.pop(command["id"], None)
            if not self._book.finish(command["id"], body):
                return  # canceled or abandoned meanwhile
            command["done_at"] = time.monotonic()  # with received_at: when it was in hand
            if rejected:
                self.counts["rejected"] += 1
            elif not ok:
                self.counts["failures"] += 1
        self._reply("done", _json(body))

    def _cancel(self, command: dict[str, Any]) -> None:
        """Abort the in-flight command named in args.id: its done says ok=false "canceled"."""
        target = command["args"].get("id")
        canceled = {"id": target, "ok": False, "error": "canceled", "retryable": False}
        with self._lock:
            self._received.append({**command, "duplicate": False})
            self.counts["commands"] += 1
            running = isinstance(target, str) and self._book.abandon(target, canceled)
            for timer in self._in_flight.pop(target, []) if running else []:
                timer.cancel()
            if running:
                self.counts["canceled"] += 1
                for record in self._received:
                    if record.get("id") == target and "done_at" not in record:
                        record["done_at"] = time.monotonic()
            if self.behaviour.silent:
                return
            if running:
                self._reply("done", _json(canceled))
            result = {
                "device": self.name,
                "action": command["action"],
                "echo": command["args"],
                "canceled": running,
            }
            self._reply("done", _json({"id": command["id"], "ok": True, "result": result}))

    def _abandon(self) -> None:
        """The connection is gone (a power cut, a stop): the commands in hand are forgotten,
        not finished, so jobs/get can hand them back; fence and finished ids are kept."""
        with self._lock:
            for timers in self._in_flight.values():
                for timer in timers:
                    timer.cancel()
            self._in_flight.clear()
            self._book.forget_flights()

    def _reply(self, kind: str, payload: bytes) -> None:
        """Publish a reply (QoS 1); legacy devices send only done, on their one reply topic."""
        client = self._client
        if client is None or (self.behaviour.reply_topic and kind != "done"):
            return
        client.publish(self.behaviour.reply_topic or self._reply_topics[kind], payload, qos=1)


class Simulator:
    """Runs simulated devices in this process: their MQTT clients, one timer thread, the oracle."""

    def __init__(
        self,
        devices: dict[str, DeviceBehaviour],
        *,
        url: str | None = None,
        passwords: dict[str, str] | None = None,
        heartbeat_interval: float = 10.0,
        seed: int | None = None,
    ) -> None:
        """`passwords`: devices that log in as themselves (their broker identities); the
        others use the URL's credentials."""
        self._timers = _Timers()
        self._rng, self._url = random.Random(seed), url
        self._started = False
        # Replaced, never changed in place (device_add, device_remove): the timer thread and
        # stats() iterate it while the owner's thread adds and drops devices.
        self.devices: dict[str, SimulatedDevice] = {}
        # Devices dropped while running: their oracle records still count (overlaps, totals).
        self._retired: list[SimulatedDevice] = []
        for name, behaviour in devices.items():
            self._device_new(name, behaviour, (passwords or {}).get(name))
        self.heartbeat_interval = heartbeat_interval

    def _device_new(self, name: str, behaviour: DeviceBehaviour, password: str | None) -> SimulatedDevice:
        if not protocol.DEVICE_NAME_RE.match(name):
            raise ValueError(f"{name!r} is not a valid device name")
        if name in self.devices:
            raise ValueError(f"device {name!r} is already simulated")
        device = SimulatedDevice(
            name, behaviour, timers=self._timers, rng=self._rng, url=self._url, password=password
        )
        self.devices = {**self.devices, name: device}
        return device

    def device_add(self, name: str, behaviour: DeviceBehaviour, *, password: str | None = None) -> None:
        """Play one more device; once started, it connects at once (without waiting for SUBACK:
        `wait_subscribed` does). Raises ValueError for an invalid or already simulated name."""
        device = self._device_new(name, behaviour, password)
        if self._started:
            device.connect()

    def device_remove(self, name: str, *, timeout: float = 1.0) -> None:
        """Stop playing a device: a retained "offline" (confirmed within `timeout`), then gone.
        Its oracle records stay counted. Unknown names are ignored."""
        device = self.devices.get(name)
        if device is None:
            return
        self.devices = {key: value for key, value in self.devices.items() if key != name}
        device.disconnect(deadline=time.monotonic() + timeout)
        self._retired.append(device)

    def wait_subscribed(self, names: list[str], timeout: float) -> list[str]:
        """Wait until these devices are subscribed, at most `timeout` seconds in all; returns
        the names still not subscribed (an empty list when all are)."""
        deadline = time.monotonic() + timeout
        devices = [self.devices[name] for name in names if name in self.devices]
        for device in devices:
            device.subscribed.wait(max(0.0, deadline - time.monotonic()))
        return [device.name for device in devices if not device.subscribed.is_set()]

    def start(self, wait_connected: float = 10.0) -> None:
        """Connect every device and wait until all are subscribed (SUBACK).

        Raises TimeoutError naming the devices not subscribed in time, after stopping them all.
        """
        self._timers.start()
        self._started = True
        for device in self.devices.values():
            device.connect()
        missing = self.wait_subscribed(list(self.devices), wait_connected)
        if missing:
            self.stop(graceful=False)
            raise TimeoutError(
                f"{len(missing)} simulated devices not subscribed after {wait_connected}s: "
                f"{', '.join(missing[:10])}"
            )
        if self.heartbeat_interval > 0:
            self._timers.call_later(self.heartbeat_interval, self._heartbeat)

    def stop(self, graceful: bool = True) -> None:
        """Stop every device: graceful publishes a retained "offline" and disconnects; otherwise
        connections are dropped and the broker publishes each last will."""
        deadline = time.monotonic() + STOP_TIMEOUT_SECONDS
        for device in self.devices.values():
            if graceful:
                device.disconnect(deadline=deadline)
            else:
                device.kill()
        self._timers.stop()

    def kill(self, name: str) -> None:
        """Cut one device off abruptly so the broker publishes its retained "offline" last will."""
        self.devices[name].kill()

    def restart(self, name: str, wait_connected: float = 10.0) -> None:
        """Reconnect a killed device and wait for its subscription; raises TimeoutError."""
        device = self.devices[name]
        device.connect()
        if not device.subscribed.wait(wait_connected):
            raise TimeoutError(f"simulated device {name} not subscribed after {wait_connected}s")

    def received(self, name: str) -> list[dict[str, Any]]:
        """The commands a device received, in order, duplicates included (flagged)."""
        return self.devices[name].received()

    def _all_devices(self) -> list[SimulatedDevice]:
        """The devices played now and those dropped while running (the oracle forgets none)."""
        return [*self.devices.values(), *self._retired]

    @property
    def overlaps(self) -> list[Overlap]:
        return [overlap for device in self._all_devices() for overlap in list(device.overlaps)]

    @property
    def token_regressions(self) -> list[TokenRegression]:
        return [regression for device in self._all_devices() for regression in list(device.token_regressions)]

    def stats(self) -> dict[str, Any]:
        """Per-device and total counters, plus every overlap and token regression in detail.

        `devices` lists the devices played now; the totals also count those dropped meanwhile."""
        per_device = {name: device.stats() for name, device in self.devices.items()}
        everyone = [*per_device.values(), *(device.stats() for device in list(self._retired))]
        keys = (*COUNTERS, "overlaps", "token_regressions", "in_flight", "online")
        totals = {key: sum(int(stats[key]) for stats in everyone) for key in keys}
        return {
            "totals": {"devices": len(per_device), **totals},
            "devices": per_device,
            "overlaps": [overlap._asdict() for overlap in self.overlaps],
            "token_regressions": [regression._asdict() for regression in self.token_regressions],
        }

    def _heartbeat(self) -> None:
        for device in self.devices.values():
            device.heartbeat()
        self._timers.call_later(self.heartbeat_interval, self._heartbeat)
