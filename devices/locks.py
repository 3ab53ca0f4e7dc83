"""Per-device lock: lease + fencing token + FIFO hand-off, atomic in Redis (lua/transition.lua).

A device executes one command at a time. `device_lock_acquire` grants the lock with a new
fencing token, or puts the caller in the device's wait queue (priority, then arrival).
`device_lock_release` by the current holder hands the lock straight to the head of the
queue and returns that grant, so the caller can dispatch the next holder at once: nobody
polls and no worker waits. `device_lock_preempt` lets an urgent holder take the lock from
the one holding it, which waits again (docs/orchestration.md#urgent-preemption).

One script makes every change: `lua/transition.lua` applies a LockBatch (acquires,
releases, extends, the reclaim of expired leases, the restore after a Redis loss) in one
atomic call per shard. The single operations here (`device_lock_acquire`, `_release`,
`_extend`, `_expired`, `_restore`) are batches of one, so the batched path and the
one-at-a-time path follow the same rules; each is one round trip. Only reads and
`device_lock_dequeue` (one ZREM, atomic on its own) use plain commands.

How it fails: Redis being unreachable raises redis.RedisError to the caller (the task is
retried or the monitor rescues the step). A holder that dies keeps the lock until its
lease expires; the monitor then reclaims it. A release by a stale holder (wrong fence) is
refused and changes nothing. The database stays the authority on which attempt is
current: the fence is stored on the step row and replies are checked against it.

Where the keys live: on `lock_redis_connection()` (LOCK_REDIS_URL, by default REDIS_URL's
server; it may be a Redis Cluster). The lock space is cut into IOTQUEUE_LOCK_SHARDS shards
(`lock_shard(device)`: crc32 of the name); a device's keys and its shard's lease index,
queue arrival counter and epoch (and the jobs app's deadline set of that shard) carry the
shard's hash tag `{<prefix>:<shard>/<shards>}`, so each script call touches one hash slot.
A LockBatch makes one script call per shard on a cluster (sent together in one pipeline),
and one call for all its shards on a single Redis: one round trip either way.

An acquire may take slots of shared concurrency limits with the lock (`LockBatch.acquire`
`slots`); what a slot is, where its keys live and the reads of who holds them are
devices/lock_slots.py, which this module imports and which never imports it.
"""

from __future__ import annotations

import functools
import json
import logging
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.conf import settings
from redis.cluster import RedisCluster
from redis.commands.core import Script
from redis.exceptions import AskError, ClusterDownError, MovedError, NoScriptError, TryAgainError

from iotqueue.redis_conn import lock_redis_connection, redis_key

from .lock_slots import Slot, slots_args

log = logging.getLogger(__name__)

LUA_DIR = Path(__file__).with_name("lua")


@dataclass(frozen=True)
class Grant:
    """The lock is held by `holder` under fencing token `fence`."""

    holder: str
    fence: int
    # An acquire by the holder it was already granted to (a re-acquire): nothing new was
    # taken, so there is nothing to give back when the acquiring transition is undone.
    held: bool = field(default=False, compare=False)


@dataclass(frozen=True)
class Preempted(Grant):
    """An urgent acquire took the lock from `displaced` (now back in the queue, its fence
    stale) and holds it under `fence` (`LockBatch.preempt`)."""

    displaced: str = field(default="", compare=False)


@dataclass(frozen=True)
class Queued:
    """The caller waits in the device's queue at `position` (1 = next)."""

    position: int
    # An acquire by a holder already in the queue (asking again): it kept its place, which
    # is not this acquire's to give back when the acquiring transition is undone.
    waiting: bool = field(default=False, compare=False)
    # "<limit>=<label value>" when the caller waits for a slot of that shared concurrency
    # limit (its device left free) instead of in the device's queue.
    slot: str = field(default="", compare=False)


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


# --- shards and keys ----------------------------------------------------------------------


def lock_shards() -> int:
    return settings.IOTQUEUE_LOCK_SHARDS


