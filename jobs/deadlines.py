"""Step deadlines in a Redis sorted set: the monitor's cost is O(what is due).

A member is "<kind>:<step_run_id>:<attempt>" scored by its due time (ms since the epoch).
Kinds: `queue` (waited too long for the device), `ack` and `done` (the device did not
answer in time), `retry` (back-off over: queue again), `send` (the command was committed
but its publish never confirmed: send it again), `dispatch` (flow control: the device may
take its next command now), `wake` (a delay step is over), `pump` (a fan-out's rollout
rate allows starting more devices; the member names a row of the fan-out not yet started),
`soak` (a fan-out wave's soak time is over; the member names the next wave's first row),
`run` (a run's max_duration is over; the member names the run by its UUID, not a step row),
`fanout_close` (a continuous fan-out's end-by: the member names the run, its attempt the step).
`window` (a command held by its time windows may go: jobs/engine/holds.py), `start` and
`end` (a run's start-not-before and end-by: jobs/run_windows.py; they name the run too).

The set is sharded like the device locks (devices/locks.py) and lives with them (on
LOCK_REDIS_URL's Redis): a deadline of a step on a device (`DEVICE_KINDS`) is in its
device's shard, so the lock scripts write it in the same call as the grant it depends on;
any other (`wake`, `pump`, `run`, a step without a device) in the shard of its member's
hash. Build a step's deadlines with `Deadline.of(kind, step_run, attempt)`, so setting and
clearing find the same shard. The monitor claims from every shard (`deadlines_claim`).

How it fails: the set lives in Redis, so a Redis restart loses it. The step rows carry
the same deadline (`StepRun.deadline`), and the monitor's reconcile pass re-finds overdue
steps from the database; so a lost member delays a timeout, it never loses a step.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from redis.commands.core import Script

from devices.locks import fair_shares, lock_shard, lock_shards, scripts_call, shard_key
from iotqueue.redis_conn import lock_redis_connection, redis_key

# A continuous fan-out's end-by: the member names its run (UUID) and, as its attempt, the step.
FANOUT_CLOSE = "fanout_close"
KINDS = (
    "queue",
    "ack",
    "done",
    "retry",
    "send",
    "dispatch",
    "wake",
    "pump",
    "soak",
    "run",
    FANOUT_CLOSE,
    "window",
    "start",
    "end",
)
# Kinds whose member names a run (its UUID) instead of a step row.
RUN_KINDS = ("run", FANOUT_CLOSE, "start", "end")
# Kinds kept in the shard of the step's device (the lock scripts write some of them).
DEVICE_KINDS = ("queue", "ack", "done", "retry", "send", "dispatch", "window")


@dataclass(frozen=True)
class Deadline:
    kind: str
    step_run_id: int | str  # a run's UUID (str) for RUN_KINDS
    attempt: int
    # The step's device, for DEVICE_KINDS: it picks the shard. Not part of the member.
    device: str | None = field(default=None, compare=False)

    @classmethod
    def of(cls, kind: str, step_run: Any, attempt: int | None = None) -> Deadline:
        """A deadline of a step row (its current attempt unless given), in the right shard."""
        device = step_run.device.name if kind in DEVICE_KINDS and step_run.device_id else None
        return cls(kind, step_run.pk, step_run.attempt if attempt is None else attempt, device)

    @property
    def member(self) -> str:
        return f"{self.kind}:{self.step_run_id}:{self.attempt}"

    @property
    def shard(self) -> int:
        route = self.device if self.device is not None and self.kind in DEVICE_KINDS else self.member
        return lock_shard(route)

    @classmethod
    def parse(cls, member: str) -> Deadline:
        kind, target, attempt = member.split(":")
        return cls(kind, target if kind in RUN_KINDS else int(target), int(attempt))


def deadlines_key(shard: int) -> str:
    """One shard of the sorted set, for callers that write it inside a larger Redis call."""
    return shard_key("deadlines", shard)


# The unsharded set of earlier versions: still drained, so that deadlines set before an
# upgrade fire on time (nothing writes it any more).
def _legacy_key() -> str:
    return redis_key("deadlines")


def deadline_score(when: datetime | float) -> int:
    """A due time as the set scores it (ms since the epoch)."""
    return _ms(when)


@functools.cache
def _claim_script():
    # Not bound to a client: devices.locks.scripts_call sends it to the lock Redis.
    return Script(None, (Path(__file__).with_name("lua") / "claim_due.lua").read_bytes())


def _ms(when: datetime | float) -> int:
    return int((when.timestamp() if isinstance(when, datetime) else when) * 1000)


def by_shard(deadlines: Iterable[Deadline]) -> dict[int, list[Deadline]]:
    shards: dict[int, list[Deadline]] = {}
    for deadline in deadlines:
        shards.setdefault(deadline.shard, []).append(deadline)
    return shards


def deadlines_set(entries: dict[Deadline, datetime | float], *, pipe=None) -> None:
    """Add (or move) deadlines; `pipe` joins an existing pipeline of the lock Redis."""
    if not entries:
        return
    with _pipeline(pipe) as target:
        for shard, group in by_shard(entries).items():
            target.zadd(deadlines_key(shard), {d.member: _ms(entries[d]) for d in group})


def deadlines_clear(deadlines: list[Deadline], *, pipe=None) -> None:
    if not deadlines:
        return
    with _pipeline(pipe) as target:
        for shard, group in by_shard(deadlines).items():
            target.zrem(deadlines_key(shard), *[d.member for d in group])


@contextmanager
def _pipeline(pipe) -> Iterator[Any]:
    """The caller's pipeline, or one of our own, executed at the end (one round trip)."""
    if pipe is not None:
        yield pipe
        return
    with lock_redis_connection().pipeline(transaction=False) as own:
        yield own
        own.execute()


def deadlines_claim(*, limit: int, now: float | None = None) -> list[Deadline]:
    """Atomically take up to `limit` deadlines that are due, from every shard.

    One round trip counts what is due per shard (the only one when nothing is); one more
    claims, each shard's earliest first, up to `limit` in all, shared fairly among the
    shards (devices.locks.fair_shares). Claimed in a shard means removed there: no other
    monitor claims it too.
    """
    due_ms = _ms(time.time() if now is None else now)
    keys = [deadlines_key(shard) for shard in range(lock_shards())] + [_legacy_key()]
    with lock_redis_connection().pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.zcount(key, "-inf", due_ms)
        counts = pipe.execute()
    calls = [
        (_claim_script(), [key], [due_ms, share])
        for key, share in zip(keys, fair_shares(counts, limit), strict=True)
        if share
    ]
    members = [member for claimed in (scripts_call(calls) if calls else []) for member in claimed]
    return [Deadline.parse(m) for m in members]


def deadlines_pending() -> int:
    keys = [deadlines_key(shard) for shard in range(lock_shards())] + [_legacy_key()]
    with lock_redis_connection().pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.zcard(key)
        return sum(pipe.execute())
