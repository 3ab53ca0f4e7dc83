"""The deadline sets, sharded like the device locks (jobs/deadlines.py): the monitor claims
what is due from every shard, and only that, on a single Redis and on a Redis Cluster."""

import time
import uuid

import pytest

from devices.locks import lock_epoch_start, lock_shards
from jobs import monitor
from jobs.deadlines import Deadline, deadlines_claim, deadlines_pending, deadlines_set

pytestmark = pytest.mark.django_db

# Step ids of the synthetic deadlines: clear of any real row, so a claimed one changes nothing.
SYNTHETIC_ID_BASE = 10**9


@pytest.fixture(params=["redis", "cluster"])
def lock_redis(request, settings):
    # Keys of their own, so the session's monitor (beat) claims none of these deadlines.
    settings.IOTQUEUE_REDIS_KEY_PREFIX = f"shardtest-{uuid.uuid4().hex[:8]}"
    if request.param == "cluster":
        settings.LOCK_REDIS_URL = request.getfixturevalue("redis_cluster")
    lock_epoch_start()
    return request.param


def synthetic(n: int, *, offset: int = 0) -> list[Deadline]:
    """Deadlines spread over every shard: steps on devices of their own, and delay steps."""
    return [
        Deadline("done", SYNTHETIC_ID_BASE + offset + i, 1, f"shard-dev-{offset + i}")
        if i % 2
        else Deadline("wake", SYNTHETIC_ID_BASE + offset + i, 0)
        for i in range(n)
    ]


def test_the_monitor_claims_due_deadlines_from_every_shard_and_nothing_else(lock_redis, monkeypatch):
    # given due deadlines in every shard, and as many not due yet
    due = synthetic(8 * lock_shards())
    assert len({d.shard for d in due}) == lock_shards()
    later = synthetic(8 * lock_shards(), offset=10_000)
    deadlines_set(dict.fromkeys(due, time.time() - 1))
    deadlines_set(dict.fromkeys(later, time.time() + 3600))
    sent = []

    class Signature:  # the tasks the tick enqueues, recorded instead of sent
        def __init__(self, name, args):
            self.args = args

        def delay(self):
            sent.append(self.args)

        def apply_async(self, **options):  # with an argsrepr summary for Celery's tools
            sent.append(self.args)

    monkeypatch.setattr(monitor.current_app, "signature", Signature)

    # when the monitor ticks
    counts = monitor.monitor_tick()

    # then it claimed every due deadline once, in chunks of tasks, and left the others
    claimed = [member for (chunk,) in sent for member in chunk]
    assert counts["deadlines"] == len(due)
    assert sorted(claimed) == sorted(d.member for d in due)
    assert deadlines_pending() == len(later)
    assert deadlines_claim(limit=10_000) == []


def test_a_claim_takes_at_most_its_limit_across_the_shards_and_the_rest_next_time(lock_redis):
    # given more due deadlines than one claim takes, most of them in one shard
    crowded = [Deadline("queue", SYNTHETIC_ID_BASE + i, 1, "one-busy-device") for i in range(60)]
    spread = synthetic(40)
    deadlines_set(dict.fromkeys(crowded + spread, time.time() - 1))

    # when the monitor claims twice
    first = deadlines_claim(limit=50)
    second = deadlines_claim(limit=100)

    # then the first claim took exactly its limit, the second the rest, nothing twice
    assert len(first) == 50
    assert sorted(d.member for d in first + second) == sorted(d.member for d in crowded + spread)
    assert deadlines_pending() == 0
