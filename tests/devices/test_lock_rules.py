"""The device lock's rules, case by case, against devices/lua/transition.lua.

Every lock change goes through that one script: the single operations used here
(`device_lock_acquire`, `_release`, `_extend`, `_expired`, `_restore`) are batches of one,
and `locks_rebuild` restores in batches. Each case runs on the session's Redis and on a
real 3-node Redis Cluster (`lock_space` in conftest.py), where every call must stay in one
hash slot. The batch shapes (many shards in one call, writes that depend on outcomes) are in
test_locks.py.
"""

import time

import pytest
from django.conf import settings

from devices import lock_recovery
from devices.locks import (
    Grant,
    NotReady,
    Preempted,
    Queued,
    device_lock_acquire,
    device_lock_dequeue,
    device_lock_expired,
    device_lock_extend,
    device_lock_preempt,
    device_lock_release,
    device_lock_restore,
    device_lock_state,
    lock_epoch_exists,
    lock_epoch_keys,
    lock_epoch_start,
    lock_shard,
)
from iotqueue.redis_conn import lock_redis_connection
from tests.conftest import wait_for

pytestmark = pytest.mark.usefixtures("lock_space")

LEASE = 30.0


def acquire(device, holder, priority=5, lease=LEASE):
    return device_lock_acquire(device, holder=holder, priority=priority, lease_seconds=lease)


def lease_ran_out(device: str) -> bool:
    state = device_lock_state(device)
    return state.lease_until_ms is not None and state.lease_until_ms < time.time() * 1000


def lock_state_lost() -> None:
    """What a Redis restart without persistence does to the lock space: every key gone."""
    conn = lock_redis_connection()
    keys = list(conn.scan_iter(match=f"{settings.IOTQUEUE_REDIS_KEY_PREFIX}:*", count=1000))
    assert keys
    conn.delete(*keys)
    assert not lock_epoch_exists()


def test_a_free_device_is_granted_and_each_grant_has_a_higher_fence(device):
    first = acquire(device, "a:1")
    assert isinstance(first, Grant)
    assert device_lock_release(device, holder="a:1", fence=first.fence) is None
    assert device_lock_state(device).holder is None
    second = acquire(device, "a:2")
    assert second == Grant("a:2", first.fence + 1)


def test_acquiring_again_by_the_holder_is_idempotent_and_says_it_took_nothing(device):
    first = acquire(device, "a:1")
    again = acquire(device, "a:1")
    assert again == first and not first.held
    # a transition undone after it must not give back a lock it did not take
    assert again.held
    assert device_lock_state(device).queue == []


def test_waiters_are_served_by_priority_then_fifo_and_each_hand_off_grows_the_fence(device):
    # given a holder, and waiters of two priorities (one asking twice)
    holder = acquire(device, "a:0")
    assert acquire(device, "a:1") == Queued(1)
    assert acquire(device, "a:2") == Queued(2)
    assert acquire(device, "a:urgent", priority=9) == Queued(1)
    assert acquire(device, "a:low", priority=0) == Queued(4)
    again = acquire(device, "a:1")
    assert again == Queued(2) and again.waiting  # asking again keeps the place, and says so
    assert device_lock_state(device).queue == ["a:urgent", "a:1", "a:2", "a:low"]

    # when each holder releases, then the head of the queue gets the lock with a new fence
    served = []
    grant = device_lock_release(device, holder="a:0", fence=holder.fence)
    while grant is not None:
        served.append(grant.holder)
        assert grant.fence > holder.fence
        state = device_lock_state(device)
        assert (state.holder, state.fence) == (grant.holder, grant.fence)
        holder, grant = grant, device_lock_release(device, holder=grant.holder, fence=grant.fence)
    assert served == ["a:urgent", "a:1", "a:2", "a:low"]
    assert device_lock_state(device).holder is None


def test_a_waiter_that_leaves_the_queue_is_never_handed_the_device(device):
    # given a holder and two waiters
    holder = acquire(device, "a:0")
    acquire(device, "a:1")
    acquire(device, "a:2")

    # when the first waiter leaves (its run was canceled), twice
    assert device_lock_dequeue(device, holder="a:1") is True
    assert device_lock_dequeue(device, holder="a:1") is False

    # then the holder's release hands the device to the other waiter
    assert device_lock_state(device).queue == ["a:2"]
    assert device_lock_release(device, holder="a:0", fence=holder.fence).holder == "a:2"


def test_a_hand_off_gives_the_next_holder_the_lease_asked(device):
    holder = acquire(device, "a:0")
    acquire(device, "a:1")
    before = time.time() * 1000
    device_lock_release(device, holder="a:0", fence=holder.fence, lease_seconds=600)
    assert device_lock_state(device).lease_until_ms >= before + 500_000


