"""A Redis stream of work that one Celery task at a time drains: the pieces its users share.

Producers append an entry and, in the same round trip, set the stream's wake flag with NX:
the one that set it sends the drain task, so while a drain is outstanding no further
task is sent. The drain reads through a consumer group (`read`), keeps the flag alive
while it reads, and clears it in the same round trip as its last read: an entry appended
after that read finds the flag gone and wakes a new task; one appended before it is read
by this drain. Entries are acknowledged and deleted only after they were applied
(`done`), so a drain that dies leaves them pending under its consumer name: a retried
task in the same process reads its own pending entries first, and `reclaim` hands those
of consumers that are gone to whoever calls it. A wake-up whose task never ran (its
worker died first) stops blocking new ones when the flag expires.

jobs/inbox.py (replies and run starts, for the engine) and webhooks/outbox.py (run events
out) are the two streams.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from celery import current_app

from .redis_conn import redis_key

# A wake-up that was sent but never ran (its worker died first) stops blocking new ones
# after this long.
WAKE_TTL_MS = 5000
# Entries pending this long under a consumer are taken over by `reclaim` (that consumer
# is assumed gone: applying an entry takes milliseconds).
RECLAIM_IDLE_SECONDS = 10.0


def consumer_name() -> str:
    """This process's consumer name: a retried task in the same process finds its own."""
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class WorkStream:
    """The stream `name` (a Redis key under the project's prefix), drained by `task`."""

    name: str
    task: str
    group: str = "workers"

    def key(self) -> str:
        return redis_key(self.name)

    def wake_key(self, helper: bool = False) -> str:
        """The flag of the outstanding drain (or of its one helper, for jobs/inbox.py)."""
        return redis_key(f"{self.name}-helper" if helper else f"{self.name}-wake")

    def append(
        self,
        conn: redis.Redis,
        fields: dict[str, str],
        *,
        wake_delay_ms: float = 0,
        summary: Callable[[], str] | None = None,
    ) -> None:
        """Append an entry and wake a drain if none is outstanding: one round trip.

        `wake_delay_ms` postpones the drain task that much (a Celery countdown), so that
        the entries appended meanwhile are taken with this one (0: at once). `summary()`,
        called only when a task is sent, is its `argsrepr` (what Celery's events show).
        """
        with conn.pipeline(transaction=False) as pipe:
            pipe.xadd(self.key(), fields)
            pipe.set(self.wake_key(), "1", nx=True, px=WAKE_TTL_MS)
            _, wake = pipe.execute()
        if wake:
            options: dict[str, Any] = {"argsrepr": summary()} if summary is not None else {}
            if wake_delay_ms:
                options["countdown"] = wake_delay_ms / 1000
            current_app.signature(self.task).apply_async(**options)

    def group_ensure(self, conn: redis.Redis) -> None:
        try:
            conn.xgroup_create(self.key(), self.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def read(
        self,
        conn: redis.Redis,
        *,
        count: int,
        own_pending: bool,
        last: bool = False,
        block_ms: int = 0,
        helper: bool = False,
    ) -> list[tuple[str, dict]]:
        """Entries for this consumer: its own pending ones (id 0) or new ones (>).

        Reading new entries keeps the wake flag alive (this drain is the outstanding
        wake-up); the `last` read clears it first. `block_ms` waits that long for an entry.
        """
        streams = {self.key(): "0" if own_pending else ">"}
        for _ in range(2):
            try:
                with conn.pipeline(transaction=False) as pipe:
                    if last:
                        pipe.delete(self.wake_key(helper))
                    else:
                        pipe.set(self.wake_key(helper), "1", px=WAKE_TTL_MS)
                    pipe.xreadgroup(self.group, consumer_name(), streams, count=count, block=block_ms or None)
                    answer = pipe.execute()[-1]
            except redis.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                self.group_ensure(conn)  # first use, or Redis lost its data: read again
                continue
            return self.entries_of(answer)
        return []

    def read_queue(self, pipe: Any, *, count: int, helper: bool = False) -> None:
        """Queue in `pipe` what a non-last `read` of new entries sends (its answer is the
        pipeline's last reply: `entries_of`)."""
        pipe.set(self.wake_key(helper), "1", px=WAKE_TTL_MS)
        pipe.xreadgroup(self.group, consumer_name(), {self.key(): ">"}, count=count)

    @staticmethod
    def entries_of(answer: Any) -> list[tuple[str, dict]]:
        return answer[0][1] if answer else []

    def done(self, ids: list[str], pipe: Any) -> None:
        """Acknowledge and delete applied entries (joins the caller's pipeline)."""
        if ids:
            pipe.xack(self.key(), self.group, *ids)
            pipe.xdel(self.key(), *ids)

    def reclaim(self, conn: redis.Redis, *, count: int, consumer: str) -> list[tuple[str, dict]]:
        """Entries pending RECLAIM_IDLE_SECONDS or longer, now `consumer`'s (none: [])."""
        try:
            idle_ms = int(RECLAIM_IDLE_SECONDS * 1000)
            answer = conn.xautoclaim(self.key(), self.group, consumer, idle_ms, start_id="0-0", count=count)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            return []
        return answer[1]
