"""The lock tests' Redis: each test runs twice, on the session's Redis and on a 3-node Redis
Cluster (the `redis_cluster` fixture), with a key prefix of its own."""

import uuid

import pytest

from devices.locks import lock_epoch_start


@pytest.fixture(params=["redis", "cluster"])
def lock_space(request, settings) -> str:
    """Lock keys of the test's own (the session's monitor would otherwise reclaim the leases
    these tests let expire, racing the assertions), on a single Redis or a cluster, with
    the epoch set (the lock state is complete). Returns "redis" or "cluster"."""
    settings.IOTQUEUE_REDIS_KEY_PREFIX = f"locktest-{uuid.uuid4().hex[:8]}"
    if request.param == "cluster":
        settings.LOCK_REDIS_URL = request.getfixturevalue("redis_cluster")
    lock_epoch_start()
    return request.param


@pytest.fixture
def device() -> str:
    return f"lockdev-{uuid.uuid4().hex[:8]}"
