"""Per-device lock: lease + fencing token + FIFO hand-off, atomic in Redis (Lua in lua/).

A device executes one command at a time. `device_lock_acquire` grants the lock with a new
fencing token, or puts the caller in the device's wait queue (priority, then arrival).
`device_lock_release` by the current holder hands the lock straight to the head of the
queue and returns that grant, so the caller can dispatch the next holder at once: nobody
polls and no worker waits.

How it fails: Redis being unreachable raises redis.RedisError to the caller (the task is
retried or the monitor rescues the step). A holder that dies keeps the lock until its
lease expires; the monitor then reclaims it. A release by a stale holder (wrong fence) is
refused and changes nothing. The database stays the authority on which attempt is
current: the fence is stored on the step row and replies are checked against it.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.conf import settings

from iotqueue.redis_conn import redis_connection, redis_key

log = logging.getLogger(__name__)

LUA_DIR = Path(__file__).with_name("lua")


@dataclass(frozen=True)
class Grant:
    """The lock is held by `holder` under fencing token `fence`."""

    holder: str
    fence: int


@dataclass(frozen=True)
class Queued:
    """The caller waits in the device's queue at `position` (1 = next)."""

    position: int


@dataclass(frozen=True)
class NotReady:
    """Redis lost the lock state (restart); nothing is granted until it is rebuilt."""


@dataclass(frozen=True)
class LockState:
    device: str
    holder: str | None
    fence: int | None
    since_ms: int | None
    lease_until_ms: int | None
    queue: list[str]


@functools.cache
def _script(name: str):
    return redis_connection().register_script((LUA_DIR / f"{name}.lua").read_text())


def _keys(device: str) -> dict[str, str]:
    # The {device} hash tag keeps one device's keys in one Redis Cluster slot.
    tag = "{" + device + "}"
    return {
        "lock": redis_key("lock", tag),
        "fence": redis_key("fence", tag),
        "queue": redis_key("queue", tag),
        "leases": redis_key("leases"),
        "seq": redis_key("queue-seq"),
        "epoch": redis_key("lock-epoch"),
    }


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def device_lock_acquire(
    device: str, *, holder: str, priority: int, lease_seconds: float
) -> Grant | Queued | NotReady:
    """Take the device's lock, or join its wait queue (idempotent for the same holder).

    NotReady means Redis restarted and lost every lock: the caller must leave its holder
    waiting until `lock_epoch_start` has run after the locks were rebuilt.
    """
    k = _keys(device)
    granted, value = _script("acquire")(
        keys=[k["lock"], k["fence"], k["queue"], k["leases"], k["seq"], k["epoch"]],
        args=[holder, priority, _ms(lease_seconds), device],
    )
    if granted == -1:
        return NotReady()
    return Grant(holder, int(value)) if granted else Queued(int(value))


def device_lock_release(
    device: str, *, holder: str, fence: int, lease_seconds: float | None = None, force: bool = False
) -> Grant | None:
    """Release the lock and hand it to the next waiter; return that waiter's grant.

    Returns None when the lock is now free or when the caller no longer held it (a stale
    release changes nothing). `force` releases whoever holds it (operator, monitor).
    The next holder's lease is IOTQUEUE_HANDOFF_LEASE_SECONDS unless `lease_seconds` says.
    """
    if lease_seconds is None:
        lease_seconds = settings.IOTQUEUE_HANDOFF_LEASE_SECONDS
    k = _keys(device)
    reply = _script("release")(
        keys=[k["lock"], k["fence"], k["queue"], k["leases"]],
        args=[holder, fence, _ms(lease_seconds), device, "force" if force else ""],
    )
    if reply[0] == 1:
        return Grant(reply[1], int(reply[2]))
    return None


