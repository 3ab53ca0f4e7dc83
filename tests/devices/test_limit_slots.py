"""Shared concurrency limits on the device lock (devices/lua/transition.lua, "slots"), case
by case, on the session's real Redis: a command a limit applies to takes its device's lock
and one slot of its (limit, label value) together, or waits for the slot with its device
left free; freed slots are handed on by priority, then arrival, and go with the lock's
release, including the release that reclaims an expired lease."""

import pytest

from devices.lock_slots import Slot, slot_states
from devices.locks import (
    Grant,
    LockBatch,
    Queued,
    device_lock_acquire,
    device_lock_dequeue,
    device_lock_expired,
    device_lock_preempt,
    device_lock_state,
    device_locks_apply,
)
from tests.conftest import wait_for

# Slots live on a single Redis only (on a cluster they are not applied).
single_redis = pytest.mark.parametrize("lock_space", ["redis"], indirect=True)

LEASE = 30.0
SITE = Slot("site-downloads", "store-17", 2)


def take(device, holder, *, priority=5, lease=LEASE, slots=(SITE,)):
    batch = LockBatch()
    batch.acquire(device, holder=holder, priority=priority, lease_seconds=lease, slots=slots)
    return device_locks_apply(batch)[0]


def release(device, grant, *, force=False):
    """A release; returns (its own device's next grant, the other grants its slots made)."""
    batch = LockBatch()
    batch.release(device, holder=grant.holder, fence=grant.fence, force=force)
    return device_locks_apply(batch)[0], batch.handed


def state():
    return slot_states([(SITE.limit, SITE.value)])[(SITE.limit, SITE.value)]


@single_redis
def test_n_are_granted_and_the_next_waits_with_its_device_left_free(lock_space, device):
    grants = [take(f"{device}-{i}", f"step:{i}") for i in range(2)]
    assert all(isinstance(g, Grant) for g in grants)
    third = take(f"{device}-2", "step:2")
    assert third == Queued(1) and third.slot == "site-downloads=store-17"
    assert state().holders == ["step:0", "step:1"] and state().waiting == ["step:2"]
    # Its device is not held: a command no limit applies to takes it at once.
    assert device_lock_state(f"{device}-2").holder is None
    other = device_lock_acquire(f"{device}-2", holder="step:9", priority=5, lease_seconds=LEASE)
    assert isinstance(other, Grant)
    # Asking again keeps the place, and says it was waiting already.
    assert take(f"{device}-2", "step:2") == Queued(1, waiting=True)
    assert state().waiting == ["step:2"]


@single_redis
def test_a_freed_slot_goes_by_priority_then_arrival_and_hands_the_device_on(lock_space, device):
    first = take(f"{device}-0", "step:0")
    second = take(f"{device}-1", "step:1")
    assert isinstance(take(f"{device}-2", "step:2"), Queued)
    assert isinstance(take(f"{device}-3", "step:3"), Queued)
    assert isinstance(take(f"{device}-4", "step:4", priority=9), Queued)
    assert state().waiting == ["step:4", "step:2", "step:3"]

    own, handed = release(f"{device}-0", first)
    assert own is None
    assert [(d, g.holder) for d, g in handed] == [(f"{device}-4", "step:4")]
    assert device_lock_state(f"{device}-4").holder == "step:4"
    assert device_lock_state(f"{device}-4").fence == handed[0][1].fence
    assert state().holders == ["step:1", "step:4"]

    _, handed = release(f"{device}-1", second)
    assert [(d, g.holder) for d, g in handed] == [(f"{device}-2", "step:2")]
    _, handed = release(f"{device}-4", Grant("step:4", device_lock_state(f"{device}-4").fence))
    assert [(d, g.holder) for d, g in handed] == [(f"{device}-3", "step:3")]
    assert state().waiting == [] and sorted(state().holders) == ["step:2", "step:3"]


@single_redis
def test_a_busy_device_queues_its_command_and_its_release_respects_the_limit(lock_space, device):
    # One device, two commands with slots: the second waits in the device's queue.
    a = take(device, "step:a")
    assert isinstance(a, Grant)
    assert take(device, "step:b") == Queued(1)
    assert isinstance(take(f"{device}-x", "step:x"), Grant)
    # The slots are full now (a and x): releasing a frees a slot, b takes it with the device.
    own, handed = release(device, a)
    assert own is not None and own.holder == "step:b" and handed == []
    assert sorted(state().holders) == ["step:b", "step:x"]


