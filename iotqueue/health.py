"""Health checks: the web's readiness (database, Redis, broker) and each process's liveness.

The web answers `/healthz` (alive, no dependency touched) and `/readyz` (each dependency
answers within CHECK_TIMEOUT_SECONDS) through iotqueue/probes.py. `manage.py healthcheck`
judges the worker (a Celery ping), beat (its last tick, iotqueue/beat_lease.py) and the
bridge (the heartbeat it writes to Redis, below). Every check returns a `Check`: a name,
ok or not, and a one-line reason; none raises.

The broker check is a TCP connect to MQTT_URL's host and port, not an MQTT CONNECT: a
CONNECT with the service user costs the broker an authentication (and, with dynamic
security, a client entry) every few seconds per web replica, and the processes that need
the broker (bridge, worker) have their own checks. A broker whose port accepts but whose
MQTT layer hangs is therefore seen by the bridge's check, not by /readyz.
"""

from __future__ import annotations

import functools
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from django.conf import settings
from django.db import connection

from .beat_lease import beat_tick_read
from .celery import app as celery_app
from .mqtt import broker_address
from .redis_conn import redis_connection, redis_key

# Each dependency must answer within this: a load balancer polls every few seconds and
# waits a few more; a check that hangs as long as the dependency would tell it nothing.
CHECK_TIMEOUT_SECONDS = 1.5
# How often the bridge writes its heartbeat; the health check calls it stale after
# BRIDGE_HEARTBEAT_STALE_SECONDS, so a frozen bridge is reported within about 6-8 s.
BRIDGE_HEARTBEAT_SECONDS = 2.0
# Three heartbeats missed: one slow Redis call is not a frozen bridge.
BRIDGE_HEARTBEAT_STALE_SECONDS = 3 * BRIDGE_HEARTBEAT_SECONDS
# The heartbeat key outlives a few beats, then goes: a bridge gone for good leaves no record.
BRIDGE_HEARTBEAT_TTL_SECONDS = 5 * BRIDGE_HEARTBEAT_SECONDS
# The bridge's stats counters that one received message increments (one of them).
MESSAGE_STATS = ("handled", "handler_errors", "unrouted", "over_budget", "callback_error:message")


@dataclass(frozen=True)
class Check:
    """One check's outcome: `reason` says why in one line (an error's text, or what was seen)."""

    name: str
    ok: bool
    reason: str


def check_run(name: str, probe: Callable[[], str]) -> Check:
    """Run `probe` (returns what it saw, raises on failure) as a Check that never raises."""
    try:
        return Check(name, True, probe())
    except Exception as exc:  # any failure is the check's answer, not the caller's problem
        return Check(name, False, f"{type(exc).__name__}: {exc}".strip()[:200])


# --- the web's readiness ------------------------------------------------------------------------


def _database_probe() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        cursor.fetchone()
    return connection.vendor


@functools.cache
def _redis_probe_client(url: str) -> redis.Redis:
    # Its own client: the shared one waits 5 s (iotqueue/redis_conn.py), too long for a probe.
    return redis.Redis.from_url(
        url, socket_timeout=CHECK_TIMEOUT_SECONDS, socket_connect_timeout=CHECK_TIMEOUT_SECONDS
    )


def _redis_probe() -> str:
    _redis_probe_client(settings.REDIS_URL).ping()
    return "PONG"


def _broker_probe() -> str:
    address = broker_address()
    with socket.create_connection((address.host, address.port), timeout=CHECK_TIMEOUT_SECONDS):
        return f"{address.host}:{address.port} accepts connections"


READINESS_PROBES: dict[str, Callable[[], str]] = {
    "database": _database_probe,
    "redis": _redis_probe,
    "mqtt_broker": _broker_probe,
}


def readiness_checks() -> list[Check]:
    """Database, Redis and the MQTT broker, each within CHECK_TIMEOUT_SECONDS (the database
    within its own connect timeout)."""
    return [check_run(name, probe) for name, probe in READINESS_PROBES.items()]


def readiness_report(checks: list[Check]) -> tuple[int, dict[str, Any]]:
    """The HTTP status (200 when every check passed, else 503) and the JSON body naming each."""
    ready = all(check.ok for check in checks)
    body = {
        "status": "ok" if ready else "error",
        "checks": {
            check.name: {"status": "ok" if check.ok else "error", "reason": check.reason} for check in checks
        },
    }
    return (200 if ready else 503), body


# --- the bridge's heartbeat ---------------------------------------------------------------------


def bridge_heartbeat_key(client_id: str) -> str:
    """One key per bridge replica, by its stable MQTT client id."""
    return redis_key("health", "bridge", client_id)


def bridge_heartbeat_write(
    client_id: str, *, connected: bool, network_thread_alive: bool, last_message: float
) -> None:
    """Record that the bridge is running now (wall clock), with its state. Raises RedisError."""
    fields = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "connected": int(connected),
        "network_thread_alive": int(network_thread_alive),
        "last_message": last_message,
        "at": time.time(),
    }
    key = bridge_heartbeat_key(client_id)
    pipe = redis_connection().pipeline()
    pipe.hset(key, mapping=fields)
    pipe.expire(key, round(BRIDGE_HEARTBEAT_TTL_SECONDS))
    pipe.execute()


def bridge_heartbeat_read(client_id: str) -> dict[str, str]:
    """The bridge's last heartbeat ({} when none). Raises RedisError."""
    return redis_connection().hgetall(bridge_heartbeat_key(client_id))