@dataclass
class LockBatch:
    """Lock operations on many devices, applied in one atomic Redis call, in order.

    A batch of step transitions releases the locks of the attempts that ended (each
    handing its device to the head of the queue) and acquires for the steps that start,
    with writes to a sorted set (the jobs app's deadlines) that depend on whether each
    acquire was granted: one round trip instead of two per step. Add the releases before
    the acquires, so a device released and acquired in one batch serves its queue first.
    """

    ops: list[dict] = field(default_factory=list)
    zadd: dict[str, float] = field(default_factory=dict)
    zrem: list[str] = field(default_factory=list)

    def release(self, device: str, *, holder: str, fence: int) -> int:
        """Release (and hand on, lease IOTQUEUE_HANDOFF_LEASE_SECONDS); returns the op's index."""
        lease = _ms(settings.IOTQUEUE_HANDOFF_LEASE_SECONDS)
        self.ops.append({"o": "r", "d": device, "h": holder, "f": fence, "l": lease})
        return len(self.ops) - 1

    def acquire(
        self,
        device: str,
        *,
        holder: str,
        priority: int,
        lease_seconds: float,
        on_grant: dict[str, float] | None = None,
        on_queue: dict[str, float] | None = None,
    ) -> int:
        """Acquire; `on_grant` / `on_queue` are {member: score} written per the outcome."""
        self.ops.append(
            {
                "o": "a",
                "d": device,
                "h": holder,
                "p": priority,
                "l": _ms(lease_seconds),
                "g": [[score, member] for member, score in (on_grant or {}).items()],
                "q": [[score, member] for member, score in (on_queue or {}).items()],
            }
        )
        return len(self.ops) - 1


def device_locks_apply(batch: LockBatch, *, zset: str) -> list[Grant | Queued | NotReady | None]:
    """Apply a LockBatch atomically; one outcome per op, in order.

    A release gives the Grant it handed the lock on with, or None (free now, or the caller
    no longer held it: stale, nothing changed). An acquire gives Grant, Queued or NotReady,
    as `device_lock_acquire`. Fails as the single calls do: RedisError to the caller, and
    nothing applied (the script runs whole or not at all).
    """
    if not batch.ops and not batch.zadd and not batch.zrem:
        return []
    request = {
        "ops": batch.ops,
        "zadd": [[score, member] for member, score in batch.zadd.items()],
        "zrem": batch.zrem,
    }
    reply = _script("transition")(
        keys=[redis_key("leases"), redis_key("queue-seq"), redis_key("lock-epoch"), zset],
        args=[redis_key("lock", ""), redis_key("fence", ""), redis_key("queue", ""), json.dumps(request)],
    )
    outcomes: list[Grant | Queued | NotReady | None] = []
    for op, result in zip(batch.ops, json.loads(reply) or [], strict=True):
        if op["o"] == "r":
            outcomes.append(Grant(result[1], int(result[2])) if result[0] == 1 else None)
        elif result[0] == 1:
            outcomes.append(Grant(op["h"], int(result[1])))
        elif result[0] == 0:
            outcomes.append(Queued(int(result[1])))
        else:
            outcomes.append(NotReady())
    return outcomes


def device_lock_extend(
    device: str, *, holder: str, fence: int, lease_seconds: float, pipe: Any = None
) -> bool:
    """Push the lease out to now + lease_seconds; False when the caller lost the lock.

    With `pipe` the call joins that pipeline (and its answer comes with the pipeline's).
    """
    k = _keys(device)
    answer = _script("extend")(
        keys=[k["lock"], k["leases"]], args=[holder, fence, _ms(lease_seconds), device], client=pipe
    )
    return bool(answer)


def device_lock_dequeue(device: str, *, holder: str) -> bool:
    """Leave the device's wait queue (e.g. the run was canceled); False if not queued."""
    return bool(redis_connection().zrem(_keys(device)["queue"], holder))


def device_lock_state(device: str) -> LockState:
    """Who holds the device's lock, since when, until when, and who waits (in order)."""
    return device_lock_states([device])[device]


def device_lock_states(devices: list[str]) -> dict[str, LockState]:
    """`device_lock_state` for many devices in one Redis round trip (a page of a device list).

    Not atomic across devices: each device's state is read as it is at that moment.
    """
    with redis_connection().pipeline(transaction=False) as pipe:
        for device in devices:
            k = _keys(device)
            pipe.hgetall(k["lock"])
            pipe.zscore(k["leases"], device)
            pipe.zrange(k["queue"], 0, -1)
        replies = pipe.execute()
    states = {}
    for i, device in enumerate(devices):
        lock, lease, queue = replies[3 * i : 3 * i + 3]
        states[device] = LockState(
            device=device,
            holder=lock.get("holder"),
            fence=int(lock["fence"]) if "fence" in lock else None,
            since_ms=int(lock["since"]) if "since" in lock else None,
            lease_until_ms=int(lease) if lease is not None else None,
            queue=list(queue),
        )
    return states