def lock_shard(name: str) -> int:
    """The shard of a device (or of any name routed like one): stable across processes."""
    return _shard_of(name, lock_shards())


def _shard_of(name: str, shards: int) -> int:
    return zlib.crc32(name.encode()) % shards


def shard_tag(shard: int) -> str:
    """The hash tag of a shard's keys. The shard count is part of it, so a new count gives
    new keys without an epoch: the locks are rebuilt instead of read under the wrong shard."""
    return _tag(settings.IOTQUEUE_REDIS_KEY_PREFIX, shard, lock_shards())


def _tag(prefix: str, shard: int, shards: int) -> str:
    return "{" + f"{prefix}:{shard}/{shards}" + "}"


def shard_key(name: str, shard: int) -> str:
    """A per-shard key, e.g. iq:leases:{iq:3/16}."""
    return redis_key(name, shard_tag(shard))


def _keys(device: str) -> dict[str, str]:
    # One tag per key, the shard's: a device's keys and its shard's globals share a slot.
    shard = lock_shard(device)
    lock, fence, queue = _device_keys(settings.IOTQUEUE_REDIS_KEY_PREFIX, shard_tag(shard), device)
    return {
        "lock": lock,
        "fence": fence,
        "queue": queue,
        "leases": shard_key("leases", shard),
        "seq": shard_key("queue-seq", shard),
        "epoch": shard_key("lock-epoch", shard),
    }


def _device_keys(prefix: str, tag: str, device: str) -> tuple[str, str, str]:
    """A device's lock hash, fence counter and wait queue (as redis_key names them)."""
    return f"{prefix}:lock:{tag}:{device}", f"{prefix}:fence:{tag}:{device}", f"{prefix}:queue:{tag}:{device}"


# --- scripts ------------------------------------------------------------------------------


@functools.cache
def _transition() -> Script:
    # Not bound to a client: each call names the lock Redis of the moment.
    return Script(None, (LUA_DIR / "transition.lua").read_bytes())


def scripts_call(calls: Sequence[tuple[Script, Sequence, Sequence]]) -> list:
    """Script calls (script, keys, args) sent together; their replies, in order.

    On a single Redis: one pipeline, one round trip. On a cluster (whose pipelines refuse
    scripts): one pipeline per node that owns the calls' slots (a call's keys are in one
    slot), sent to the nodes one after the other; a call refused because its slot moved is
    sent again through the cluster client, which follows the redirection. A call refused
    with NOSCRIPT ran nothing: the script is loaded and those calls are sent again. Any other
    error is raised; on a cluster, the calls that went to other nodes may have run.
    """
    conn = lock_redis_connection()
    if not isinstance(conn, RedisCluster):
        return _pipelined(conn, calls)
    by_node: dict[str, list[int]] = {}
    nodes = {}
    for i, (_, keys, _) in enumerate(calls):
        node = conn.get_node_from_key(keys[0])
        nodes[node.name] = node
        by_node.setdefault(node.name, []).append(i)
    results: list = [None] * len(calls)
    for name, indices in by_node.items():
        replies = _pipelined(nodes[name].redis_connection, [calls[i] for i in indices], raise_on_error=False)
        for i, reply in zip(indices, replies, strict=True):
            if isinstance(reply, MovedError | AskError | TryAgainError | ClusterDownError):
                script, keys, args = calls[i]
                reply = script(keys=keys, args=args, client=conn)
            elif isinstance(reply, Exception):
                raise reply
            results[i] = reply
    return results


def _pipelined(
    conn: Any, calls: Sequence[tuple[Script, Sequence, Sequence]], *, raise_on_error: bool = True
) -> list:
    """The calls in one pipeline of one server; NOSCRIPT loads the script and sends again."""
    results: list = [None] * len(calls)
    pending = list(range(len(calls)))
    for attempt in range(2):
        with conn.pipeline(transaction=False) as pipe:
            for i in pending:
                script, keys, args = calls[i]
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            replies = pipe.execute(raise_on_error=False)
        missing = []
        for i, reply in zip(pending, replies, strict=True):
            if isinstance(reply, NoScriptError) and attempt == 0:
                missing.append(i)
            elif isinstance(reply, Exception) and raise_on_error:
                raise reply
            else:
                results[i] = reply
        if not missing:
            break
        for script in {calls[i][0].sha: calls[i][0] for i in missing}.values():
            conn.script_load(script.script)
        pending = missing
    return results


