"""The device lock's batches and shards against a real Redis: a batch over every shard, the
queue depths and expired leases found in every shard, a shard that lost its epoch, leaving
a queue. The lock's rules case by case are in test_lock_rules.py.

Every test runs twice: on the session's Redis, and with LOCK_REDIS_URL on a real 3-node
Redis Cluster (`lock_space` in conftest.py), where each script call must stay in one slot.
"""

import time
import uuid

import pytest

from devices.locks import (
    Grant,
    LockBatch,
    NotReady,
    Queued,
    device_lock_acquire,
    device_lock_dequeue,
    device_lock_expired,
    device_lock_release,
    device_lock_state,
    device_lock_states,
    device_locks_apply,
    device_queue_depths,
    lock_epoch_exists,
    lock_epoch_start,
    lock_shard,
    lock_shards,
    shard_key,
)
from iotqueue.redis_conn import lock_redis_connection

LEASE = 30.0

pytestmark = pytest.mark.usefixtures("lock_space")


def acquire(device, holder, priority=5, lease=LEASE):
    return device_lock_acquire(device, holder=holder, priority=priority, lease_seconds=lease)


def test_dequeue_leaves_the_queue(device):
    acquire(device, "a:1")
    acquire(device, "a:2")
    assert device_lock_dequeue(device, holder="a:2") is True
    assert device_lock_dequeue(device, holder="a:2") is False
    assert device_lock_state(device).queue == []


def devices_in_every_shard(per_shard: int = 2) -> list[str]:
    """Device names covering every lock shard, `per_shard` in each."""
    found: dict[int, list[str]] = {}
    n = 0
    while any(len(found.get(shard, [])) < per_shard for shard in range(lock_shards())):
        name = f"lockdev-{uuid.uuid4().hex[:6]}-{n}"
        n += 1
        if len(found.setdefault(lock_shard(name), [])) < per_shard:
            found[lock_shard(name)].append(name)
    return [name for names in found.values() for name in names]


def zset(shard: int) -> str:
    return shard_key("test-zset", shard)


def test_a_batch_over_every_shard_applies_each_op_in_order_with_its_writes():
    # given devices in every shard: the first of each pair held by "a:0", the second free
    devices = devices_in_every_shard()
    held, free = devices[0::2], devices[1::2]
    fences = {device: acquire(device, "a:0").fence for device in held}

    # when one batch releases and re-acquires the held ones, acquires the free ones twice
    # (the second waits) and extends a lease, with writes depending on each outcome
    batch = LockBatch()
    for device in held:
        batch.release(device, holder="a:0", fence=fences[device])
    for device in free:
        batch.acquire(device, holder="b:1", priority=5, lease_seconds=LEASE, on_grant={f"g:{device}": 1})
        batch.acquire(device, holder="b:2", priority=5, lease_seconds=LEASE, on_queue={f"q:{device}": 2})
    for device in held:
        batch.acquire(device, holder="c:1", priority=5, lease_seconds=LEASE, on_grant={f"g:{device}": 3})
    batch.extend(free[0], holder="b:1", fence=1, lease_seconds=LEASE)
    batch.extend(free[1], holder="b:9", fence=1, lease_seconds=LEASE)
    batch.zset_add({"always": 4}, shard=lock_shard(free[0]))
    outcomes = device_locks_apply(batch, zset=zset)

    # then every op has its outcome, in the order it was added
    n = len(held)
    assert outcomes[:n] == [None] * n  # released, nobody waiting: free now
    assert outcomes[n : 3 * n : 2] == [Grant("b:1", 1)] * n
    assert outcomes[n + 1 : 3 * n : 2] == [Queued(1)] * n
    assert outcomes[3 * n : 4 * n] == [Grant("c:1", fences[device] + 1) for device in held]
    assert outcomes[4 * n :] == [True, False]
    # and the writes went to each device's shard of the sorted set
    conn = lock_redis_connection()
    for device in devices:
        members = conn.zrange(zset(lock_shard(device)), 0, -1)
        assert f"g:{device}" in members
        assert (f"q:{device}" in members) == (device in free)
    assert "always" in conn.zrange(zset(lock_shard(free[0])), 0, -1)
    states = device_lock_states(devices)
    assert all(states[device].holder == "c:1" for device in held)
    assert all(states[device].queue == ["b:2"] for device in free)


def test_a_grant_clears_what_it_was_told_to_and_a_wait_keeps_it(device):
    # given a waiting row's queue deadline in the device's shard of the sorted set, and the
    # device held by someone else
    conn = lock_redis_connection()
    key = zset(lock_shard(device))
    conn.zadd(key, {f"queue:{device}": 1})
    other = acquire(device, "a:other")
    batch = LockBatch()
    batch.acquire(device, holder="a:row", priority=5, lease_seconds=LEASE, on_grant_clear=[f"queue:{device}"])

    # when the row asks again while the device is busy: it waits, and the deadline stays
    assert device_locks_apply(batch, zset=zset) == [Queued(1)]
    assert f"queue:{device}" in conn.zrange(key, 0, -1)

    # and when it asks once the device is free: granted, the deadline is gone
    device_lock_dequeue(device, holder="a:row")
    device_lock_release(device, holder="a:other", fence=other.fence)
    assert device_locks_apply(batch, zset=zset) == [Grant("a:row", other.fence + 1)]
    assert f"queue:{device}" not in conn.zrange(key, 0, -1)


def test_queue_depths_and_expired_leases_are_found_in_every_shard():
    # given a device waited for in every shard, and every holder's lease run out
    devices = devices_in_every_shard(per_shard=1)
    for device in devices:
        acquire(device, "a:1", lease=0.05)
        acquire(device, "a:2")
    time.sleep(0.1)

    # then the queue depths name every device
    assert {
        device: depth for device, depth in device_queue_depths().items() if device in devices
    } == dict.fromkeys(devices, 1)
    # and the expired leases are claimed up to the limit in all, then the rest, never twice
    first = dict(device_lock_expired(limit=len(devices) - 3, claim_seconds=30))
    rest = dict(device_lock_expired(limit=100_000, claim_seconds=30))
    assert len(first) == len(devices) - 3
    assert set(first) | set(rest) == set(devices)
    assert not set(first) & set(rest)


def test_a_shard_that_lost_its_epoch_grants_nothing_until_the_epoch_is_back():
    # given one shard lost its epoch (a cluster node lost its data), the others kept theirs
    lost, kept = devices_in_every_shard(per_shard=1)[:2]
    lock_redis_connection().delete(shard_key("lock-epoch", lock_shard(lost)))

    # then the lock state counts as lost, the shard grants nothing, the others go on
    assert not lock_epoch_exists()
    assert isinstance(acquire(lost, "a:1"), NotReady)
    assert isinstance(acquire(kept, "a:1"), Grant)
    lock_epoch_start()
    assert lock_epoch_exists()
    assert isinstance(acquire(lost, "a:1"), Grant)
