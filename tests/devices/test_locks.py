"""The device lock against a real Redis: grant, fence, FIFO hand-off, priority, leases, epoch."""

import time
import uuid

import pytest

from devices.locks import (
    Grant,
    NotReady,
    Queued,
    device_lock_acquire,
    device_lock_dequeue,
    device_lock_expired,
    device_lock_extend,
    device_lock_release,
    device_lock_restore,
    device_lock_state,
    lock_epoch_start,
)
from iotqueue.redis_conn import redis_connection, redis_key

LEASE = 30.0


@pytest.fixture(autouse=True)
def epoch(settings):
    # Keys of their own: the session's monitor (beat) would otherwise reclaim the leases
    # these tests let expire, racing the assertions.
    settings.IOTQUEUE_REDIS_KEY_PREFIX = f"locktest-{uuid.uuid4().hex[:8]}"
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
    redis_connection().delete(redis_key("lock-epoch"))
    assert isinstance(acquire(device, "a:1"), NotReady)

    # when the lock is rebuilt from the database's view: a holder at fence 41
    device_lock_restore(device, holder="a:0", fence=41, floor=41, lease_seconds=LEASE)
    lock_epoch_start()

    # then the holder keeps the device and the next grant gets a higher fence
    assert isinstance(acquire(device, "a:1"), Queued)
    grant = device_lock_release(device, holder="a:0", fence=41)
    assert grant == Grant("a:1", 42)