def fair_shares(counts: Sequence[int], limit: int) -> list[int]:
    """Split `limit` among shards that have counts[i] items each, max-min fair: all of a
    shard's items if they fit, the rest shared evenly (claims across shards stay bounded)."""
    shares = [0] * len(counts)
    left = limit
    order = sorted(range(len(counts)), key=counts.__getitem__)
    for n, i in enumerate(order):
        shares[i] = min(counts[i], left // (len(order) - n))
        left -= shares[i]
    return shares


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


# --- the single operations: batches of one ------------------------------------------------


def device_lock_acquire(
    device: str, *, holder: str, priority: int, lease_seconds: float
) -> Grant | Queued | NotReady:
    """Take the device's lock, or join its wait queue (idempotent for the same holder).

    NotReady means Redis restarted and lost every lock: the caller must leave its holder
    waiting until `lock_epoch_start` has run after the locks were rebuilt.
    """
    batch = LockBatch()
    batch.acquire(device, holder=holder, priority=priority, lease_seconds=lease_seconds)
    return device_locks_apply(batch)[0]


def device_lock_preempt(
    device: str,
    *,
    holder: str,
    priority: int,
    lease_seconds: float,
    displace: str,
    displace_fence: int,
    displace_priority: int,
) -> Grant | Queued | NotReady:
    """Take the device's lock from `displace` (still holding it under `displace_fence`),
    which waits again at the head of its priority band; Preempted, or what
    `device_lock_acquire` gives when it no longer holds it (`LockBatch.preempt`)."""
    batch = LockBatch()
    batch.preempt(
        device,
        holder=holder,
        priority=priority,
        lease_seconds=lease_seconds,
        displace=displace,
        displace_fence=displace_fence,
        displace_priority=displace_priority,
    )
    return device_locks_apply(batch)[0]


def device_lock_release(
    device: str, *, holder: str, fence: int, lease_seconds: float | None = None, force: bool = False
) -> Grant | None:
    """Release the lock and hand it to the next waiter; return that waiter's grant.

    Returns None when the lock is now free or when the caller no longer held it (a stale
    release changes nothing). `force` releases whoever holds it (operator, monitor).
    The next holder's lease is IOTQUEUE_HANDOFF_LEASE_SECONDS unless `lease_seconds` says.
    """
    batch = LockBatch()
    batch.release(device, holder=holder, fence=fence, lease_seconds=lease_seconds, force=force)
    return device_locks_apply(batch)[0]


def device_lock_extend(device: str, *, holder: str, fence: int, lease_seconds: float) -> bool:
    """Push the lease out to now + lease_seconds; False when the caller lost the lock."""
    batch = LockBatch()
    batch.extend(device, holder=holder, fence=fence, lease_seconds=lease_seconds)
    return device_locks_apply(batch)[0]


def device_lock_expired(*, limit: int, claim_seconds: float) -> list[tuple[str, Grant]]:
    """Devices whose holder's lease ran out, with that holder's grant, for reclaiming.

    Each returned lease is pushed out by `claim_seconds` so a concurrent or next monitor
    tick does not reclaim it twice. Every shard's lease index is read: one round trip
    counts what expired per shard (the only one when nothing did), one more claims up to
    `limit` of them in all, shared fairly among the shards (`fair_shares`).
    """
    now = int(time.time() * 1000)
    shards = range(lock_shards())
    with lock_redis_connection().pipeline(transaction=False) as pipe:
        for shard in shards:
            pipe.zcount(shard_key("leases", shard), "-inf", now)
        counts = pipe.execute()
    batch = LockBatch()
    for shard, share in zip(shards, fair_shares(counts, limit), strict=True):
        if share:
            batch.reclaim(shard, limit=share, claim_seconds=claim_seconds, now_ms=now)
    return [claim for claims in device_locks_apply(batch) for claim in claims]


def device_lock_restore(
    device: str, *, holder: str | None, fence: int, floor: int, lease_seconds: float
) -> None:
    """Rebuild a device's lock from the database: its executing holder and fence floor."""
    batch = LockBatch()
    batch.restore(device, holder=holder, fence=fence, floor=floor, lease_seconds=lease_seconds)
    device_locks_apply(batch)


# --- batches ------------------------------------------------------------------------------


@dataclass
class LockBatch:
    """Lock operations on many devices, applied in one Redis round trip, in order per shard.

    A batch of step transitions releases the locks of the attempts that ended (each
    handing its device to the head of the queue) and acquires for the steps that start,
    with writes to a sorted set (the jobs app's deadlines) that depend on whether each
    acquire was granted: one round trip instead of two per step. Add the releases before
    the acquires they make way for, so a device released and acquired in one batch serves its
    queue first (the jobs app orders them as its inputs would come one at a time).
    The single operations (`device_lock_acquire` ...) are batches of one.

    The sorted set is sharded like the locks: an acquire's conditional writes go to its
    device's shard; unconditional writes name their shard (`zset_add`, `zset_remove`).
    """

    ops: list[dict] = field(default_factory=list)
    # shard -> {"zadd": {member: score}, "zrem": [member]}: written whatever the outcomes
    writes: dict[int, dict[str, Any]] = field(default_factory=dict)
    # Set by `device_locks_apply`: the other devices' locks the releases' freed slots
    # (shared concurrency limits) handed to their waiters, to be started as hand-offs.
    handed: list[tuple[str, Grant]] = field(default_factory=list)

    def release(
        self,
        device: str,
        *,
        holder: str,
        fence: int,
        lease_seconds: float | None = None,
        force: bool = False,
    ) -> int:
        """Release (and hand on; the next holder's lease is IOTQUEUE_HANDOFF_LEASE_SECONDS
        unless `lease_seconds` says); `force` releases whoever holds it. Returns the op's index."""
        if lease_seconds is None:
            lease_seconds = settings.IOTQUEUE_HANDOFF_LEASE_SECONDS
        op = {"o": "r", "d": device, "h": holder, "f": fence, "l": _ms(lease_seconds)}
        if force:
            op["x"] = True
        self.ops.append(op)
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
        slots: Sequence[Slot] = (),
        on_grant_clear: Sequence[str] = (),
    ) -> int:
        """Acquire; `on_grant` / `on_queue` are {member: score} written, per the outcome, to
        the device's shard of the sorted set, and `on_grant_clear` members removed from it
        when granted. `slots` (shared concurrency limits) are taken with the lock or not at
        all: while one is full the holder waits for it (Queued)."""
        op: dict[str, Any] = {"o": "a", "d": device, "h": holder, "p": priority, "l": _ms(lease_seconds)}
        if slots:
            op["sl"] = [[slot.limit, slot.value, slot.most] for slot in slots]
        if on_grant:
            op["g"] = [[score, member] for member, score in on_grant.items()]
        if on_grant_clear:
            op["gc"] = list(on_grant_clear)
        if on_queue:
            op["q"] = [[score, member] for member, score in on_queue.items()]
        self.ops.append(op)
        return len(self.ops) - 1

    def extend(self, device: str, *, holder: str, fence: int, lease_seconds: float) -> int:
        """Push the lease out to now + lease_seconds if holder and fence still hold it
        (`device_lock_extend`); its outcome is True, or False when the caller lost the lock."""
        self.ops.append({"o": "e", "d": device, "h": holder, "f": fence, "l": _ms(lease_seconds)})
        return len(self.ops) - 1

    def dequeue(self, device: str, *, holder: str) -> int:
        """Leave the device's wait queue (`device_lock_dequeue`); its outcome is True, or
        False when the holder was not waiting."""
        self.ops.append({"o": "q", "d": device, "h": holder})
        return len(self.ops) - 1

    def reclaim(self, shard: int, *, limit: int, claim_seconds: float, now_ms: int) -> int:
        """Claim up to `limit` leases of `shard` that ran out by `now_ms`, pushing each out by
        `claim_seconds`; the outcome lists (device, the expired holder's Grant)."""
        prefix = redis_key("lock", shard_tag(shard), "")
        op = {"o": "c", "shard": shard, "t": now_ms, "n": limit, "l": _ms(claim_seconds), "p": prefix}
        self.ops.append(op)
        return len(self.ops) - 1

    def restore(
        self, device: str, *, holder: str | None, fence: int, floor: int, lease_seconds: float
    ) -> int:
        """Rebuild a lock after a Redis loss (`device_lock_restore`): the fence counter rises
        to `floor`, an executing `holder` gets the lock back under `fence`. Outcome None."""
        op = {"o": "s", "d": device, "h": holder or "", "f": fence, "m": floor, "l": _ms(lease_seconds)}
        self.ops.append(op)
        return len(self.ops) - 1

    def preempt(
        self,
        device: str,
        *,
        holder: str,
        priority: int,
        lease_seconds: float,
        displace: str,
        displace_fence: int,
        displace_priority: int,
        on_grant: dict[str, float] | None = None,
        on_queue: dict[str, float] | None = None,
    ) -> int:
        """An urgent acquire that takes the lock from `displace` if it still holds it under
        `displace_fence` (a compare-and-set): the fence grows, so the displaced holder's
        token is stale, and it waits again at the head of its `displace_priority` band.
        Its outcome is Preempted; otherwise (the holder moved on) what `acquire` gives.
        Urgent preemption: docs/orchestration.md#urgent-preemption."""
        index = self.acquire(
            device,
            holder=holder,
            priority=priority,
            lease_seconds=lease_seconds,
            on_grant=on_grant,
            on_queue=on_queue,
        )
        self.ops[index].update(o="u", v=displace, vf=displace_fence, vp=displace_priority)
        return index

    def zset_add(self, members: dict[str, float], *, shard: int) -> None:
        """Add (or move) members of the sorted set's `shard`, whatever the outcomes."""
        if members:
            self.writes.setdefault(shard, {"zadd": {}, "zrem": []})["zadd"].update(members)

    def zset_remove(self, members: Sequence[str], *, shard: int) -> None:
        if members:
            self.writes.setdefault(shard, {"zadd": {}, "zrem": []})["zrem"].extend(members)