def test_a_stale_fence_is_refused_on_release_and_extend_and_changes_nothing(device):
    grant = acquire(device, "a:1")
    acquire(device, "a:2")
    assert device_lock_release(device, holder="a:1", fence=grant.fence - 1) is None
    assert device_lock_release(device, holder="a:9", fence=grant.fence) is None
    assert device_lock_extend(device, holder="a:1", fence=grant.fence + 1, lease_seconds=LEASE) is False
    assert device_lock_extend(device, holder="a:2", fence=grant.fence, lease_seconds=LEASE) is False
    state = device_lock_state(device)
    assert (state.holder, state.fence, state.queue) == ("a:1", grant.fence, ["a:2"])
    assert device_lock_extend(device, holder="a:1", fence=grant.fence, lease_seconds=LEASE) is True


def test_a_force_release_hands_on_whoever_holds_it(device):
    acquire(device, "a:1")
    acquire(device, "a:2")
    grant = device_lock_release(device, holder="", fence=0, force=True)
    assert grant.holder == "a:2"
    assert device_lock_release(device, holder="", fence=0, force=True) is None
    assert device_lock_state(device).holder is None


def test_an_expired_lease_is_reclaimed_once_and_its_holder_s_release_hands_on(device):
    # given a holder whose lease ran out, and a waiter
    grant = acquire(device, "a:1", lease=0.05)
    acquire(device, "a:2")
    wait_for(lambda: lease_ran_out(device), what="the lease to run out")

    # when the monitor claims expired leases twice
    claimed = dict(device_lock_expired(limit=100_000, claim_seconds=30))
    again = dict(device_lock_expired(limit=100_000, claim_seconds=30))

    # then the first claim has it, with its holder's grant, the second not (pushed out)
    assert claimed[device] == grant
    assert device not in again
    # and reclaiming it (the expired holder's release) hands it to the head of the queue
    assert device_lock_release(device, holder="a:1", fence=grant.fence) == Grant("a:2", grant.fence + 1)


def test_a_lease_extended_in_time_is_not_reclaimed(device):
    grant = acquire(device, "a:1", lease=0.05)
    assert device_lock_extend(device, holder="a:1", fence=grant.fence, lease_seconds=LEASE) is True
    assert device not in dict(device_lock_expired(limit=100_000, claim_seconds=30))


def test_nothing_is_granted_while_the_epoch_is_missing(device):
    # given a holder and Redis said to have lost the state (the epoch is gone)
    acquire(device, "a:0")
    lock_redis_connection().delete(*lock_epoch_keys())

    # then an acquire is refused, even on a free device, and nothing is queued
    other = device + "-free"
    assert isinstance(acquire(device, "a:1"), NotReady)
    assert isinstance(acquire(other, "a:1"), NotReady)
    assert device_lock_state(device).queue == []
    assert device_lock_state(other).holder is None
    # until the epoch is back
    lock_epoch_start()
    assert acquire(other, "a:1") == Grant("a:1", 1)


def test_a_restore_after_redis_lost_the_locks_keeps_fences_growing(device):
    # given a device held at fence 41, then Redis lost every lock key
    lock_state_lost()
    assert isinstance(acquire(device, "a:1"), NotReady)

    # when the lock is rebuilt from the database's view: a holder at fence 41
    device_lock_restore(device, holder="a:0", fence=41, floor=41, lease_seconds=LEASE)
    lock_epoch_start()

    # then the holder keeps the device and the next grant gets a higher fence
    assert isinstance(acquire(device, "a:1"), Queued)
    assert device_lock_release(device, holder="a:0", fence=41) == Grant("a:1", 42)
    # and a free device restored with only a floor grants above it
    free = device + "-free"
    device_lock_restore(free, holder=None, fence=7, floor=7, lease_seconds=LEASE)
    assert device_lock_state(free).holder is None
    assert acquire(free, "a:1") == Grant("a:1", 8)


def test_a_restore_does_not_displace_a_holder_nor_lower_the_fence(device):
    grant = acquire(device, "a:1")
    device_lock_restore(device, holder="a:0", fence=grant.fence - 1, floor=0, lease_seconds=LEASE)
    state = device_lock_state(device)
    assert (state.holder, state.fence) == ("a:1", grant.fence)
    device_lock_release(device, holder="a:1", fence=grant.fence)
    assert acquire(device, "a:2") == Grant("a:2", grant.fence + 1)


