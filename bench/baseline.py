"""Raw Celery baseline: R chains of S no-op links through the same Redis and worker settings;
and the latency of one chain link to the next with one chain at a time."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from itertools import pairwise

from celery import chain

from iotqueue.redis_conn import redis_connection

from .tasks import finished_key, hop, noop

# Chains sent and awaited before the measurement, so worker children have imported
# everything and opened their connections, as the engine's warm-up runs do.
WARMUP_CHAINS = 10
POLL_SECONDS = 0.02
# A blocking read waits at most this long at a time (redis-py's default socket timeout is 5 s).
BLOCK_SECONDS = 1


@dataclass(frozen=True)
class BaselineResult:
    chains: int
    links: int
    seconds: float

    @property
    def links_per_s(self) -> float:
        return self.links / self.seconds


def chains_run(*, chains: int, links: int, queue: str, timeout: float) -> BaselineResult:
    """Send `chains` chains of `links` no-op links at once; time until the last chain ends.

    Raises TimeoutError when they do not all finish within `timeout` seconds.
    """
    counter = f"{queue}:done:{uuid.uuid4().hex[:8]}"
    conn = redis_connection()
    signatures = [
        chain(
            *[noop.si().set(queue=queue) for _ in range(links - 1)], noop.si(counter, chains).set(queue=queue)
        )
        for _ in range(chains)
    ]
    started = time.time()
    for signature in signatures:
        signature.apply_async()
    deadline = time.monotonic() + timeout
    while (finished := conn.get(finished_key(counter))) is None:
        if time.monotonic() > deadline:
            done = int(conn.get(counter) or 0)
            raise TimeoutError(f"baseline: {done}/{chains} chains finished after {timeout}s")
        time.sleep(POLL_SECONDS)
    conn.delete(counter, finished_key(counter))
    return BaselineResult(chains, chains * links, float(finished) - started)


def hops_run(*, chains: int, links: int, queue: str, timeout: float) -> list[float]:
    """Send `chains` chains of `links` `bench.hop` links one after the other, each once the
    one before ended: the seconds from each link's start to the next link's start.

    That is raw Celery's hand-off from one task to the next (the task's end, its
    acknowledgement, the next message through Redis, the worker handing it to a pool
    process) with the worker otherwise idle, to set beside the engine's trickle hand-off.
    Raises TimeoutError when a chain does not end within `timeout` seconds.
    """
    key = f"{queue}:hops:{uuid.uuid4().hex[:8]}"
    conn = redis_connection()
    samples: list[float] = []
    for _ in range(chains):
        last = hop.s(key=key).set(queue=queue)
        chain(*[hop.s().set(queue=queue) for _ in range(links - 1)], last).apply_async()
        deadline = time.monotonic() + timeout
        while (answer := conn.blpop([key], timeout=BLOCK_SECONDS)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"baseline: a chain of {links} hop links did not end after {timeout}s")
        stamps = json.loads(answer[1])
        samples.extend(b - a for a, b in pairwise(stamps))
    conn.delete(key)
    return samples