@single_redis
def test_a_device_handed_on_while_the_slots_are_full_skips_to_a_command_without_limit(lock_space, device):
    first = take(f"{device}-0", "step:0")
    take(f"{device}-1", "step:1")
    c = device_lock_acquire(device, holder="step:c", priority=5, lease_seconds=LEASE)
    assert isinstance(c, Grant)
    assert take(device, "step:d") == Queued(1)  # behind c on the device
    device_lock_acquire(device, holder="step:e", priority=5, lease_seconds=LEASE)  # no limit
    # c ends: d is next on the device but the slots are full: it waits for a slot, e runs.
    own, handed = release(device, c)
    assert own.holder == "step:e" and handed == []
    assert state().waiting == ["step:d"]
    # A slot frees while e holds the device: d goes back to the device's queue.
    _, handed = release(f"{device}-0", first)
    assert handed == []
    assert device_lock_state(device).queue == ["step:d"]
    own, handed = release(device, Grant("step:e", own.fence))
    assert own.holder == "step:d"
    assert "step:d" in state().holders


@single_redis
def test_a_waiting_command_that_leaves_frees_its_place(lock_space, device):
    first = take(f"{device}-0", "step:0")
    take(f"{device}-1", "step:1")
    take(f"{device}-2", "step:2")
    take(f"{device}-3", "step:3")
    assert device_lock_dequeue(f"{device}-2", holder="step:2")
    assert state().waiting == ["step:3"]
    _, handed = release(f"{device}-0", first)
    assert [g.holder for _, g in handed] == ["step:3"]


@single_redis
def test_a_reclaimed_lease_frees_the_slot_for_the_next_waiter(lock_space, device):
    take(f"{device}-0", "step:0", lease=0.2)
    take(f"{device}-1", "step:1")
    assert isinstance(take(f"{device}-2", "step:2"), Queued)
    claims = []

    def expired() -> bool:
        claims.extend(c for c in device_lock_expired(limit=10, claim_seconds=30) if c[0] == f"{device}-0")
        return bool(claims)

    wait_for(expired, timeout=10, what="the lease to run out")
    # The monitor passes a reclaimed lock on: its slot goes with it.
    _, grant = claims[0]
    _, handed = release(f"{device}-0", grant)
    assert [(d, g.holder) for d, g in handed] == [(f"{device}-2", "step:2")]
    assert sorted(state().holders) == ["step:1", "step:2"]


@single_redis
def test_a_force_release_frees_the_holders_slot(lock_space, device):
    take(f"{device}-0", "step:0")
    take(f"{device}-1", "step:1")
    take(f"{device}-2", "step:2")
    _, handed = release(f"{device}-0", Grant("operator", 0), force=True)
    assert [g.holder for _, g in handed] == ["step:2"]


@single_redis
def test_slots_of_other_label_values_do_not_count(lock_space, device):
    take(f"{device}-0", "step:0")
    take(f"{device}-1", "step:1")
    other = Slot(SITE.limit, "store-18", 2)
    assert isinstance(take(f"{device}-2", "step:2", slots=(other,)), Grant)


@single_redis
def test_a_command_under_two_limits_needs_a_slot_of_each(lock_space, device):
    gateway = Slot("one-per-gateway", "gw-1", 1)
    first = take(f"{device}-0", "step:0", slots=(SITE, gateway))
    assert isinstance(first, Grant)
    # The site has room, the gateway does not: it waits for the gateway's slot.
    waiting = take(f"{device}-1", "step:1", slots=(SITE, gateway))
    assert isinstance(waiting, Queued) and waiting.slot == "one-per-gateway=gw-1"
    assert state().holders == ["step:0"]
    _, handed = release(f"{device}-0", first)
    assert [(d, g.holder) for d, g in handed] == [(f"{device}-1", "step:1")]
    assert state().holders == ["step:1"]


@pytest.mark.parametrize("lock_space", ["cluster"], indirect=True)
def test_on_a_redis_cluster_slots_are_not_applied(lock_space, device):
    # Slots live outside the device shards' hash slots: a cluster grants by the lock alone.
    grants = [take(f"{device}-{i}", f"step:{i}", slots=(Slot("site", "s", 1),)) for i in range(2)]
    assert all(isinstance(g, Grant) for g in grants)


@single_redis
def test_a_command_holding_a_limit_s_slot_is_not_preempted(lock_space, device):
    # given a command holding its device and a slot of the site's limit
    held = take(device, "step:low", priority=3)

    # when an urgent command asks to displace it
    urgent = device_lock_preempt(
        device,
        holder="step:urgent",
        priority=9,
        lease_seconds=LEASE,
        displace="step:low",
        displace_fence=held.fence,
        displace_priority=3,
    )

    # then it queues as an acquire does: the holder keeps its device and its slot
    assert urgent == Queued(1)
    assert device_lock_state(device).holder == "step:low"
    assert state().holders == ["step:low"]
