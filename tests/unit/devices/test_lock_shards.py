"""How the lock space is sharded (devices/locks.py): stable shards, one hash tag per shard,
claims shared fairly among shards. The scripts themselves run in the stack tier."""

from __future__ import annotations

import zlib

import pytest

from devices.locks import _keys, fair_shares, lock_shard, shard_key, shard_tag


def hash_tag(key: str) -> str:
    """What a Redis Cluster hashes: the first {...} of a key."""
    return key[key.index("{") + 1 : key.index("}", key.index("{"))]


def test_a_device_has_a_stable_shard_and_all_its_keys_carry_that_shard_s_one_tag(settings):
    settings.IOTQUEUE_REDIS_KEY_PREFIX, settings.IOTQUEUE_LOCK_SHARDS = "iq", 16
    shard = lock_shard("lamp-2")
    assert shard == zlib.crc32(b"lamp-2") % 16
    keys = _keys("lamp-2")
    assert keys["lock"] == f"iq:lock:{{iq:{shard}/16}}:lamp-2"
    assert {hash_tag(key) for key in keys.values()} == {f"iq:{shard}/16"}
    assert hash_tag(shard_key("deadlines", shard)) == f"iq:{shard}/16"


def test_a_device_name_with_braces_does_not_change_the_tag(settings):
    settings.IOTQUEUE_LOCK_SHARDS = 16
    keys = _keys("odd{name}")
    assert {hash_tag(key) for key in keys.values()} == {hash_tag(shard_tag(lock_shard("odd{name}")))}


def test_the_shard_count_is_part_of_the_tag(settings):
    # a new count names new keys: their missing epochs make the locks be rebuilt
    settings.IOTQUEUE_LOCK_SHARDS = 16
    sixteen = shard_tag(3)
    settings.IOTQUEUE_LOCK_SHARDS = 32
    assert shard_tag(3) != sixteen


@pytest.mark.parametrize(
    ("counts", "limit", "shares"),
    [
        ([0, 0, 0], 500, [0, 0, 0]),
        ([3, 0, 7], 500, [3, 0, 7]),  # everything fits
        ([1000, 0, 0], 500, [500, 0, 0]),  # one busy shard gets the whole limit
        ([10, 400, 400], 500, [10, 245, 245]),  # the rest shared evenly
        ([5, 5, 5], 4, [1, 1, 2]),
    ],
)
def test_a_claim_limit_is_shared_max_min_fair(counts, limit, shares):
    assert fair_shares(counts, limit) == shares
    assert sum(fair_shares(counts, limit)) == min(limit, sum(counts))