Outcome = Grant | Queued | NotReady | bool | list[tuple[str, Grant]] | None


def device_locks_apply(batch: LockBatch, *, zset: Callable[[int], str] | None = None) -> list[Outcome]:
    """Apply a LockBatch with transition.lua; one outcome per op, in order. `zset(shard)`
    names the sorted set's key of a shard (it must carry `shard_tag(shard)`); a batch
    without sorted-set writes needs none.

    A release gives the Grant it handed the lock on with, or None (free now, or the caller
    no longer held it: stale, nothing changed). An acquire gives Grant, Queued or NotReady,
    as `device_lock_acquire`. An extend gives True, or False when the caller no longer held
    the lock; a dequeue True, or False when the holder was not waiting. A reclaim gives its
    list of (device, Grant); a restore None. Fails with RedisError to the caller. On a
    single Redis the batch is one script call, applied whole or not at all; on a cluster it
    is one call per shard, each whole or not at all (a node failing mid-batch leaves the
    other shards' calls applied: what the caller then leaves uncommitted ends as a lost
    worker's batch does, by lease expiry and the monitor's sweep).
    """
    if not batch.ops and not batch.writes:
        return []
    # Settings read once: a single operation's cost is mostly this function's own.
    prefix, count = settings.IOTQUEUE_REDIS_KEY_PREFIX, lock_shards()
    by_shard: dict[int, list[int]] = {}
    for index, op in enumerate(batch.ops):
        by_shard.setdefault(op["shard"] if op["o"] == "c" else _shard_of(op["d"], count), []).append(index)
    for shard in batch.writes:
        by_shard.setdefault(shard, [])
    if zset is None and (batch.writes or any("g" in op or "q" in op or "gc" in op for op in batch.ops)):
        raise ValueError("a LockBatch with sorted-set writes needs zset")
    # One call per shard on a cluster (one hash slot each), one call for all of them otherwise.
    conn = lock_redis_connection()
    cluster = isinstance(conn, RedisCluster)
    calls = [[shard] for shard in by_shard] if cluster else [list(by_shard)]
    slotted = slots_args(prefix, batch.ops, cluster=cluster)
    requests = []
    for shards in calls:
        keys: list[str] = []
        groups = []
        for shard in shards:
            tag = _tag(prefix, shard, count)
            group: dict[str, Any] = {"s": len(keys) + 1}
            keys += [f"{prefix}:leases:{tag}", f"{prefix}:queue-seq:{tag}", f"{prefix}:lock-epoch:{tag}"]
            if zset is not None:
                group["z"] = len(keys) + 1
                keys.append(zset(shard))
            ops = []
            for index in by_shard[shard]:
                op = batch.ops[index]
                if op["o"] == "c":
                    ops.append(op)
                    continue
                ops.append({**op, **slotted.get(index, {}), "k": len(keys) + 1})
                keys += _device_keys(prefix, tag, op["d"])
            group["ops"] = ops
            writes = batch.writes.get(shard)
            if writes:
                group["zadd"] = [[score, member] for member, score in writes["zadd"].items()]
                group["zrem"] = writes["zrem"]
            groups.append(group)
        requests.append((_transition(), keys, [json.dumps({"groups": groups})]))
    if len(requests) == 1:
        # One call (a single operation, or a single Redis): sent as is, one round trip.
        script, keys, args = requests[0]
        replies = [script(keys=keys, args=args, client=conn)]
    else:
        replies = scripts_call(requests)
    results: list = [None] * len(batch.ops)
    for shards, reply in zip(calls, replies, strict=True):
        # cjson writes an empty list as {}: read it as an empty one.
        for shard, group in zip(shards, json.loads(reply) or [], strict=True):
            for index, result in zip(by_shard[shard], group or [], strict=True):
                results[index] = result
    batch.handed = [
        (extra[i], Grant(extra[i + 1], int(extra[i + 2])))
        for op, result in zip(batch.ops, results, strict=True)
        if op["o"] == "r" and len(result) > 3
        for extra in [result[3]]
        for i in range(0, len(extra), 3)
    ]
    return [_outcome(op, result) for op, result in zip(batch.ops, results, strict=True)]