def test_locks_rebuild_restores_every_source_record_then_grants_resume(monkeypatch):
    # given a source of truth with executing holders on devices over many shards
    records = [
        lock_recovery.LockRecord(f"rebuild-{n}", holder=f"a:{n}" if n % 2 else None, fence=n + 9, floor=n + 9)
        for n in range(40)
    ]
    assert len({lock_shard(record.device) for record in records}) > 1
    resumed = []
    monkeypatch.setattr(lock_recovery, "_rebuild_sources", [lambda: iter(records)])
    monkeypatch.setattr(lock_recovery, "_rebuild_after", [lambda: resumed.append(True)])
    monkeypatch.setattr(lock_recovery, "REBUILD_BATCH", 16)  # more than one lock call
    lock_state_lost()

    # when the locks are rebuilt
    assert lock_recovery.locks_rebuild() is True

    # then each holder has its lock back, every fence grows from its floor, grants resume
    assert lock_epoch_exists() and resumed == [True]
    for record in records:
        if record.holder is not None:
            assert device_lock_state(record.device).holder == record.holder
            assert device_lock_release(record.device, holder=record.holder, fence=record.fence) is None
        assert acquire(record.device, "b:1") == Grant("b:1", record.floor + 1)


# --- urgent preemption -------------------------------------------------------------------


def preempt(device, holder, displace, fence, priority=9, displace_priority=5):
    return device_lock_preempt(
        device,
        holder=holder,
        priority=priority,
        lease_seconds=LEASE,
        displace=displace,
        displace_fence=fence,
        displace_priority=displace_priority,
    )


def test_an_urgent_holder_takes_the_lock_and_the_displaced_one_waits_at_the_head_of_its_band(device):
    # given a holder at priority 5, a waiter of the same priority and one of a higher one,
    # and the urgent holder waiting already
    low = acquire(device, "a:low", priority=5)
    acquire(device, "a:same", priority=5)
    acquire(device, "a:high", priority=7)
    acquire(device, "a:urgent", priority=9)

    # when the urgent holder preempts the low one
    taken = preempt(device, "a:urgent", "a:low", low.fence)

    # then it holds the lock under a higher fence, it left the queue, and the displaced
    # holder waits behind the higher priority and ahead of its own band
    assert isinstance(taken, Preempted) and taken.displaced == "a:low"
    assert (taken.holder, taken.fence) == ("a:urgent", low.fence + 1)
    state = device_lock_state(device)
    assert (state.holder, state.fence) == ("a:urgent", taken.fence)
    assert state.queue == ["a:high", "a:low", "a:same"]
    assert state.lease_until_ms is not None


def test_the_displaced_holder_s_stale_fence_is_refused_and_the_urgent_release_hands_back(device):
    # given a holder displaced by an urgent one
    low = acquire(device, "a:low", priority=3)
    taken = preempt(device, "a:urgent", "a:low", low.fence)

    # when the displaced holder's late release and extend come (its command's late done)
    assert device_lock_release(device, holder="a:low", fence=low.fence) is None
    assert device_lock_extend(device, holder="a:low", fence=low.fence, lease_seconds=LEASE) is False

    # then nothing changed, and the urgent holder's release hands the device back to it
    # under a fence higher than both
    state = device_lock_state(device)
    assert (state.holder, state.fence, state.queue) == ("a:urgent", taken.fence, ["a:low"])
    back = device_lock_release(device, holder="a:urgent", fence=taken.fence)
    assert back == Grant("a:low", taken.fence + 1)


def test_a_preempt_of_a_holder_that_moved_on_is_a_plain_acquire(device):
    # given a holder whose fence the caller read before it released (stale read)
    low = acquire(device, "a:low")
    device_lock_release(device, holder="a:low", fence=low.fence)
    other = acquire(device, "a:other")

    # when the urgent holder asks to displace the old holder: it queues, nobody is displaced
    queued = preempt(device, "a:urgent", "a:low", low.fence)
    assert queued == Queued(1)
    state = device_lock_state(device)
    assert (state.holder, state.fence, state.queue) == ("a:other", other.fence, ["a:urgent"])

    # and on a free device it is granted as an acquire is
    device_lock_release(device, holder="a:other", fence=other.fence)
    device_lock_release(device, holder="a:urgent", fence=other.fence + 1)
    assert preempt(device, "a:urgent2", "a:gone", 1) == Grant("a:urgent2", other.fence + 2)


def test_a_preemption_undone_gives_the_lock_back_under_a_new_fence(device):
    # given an urgent holder that displaced a low one (its transaction then failed)
    low = acquire(device, "a:low", priority=2)
    acquire(device, "a:other", priority=9)
    taken = preempt(device, "a:urgent", "a:low", low.fence, displace_priority=2)

    # when the executor gives the lock back (the reverse preemption)
    back = preempt(device, "a:low", "a:urgent", taken.fence, priority=2, displace_priority=9)

    # then the low holder holds it again under a fence higher than both, so its own old
    # release is stale (the lease ends it), and the urgent holder waits first in its band
    assert (back.holder, back.fence) == ("a:low", taken.fence + 1)
    state = device_lock_state(device)
    assert state.queue == ["a:urgent", "a:other"]
    assert device_lock_release(device, holder="a:low", fence=low.fence) is None
