"""Step deadlines in a Redis sorted set: the monitor's cost is O(what is due).

A member is "<kind>:<step_run_id>:<attempt>" scored by its due time (ms since the epoch).
Kinds: `queue` (waited too long for the device), `ack` and `done` (the device did not
answer in time), `retry` (back-off over: queue again), `send` (the command was committed
but its publish never confirmed: send it again), `dispatch` (flow control: the device may
take its next command now), `wake` (a delay step is over), `pump` (a fan-out's rollout
rate allows starting more devices; the member names a row of the fan-out not yet started),
`run` (a run's max_duration is over; the member names the run by its UUID, not a step row).

How it fails: the set lives in Redis, so a Redis restart loses it. The step rows carry
the same deadline (`StepRun.deadline`), and the monitor's reconcile pass re-finds overdue
steps from the database; so a lost member delays a timeout, it never loses a step.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from iotqueue.redis_conn import redis_connection, redis_key

KINDS = ("queue", "ack", "done", "retry", "send", "dispatch", "wake", "pump", "run")
# Kinds whose member names a run (its UUID) instead of a step row.
RUN_KINDS = ("run",)


@dataclass(frozen=True)
class Deadline:
    kind: str
    step_run_id: int | str  # a run's UUID (str) for RUN_KINDS
    attempt: int

    @property
    def member(self) -> str:
        return f"{self.kind}:{self.step_run_id}:{self.attempt}"

    @classmethod
    def parse(cls, member: str) -> Deadline:
        kind, target, attempt = member.split(":")
        return cls(kind, target if kind in RUN_KINDS else int(target), int(attempt))


def deadlines_key() -> str:
    """The sorted set itself, for callers that write it inside a larger Redis call."""
    return redis_key("deadlines")


def deadline_score(when: datetime | float) -> int:
    """A due time as the set scores it (ms since the epoch)."""
    return _ms(when)


@functools.cache
def _claim_script():
    return redis_connection().register_script((Path(__file__).with_name("lua") / "claim_due.lua").read_text())


def _ms(when: datetime | float) -> int:
    return int((when.timestamp() if isinstance(when, datetime) else when) * 1000)


def deadlines_set(entries: dict[Deadline, datetime | float], *, pipe=None) -> None:
    """Add (or move) deadlines; `pipe` joins an existing pipeline."""
    if not entries:
        return
    target = pipe if pipe is not None else redis_connection()
    target.zadd(deadlines_key(), {d.member: _ms(when) for d, when in entries.items()})


def deadlines_clear(deadlines: list[Deadline], *, pipe=None) -> None:
    if deadlines:
        target = pipe if pipe is not None else redis_connection()
        target.zrem(deadlines_key(), *[d.member for d in deadlines])


def deadlines_claim(*, limit: int, now: float | None = None) -> list[Deadline]:
    """Atomically take up to `limit` deadlines that are due (earliest first)."""
    members = _claim_script()(keys=[deadlines_key()], args=[_ms(time.time() if now is None else now), limit])
    return [Deadline.parse(m) for m in members]


def deadlines_pending() -> int:
    return redis_connection().zcard(deadlines_key())