def _outcome(op: dict, result: Any) -> Outcome:
    kind = op["o"]
    if kind == "u" and result[0] == 3:
        return Preempted(op["h"], int(result[1]), displaced=op["v"])
    if kind in ("a", "u"):
        if result[0] in (1, 2):
            return Grant(op["h"], int(result[1]), held=result[0] == 2)
        if result[0] == 0:
            slot = result[3] if len(result) > 3 else ""
            return Queued(int(result[1]), waiting=len(result) > 2 and result[2] == 1, slot=slot)
        return NotReady()
    if kind == "r":
        return Grant(result[1], int(result[2])) if result[0] == 1 else None
    if kind in ("e", "q"):
        return result[0] == 1
    if kind == "c":
        flat = result or []
        return [(flat[i], Grant(flat[i + 1], int(flat[i + 2]))) for i in range(0, len(flat), 3)]
    return None


def device_lock_dequeue(device: str, *, holder: str) -> bool:
    """Leave the device's wait queue (e.g. the run was canceled); False if not queued."""
    batch = LockBatch()
    batch.dequeue(device, holder=holder)
    return device_locks_apply(batch)[0]


def device_lock_state(device: str) -> LockState:
    """Who holds the device's lock, since when, until when, and who waits (in order)."""
    return device_lock_states([device])[device]