def bridge_verdict(heartbeat: dict[str, str], *, now: float) -> Check:
    """Whether the bridge that wrote `heartbeat` is healthy at `now` (wall clock)."""
    if not heartbeat:
        return Check("bridge", False, "no heartbeat: the bridge is not running (or not on this Redis)")
    age = now - float(heartbeat["at"])
    who = f"pid {heartbeat.get('pid')} on {heartbeat.get('host')}"
    if age > BRIDGE_HEARTBEAT_STALE_SECONDS:
        return Check("bridge", False, f"{who}: last heartbeat {age:.1f}s ago: frozen or stuck")
    if heartbeat.get("network_thread_alive") != "1":
        return Check("bridge", False, f"{who}: the MQTT network thread is dead")
    if heartbeat.get("connected") != "1":
        return Check("bridge", False, f"{who}: not connected to the broker")
    last = float(heartbeat.get("last_message") or 0)
    heard = f"last message {now - last:.0f}s ago" if last else "no message yet"
    return Check("bridge", True, f"{who}: connected, heartbeat {age:.1f}s ago, {heard}")


class BridgeHeartbeat:
    """A daemon thread that writes the bridge's heartbeat every BRIDGE_HEARTBEAT_SECONDS.

    It reads the bridge's state (`state()`: connected, network thread alive, messages seen
    so far) and notes when the message count last moved, so the per-message path stays as
    it was. How it fails: a Redis error is logged once per outage and the beat goes on; a
    frozen process writes nothing, which is what the health check looks for.
    """

    def __init__(self, client_id: str, state: Callable[[], tuple[bool, bool, int]], log: Any) -> None:
        self.client_id = client_id
        self.state = state
        self.log = log
        self._stop = threading.Event()
        self._messages = 0
        self._last_message = 0.0
        self._failing = False
        self.thread = threading.Thread(target=self._run, name="bridge-heartbeat", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()

    def beat(self) -> None:
        connected, alive, messages = self.state()
        if messages != self._messages:
            self._messages, self._last_message = messages, time.time()
        try:
            bridge_heartbeat_write(
                self.client_id,
                connected=connected,
                network_thread_alive=alive,
                last_message=self._last_message,
            )
        except redis.RedisError as exc:
            if not self._failing:
                self.log.warning("bridge: cannot write the health heartbeat: %s", exc)
            self._failing = True
        else:
            self._failing = False

    def _run(self) -> None:
        while True:
            self.beat()
            if self._stop.wait(BRIDGE_HEARTBEAT_SECONDS):
                return


def bridge_check(client_id: str) -> Check:
    """The bridge replica `client_id`, judged by its heartbeat in Redis."""
    try:
        heartbeat = bridge_heartbeat_read(client_id)
    except redis.RedisError as exc:
        return Check("bridge", False, f"cannot read the heartbeat from Redis: {exc}")
    return bridge_verdict(heartbeat, now=time.time())


# --- the worker ---------------------------------------------------------------------------------


def worker_verdict(replies: list[dict[str, Any]], *, host: str, any_host: bool) -> Check:
    """Judge a Celery ping's replies ([{node name: {"ok": "pong"}}]): this host's worker (a node
    named <name>@host) answered, or with `any_host` any worker did."""
    nodes = sorted(name for reply in replies for name in reply)
    mine = [name for name in nodes if name.endswith(f"@{host}")]
    if mine:
        return Check("worker", True, f"{', '.join(mine)} answered the ping")
    if any_host and nodes:
        return Check("worker", True, f"{', '.join(nodes)} answered the ping")
    others = f" (only {', '.join(nodes)})" if nodes else ""
    where = "any host" if any_host else host
    return Check("worker", False, f"no worker on {where} answered the ping{others}")


# --- beat ---------------------------------------------------------------------------------------


def beat_verdict(record: dict[str, str], *, holder: str | None, now: float, stale_seconds: float) -> Check:
    """Judge the beat that recorded `record` (iotqueue/beat_lease.py) at `now` (wall clock):
    it ticked within `stale_seconds`, and is the leader (holds the lease) or stands by."""
    if not record:
        return Check(
            "beat", False, "no tick recorded: beat is not running on this host (or not on this Redis)"
        )
    age = now - float(record["at"])
    owner = record.get("owner", "?")
    if age > stale_seconds:
        return Check("beat", False, f"{owner}: last tick {age:.1f}s ago: frozen or stuck")
    if holder == owner:
        return Check("beat", True, f"leader: {owner} holds the lease, ticked {age:.1f}s ago")
    held_by = f"lease held by {holder}" if holder else "lease free, taking it at the next poll"
    return Check("beat", True, f"standby: {owner} ({held_by}), ticked {age:.1f}s ago")


def beat_check() -> Check:
    """The beat on this host, judged by its last tick and the lease's holder. A tick may be a
    lease length apart (the holder sleeps until its next renewal), so stale is two lengths."""
    lease_seconds = float(settings.IOTQUEUE_BEAT_LEASE_SECONDS)
    try:
        record = beat_tick_read(socket.gethostname())
        holder = redis_connection().get(redis_key("beat", "lease"))
    except redis.RedisError as exc:
        return Check("beat", False, f"cannot read the beat's tick from Redis: {exc}")
    return beat_verdict(record, holder=holder, now=time.time(), stale_seconds=2 * lease_seconds)


def worker_check(*, any_host: bool, timeout: float = CHECK_TIMEOUT_SECONDS) -> Check:
    """Ping the Celery workers (app.control.ping) and judge the replies (worker_verdict)."""
    try:
        replies = celery_app.control.ping(timeout=timeout)
    except Exception as exc:  # the broker (Redis) unreachable, or an error of its transport
        return Check("worker", False, f"cannot ping: {type(exc).__name__}: {exc}")
    return worker_verdict(replies, host=socket.gethostname(), any_host=any_host)
