"""Raw Celery baseline: R chains of S no-op links through the same Redis and worker settings."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from celery import chain

from iotqueue.redis_conn import redis_connection

from .tasks import finished_key, noop

# Chains sent and awaited before the measurement, so worker children have imported
# everything and opened their connections, as the engine's warm-up runs do.
WARMUP_CHAINS = 10
POLL_SECONDS = 0.02


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