# Keys SCAN returns per round trip: large enough that 10,000 devices take a few dozen trips.
QUEUE_SCAN_BATCH = 1000


def device_queue_depths() -> dict[str, int]:
    """How many holders wait for each device that has any waiting (for /metrics).

    Redis deletes an empty sorted set, so only devices with waiters have a queue key: the
    keys are found with SCAN (Redis stays responsive, unlike KEYS) and counted in one
    pipeline. Costs O(keys in the database) per call: for a scrape every few seconds,
    never for the engine's hot path.
    """
    conn = redis_connection()
    head = redis_key("queue", "{")
    # The key prefix is configuration: escape glob characters so it matches only itself.
    pattern = "".join("\\" + c if c in "*?[]\\" else c for c in head) + "*}"
    keys = sorted(set(conn.scan_iter(match=pattern, count=QUEUE_SCAN_BATCH)))
    with conn.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.zcard(key)
        depths = pipe.execute()
    return {key[len(head) : -1]: depth for key, depth in zip(keys, depths, strict=True) if depth}


def device_lock_expired(*, limit: int, claim_seconds: float) -> list[tuple[str, Grant]]:
    """Devices whose holder's lease ran out, with that holder's grant, for reclaiming.

    Each returned lease is pushed out by `claim_seconds` so a concurrent or next monitor
    tick does not reclaim it twice.
    """
    flat = _script("expired")(
        keys=[redis_key("leases"), redis_key("lock", "")],
        args=[int(time.time() * 1000), limit, _ms(claim_seconds)],
    )
    return [(flat[i], Grant(flat[i + 1], int(flat[i + 2]))) for i in range(0, len(flat), 3)]


def lock_epoch_exists() -> bool:
    """False after Redis lost its data: locks must be rebuilt before any grant."""
    return bool(redis_connection().exists(redis_key("lock-epoch")))


def lock_epoch_start() -> None:
    """Declare the lock state complete; grants resume."""
    redis_connection().set(redis_key("lock-epoch"), str(time.time()))


def device_lock_restore(
    device: str, *, holder: str | None, fence: int, floor: int, lease_seconds: float
) -> None:
    """Rebuild a device's lock from the database: its executing holder and fence floor."""
    k = _keys(device)
    _script("restore")(
        keys=[k["lock"], k["fence"], k["leases"]],
        args=[holder or "", floor, _ms(lease_seconds), device, fence],
    )


# --- hand-off ---------------------------------------------------------------------------
# A holder is "<kind>:<id>" (e.g. "step:42"). Whoever releases a lock does not know what
# the next holder is; the app that owns that kind of holder registers how to start it.

GrantHandler = Callable[[str, Grant], None]
_grant_handlers: dict[str, GrantHandler] = {}


def holder_name(kind: str, ident: object) -> str:
    return f"{kind}:{ident}"


def holder_parse(holder: str) -> tuple[str, str]:
    kind, _, ident = holder.partition(":")
    return kind, ident


def grant_handler_register(kind: str, handler: GrantHandler) -> None:
    """`handler(device, grant)` starts a holder of `kind` that was handed the lock."""
    _grant_handlers[kind] = handler


def device_lock_handoff(device: str, grant: Grant) -> None:
    """Start the holder that a release handed the lock to.

    An unknown kind cannot be started: its lock is passed on so the queue moves on.
    """
    kind, _ = holder_parse(grant.holder)
    handler = _grant_handlers.get(kind)
    if handler is None:
        log.error("lock %s handed to %s of unknown kind; releasing", device, grant.holder)
        device_lock_pass_on(device, holder=grant.holder, fence=grant.fence)
        return
    handler(device, grant)


def device_lock_pass_on(device: str, *, holder: str, fence: int, force: bool = False) -> Grant | None:
    """Release a lock its holder no longer needs and start whoever gets it next.

    The one way a holder lets go (a step that ended, a locked task whose body returned, an
    operator's force-release). Returns the grant it handed on, if any. A stale holder
    (wrong fence) changes nothing, unless `force`.
    """
    grant = device_lock_release(device, holder=holder, fence=fence, force=force)
    if grant is not None:
        device_lock_handoff(device, grant)
    return grant