def device_lock_states(devices: list[str]) -> dict[str, LockState]:
    """`device_lock_state` for many devices in one Redis round trip (a page of a device list).

    Not atomic across devices: each device's state is read as it is at that moment.
    """
    with lock_redis_connection().pipeline(transaction=False) as pipe:
        for device in devices:
            device_lock_state_read(device, pipe=pipe)
        replies = pipe.execute()
    n = LOCK_STATE_REPLIES
    parsed = (device_lock_state_parse(device, replies[n * i : n * i + n]) for i, device in enumerate(devices))
    return {state.device: state for state in parsed}


# Replies `device_lock_state_read` adds to a pipeline, per device.
LOCK_STATE_REPLIES = 3


def device_lock_state_read(device: str, *, pipe: Any) -> None:
    """Queue the reads of a device's lock state on `pipe` (a pipeline of the lock Redis),
    so a caller reading other keys too stays at one round trip; `device_lock_state_parse`
    turns its LOCK_STATE_REPLIES replies into a LockState. Reads only."""
    k = _keys(device)
    pipe.hgetall(k["lock"])
    pipe.zscore(k["leases"], device)
    pipe.zrange(k["queue"], 0, -1)


def device_lock_state_parse(device: str, replies: Sequence[Any]) -> LockState:
    lock, lease, queue = replies
    return LockState(
        device=device,
        holder=lock.get("holder"),
        fence=int(lock["fence"]) if "fence" in lock else None,
        since_ms=int(lock["since"]) if "since" in lock else None,
        lease_until_ms=int(lease) if lease is not None else None,
        queue=list(queue),
    )


