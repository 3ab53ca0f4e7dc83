"""The end of a device lock's life when its holder cannot end it: lease reclaim and rebuild.

Two things go wrong with a lock whose holder is gone. Its lease runs out (the holder's
process died, or it lost Redis for longer than the lease): `locks_maintain` claims expired
leases and `device_lease_reclaim` ends each, asking the holder's kind what to do first
(a job step ends its attempt; an unknown or finished holder is simply passed on). Or
Redis loses its data: no grant is made (devices/locks.py, NotReady) until
`locks_rebuild` has restored, from the registered sources of truth (the jobs app's step
rows), every executing holder and every fence floor, then lets waiting holders ask again.

Apps register per holder kind, as for hand-offs: `lease_expiry_register(kind, handler)`
and `rebuild_source_register(source)` / `rebuild_after_register(hook)`. Without any
registration (a project using only DeviceLockedTask) expired leases are passed on and a
rebuild restores empty locks, so the lock extension for plain Celery tasks recovers on
its own.

How it fails: both run in whichever process calls them (the monitor tick, a worker that
found NotReady). Only one process rebuilds at a time (a Redis flag with an expiry that
bounds a crashed rebuilder); the others find NotReady again and retry on the next tick.
The lock state is sharded (devices/locks.py), each shard with its own epoch; a missing
epoch in any shard (a Redis restart, a cluster node that lost its data, a new shard count)
counts as a loss of all: the whole state is rebuilt (restoring is idempotent for the
shards that kept theirs), and a shard without its epoch grants nothing until then.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from celery import current_app

from iotqueue.redis_conn import lock_redis_connection, redis_key

from .locks import (
    Grant,
    LockBatch,
    device_lock_expired,
    device_lock_pass_on,
    device_locks_apply,
    holder_parse,
    lock_epoch_exists,
    lock_epoch_start,
)

log = logging.getLogger(__name__)

# Leases claimed per call; more wait for the next tick (a second later).
LEASE_CLAIM_BATCH = 500
# An expired lease being reclaimed is pushed out this far so it is not claimed twice.
LEASE_CLAIM_SECONDS = 30.0
# Only one process rebuilds the locks at a time; this bounds a crashed rebuilder's hold.
REBUILD_LOCK_SECONDS = 60
# Devices restored per lock call while rebuilding (one round trip each, per shard on a cluster).
REBUILD_BATCH = 1000
LEASE_RECLAIM_TASK = "devices.lease_reclaim"


@dataclass(frozen=True)
class LockRecord:
    """What a source of truth knows about one device's lock after Redis lost it."""

    device: str
    holder: str | None  # who is executing on the device now, if anyone
    fence: int  # the executing holder's fence (or the floor when nobody executes)
    floor: int  # the highest fence ever issued for the device
    lease_seconds: float = 0.0


LeaseExpiryHandler = Callable[[str, Grant], None]
RebuildSource = Callable[[], Iterable[LockRecord]]
RebuildHook = Callable[[], None]

_expiry_handlers: dict[str, LeaseExpiryHandler] = {}
_rebuild_sources: list[RebuildSource] = []
_rebuild_after: list[RebuildHook] = []


def lease_expiry_register(kind: str, handler: LeaseExpiryHandler) -> None:
    """`handler(device, grant)` ends a holder of `kind` whose lease ran out.

    The handler must leave the lock passed on (directly, or by ending the holder's work in
    a way that releases it).
    """
    _expiry_handlers[kind] = handler


def rebuild_source_register(source: RebuildSource) -> None:
    """`source()` lists LockRecords: executing holders and fence floors to restore."""
    if source not in _rebuild_sources:
        _rebuild_sources.append(source)


def rebuild_after_register(hook: RebuildHook) -> None:
    """`hook()` runs once grants resume after a rebuild (waiting holders ask again)."""
    if hook not in _rebuild_after:
        _rebuild_after.append(hook)


def device_lease_reclaim(*, device: str, holder: str, fence: int) -> None:
    """End a holder whose lease ran out: its kind's handler, or pass the lock on."""
    kind, _ = holder_parse(holder)
    handler = _expiry_handlers.get(kind)
    if handler is not None:
        handler(device, Grant(holder, fence))
        return
    log.warning("lock on %s: lease of %s (fence %d) expired; passing it on", device, holder, fence)
    device_lock_pass_on(device, holder=holder, fence=fence)


def locks_maintain() -> dict[str, int]:
    """One maintenance pass: rebuild lost lock state, hand expired leases to reclaim tasks.

    Cheap when nothing is wrong (two Redis round trips). Returns counts for logs and metrics.
    """
    rebuilt = 0 if lock_epoch_exists() else int(locks_rebuild())
    expired = device_lock_expired(limit=LEASE_CLAIM_BATCH, claim_seconds=LEASE_CLAIM_SECONDS)
    for device, grant in expired:
        current_app.signature(LEASE_RECLAIM_TASK, args=(device, grant.holder, grant.fence)).delay()
    return {"rebuilt": rebuilt, "leases": len(expired)}


def locks_rebuild() -> bool:
    """Rebuild device locks from the registered sources after Redis lost them.

    Runs in one process at a time. Fence counters are raised to the highest fence the
    sources have seen, each executing holder gets its lock back (restores in batches of
    REBUILD_BATCH, through the lock script like every other lock change), then grants
    resume and the after-rebuild hooks let waiting holders ask again. False if another
    process is at it.
    """
    conn = lock_redis_connection()
    if not conn.set(redis_key("lock-rebuild"), "1", nx=True, ex=REBUILD_LOCK_SECONDS):
        return False
    try:
        log.warning("device locks: Redis has no lock state; rebuilding")
        restored = 0
        batch = LockBatch()
        for source in _rebuild_sources:
            for record in source():
                batch.restore(
                    record.device,
                    holder=record.holder,
                    fence=record.fence,
                    floor=record.floor,
                    lease_seconds=record.lease_seconds,
                )
                restored += record.holder is not None
                if len(batch.ops) >= REBUILD_BATCH:
                    device_locks_apply(batch)
                    batch = LockBatch()
        device_locks_apply(batch)
        lock_epoch_start()
        for hook in _rebuild_after:
            hook()
        log.warning("device locks rebuilt: %d executing holders restored", restored)
        return True
    finally:
        conn.delete(redis_key("lock-rebuild"))
