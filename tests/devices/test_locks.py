"""The device lock against a real Redis: grant, fence, FIFO hand-off, priority, leases, epoch.

Every test runs twice: on the session's Redis, and with LOCK_REDIS_URL on a real 3-node
Redis Cluster (the `redis_cluster` fixture), where each script call must stay in one slot.
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
    device_lock_extend,
    device_lock_release,
    device_lock_restore,
    device_lock_state,
    device_lock_states,
    device_locks_apply,
    device_queue_depths,
    lock_epoch_exists,
    lock_epoch_keys,
    lock_epoch_start,
    lock_shard,
    lock_shards,
    shard_key,
)
from iotqueue.redis_conn import lock_redis_connection

LEASE = 30.0


@pytest.fixture(autouse=True, params=["redis", "cluster"])
def epoch(request, settings):
    # Keys of their own: the session's monitor (beat) would otherwise reclaim the leases
    # these tests let expire, racing the assertions.
    settings.IOTQUEUE_REDIS_KEY_PREFIX = f"locktest-{uuid.uuid4().hex[:8]}"
    if request.param == "cluster":
        settings.LOCK_REDIS_URL = request.getfixturevalue("redis_cluster")
    lock_epoch_start()


@pytest.fixture
def device() -> str:
    return f"lockdev-{uuid.uuid4().hex[:8]}"


def acquire(device, holder, priority=5, lease=LEASE):
    return device_lock_acquire(device, holder=holder, priority=priority, lease_seconds=lease)


def test_free_device_is_granted_with_increasing_fences(device):
    first = acquire(device, "a:1")
    assert isinstance(first, Grant)
    device_lock_release(device, holder="a:1", fence=first.fence)
    second = acquire(device, "a:2")
    assert second.fence == first.fence + 1


def test_reacquire_by_the_holder_is_idempotent(device):
    first = acquire(device, "a:1")
    assert acquire(device, "a:1") == first
    assert device_lock_state(device).queue == []


def test_busy_device_queues_fifo_within_priority_and_hands_off(device):
    holder = acquire(device, "a:0")
    assert acquire(device, "a:1") == Queued(1)
    assert acquire(device, "a:2") == Queued(2)
    assert acquire(device, "a:urgent", priority=9) == Queued(1)
    assert acquire(device, "a:1") == Queued(2)  # re-joining keeps the place
    assert device_lock_state(device).queue == ["a:urgent", "a:1", "a:2"]

    served = []
    grant = device_lock_release(device, holder="a:0", fence=holder.fence)
    while grant is not None:
        served.append(grant.holder)
        assert grant.fence > holder.fence
        holder, grant = grant, device_lock_release(device, holder=grant.holder, fence=grant.fence)
    assert served == ["a:urgent", "a:1", "a:2"]
    assert device_lock_state(device).holder is None


def test_release_with_a_stale_fence_changes_nothing(device):
    grant = acquire(device, "a:1")
    acquire(device, "a:2")
    assert device_lock_release(device, holder="a:1", fence=grant.fence - 1) is None
    assert device_lock_release(device, holder="a:9", fence=grant.fence) is None
    state = device_lock_state(device)
    assert (state.holder, state.fence, state.queue) == ("a:1", grant.fence, ["a:2"])


def test_force_release_hands_on_regardless_of_holder(device):
    acquire(device, "a:1")
    acquire(device, "a:2")
    grant = device_lock_release(device, holder="", fence=0, force=True)
    assert grant.holder == "a:2"


def test_dequeue_leaves_the_queue(device):
    acquire(device, "a:1")
    acquire(device, "a:2")
    assert device_lock_dequeue(device, holder="a:2") is True
    assert device_lock_dequeue(device, holder="a:2") is False
    assert device_lock_state(device).queue == []


def test_expired_lease_is_listed_once_and_extend_needs_the_current_fence(device):
    grant = acquire(device, "a:1", lease=0.05)
    assert device_lock_extend(device, holder="a:1", fence=grant.fence + 1, lease_seconds=LEASE) is False
    time.sleep(0.1)
    expired = dict(device_lock_expired(limit=100_000, claim_seconds=30))
    assert expired[device] == grant
    assert device not in dict(device_lock_expired(limit=100_000, claim_seconds=30))
    assert device_lock_extend(device, holder="a:1", fence=grant.fence, lease_seconds=LEASE) is True


def test_no_grant_without_epoch_and_restore_keeps_fences_increasing(device):
    # given Redis lost its data (no epoch, no fence counter)
    lock_redis_connection().delete(*lock_epoch_keys())
    assert isinstance(acquire(device, "a:1"), NotReady)

    # when the lock is rebuilt from the database's view: a holder at fence 41
    device_lock_restore(device, holder="a:0", fence=41, floor=41, lease_seconds=LEASE)
    lock_epoch_start()

    # then the holder keeps the device and the next grant gets a higher fence
    assert isinstance(acquire(device, "a:1"), Queued)
    grant = device_lock_release(device, holder="a:0", fence=41)
    assert grant == Grant("a:1", 42)


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