# Keys SCAN returns per round trip: large enough that 10,000 devices take a few dozen trips.
QUEUE_SCAN_BATCH = 1000


def device_queue_depths() -> dict[str, int]:
    """How many holders wait for each device that has any waiting (for /metrics).

    Redis deletes an empty sorted set, so only devices with waiters have a queue key: the
    keys are found with SCAN (Redis stays responsive, unlike KEYS; on a cluster, every
    primary is scanned) and counted in one pipeline. Costs O(keys in the database) per
    call: for a scrape every few seconds, never for the engine's hot path.
    """
    conn = lock_redis_connection()
    # iq:queue:{iq:<shard>/<shards>}:<device>
    head = redis_key("queue", "{" + settings.IOTQUEUE_REDIS_KEY_PREFIX + ":")
    tail = f"/{lock_shards()}" + "}:"
    # The key prefix is configuration: escape glob characters so it matches only itself.
    pattern = "".join("\\" + c if c in "*?[]\\" else c for c in head) + "*" + tail + "*"
    keys = sorted(set(conn.scan_iter(match=pattern, count=QUEUE_SCAN_BATCH)))
    with conn.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.zcard(key)
        depths = pipe.execute()
    return {
        key[len(head) :].partition(tail)[2]: depth for key, depth in zip(keys, depths, strict=True) if depth
    }


def lock_epoch_keys() -> list[str]:
    """Every shard's epoch key (present while that shard's lock state is complete)."""
    return [shard_key("lock-epoch", shard) for shard in range(lock_shards())]


def lock_epoch_exists() -> bool:
    """False after Redis lost its data (any shard's epoch is missing: a cluster node that
    lost its data counts too): locks must be rebuilt before that shard grants again."""
    with lock_redis_connection().pipeline(transaction=False) as pipe:
        for key in lock_epoch_keys():
            pipe.exists(key)
        return all(pipe.execute())


def lock_epoch_start() -> None:
    """Declare the lock state complete in every shard; grants resume."""
    with lock_redis_connection().pipeline(transaction=False) as pipe:
        for key in lock_epoch_keys():
            pipe.set(key, str(time.time()))
        pipe.execute()


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
    batch = LockBatch()
    batch.release(device, holder=holder, fence=fence, force=force)
    grant = device_locks_apply(batch)[0]
    if grant is not None:
        device_lock_handoff(device, grant)
    # Slots the release freed may have handed other devices' locks on (shared limits).
    for other, handed in batch.handed:
        device_lock_handoff(other, handed)
    return grant
