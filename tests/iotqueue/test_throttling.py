"""The API's rate limits hold under concurrency: one atomic count per key in Redis."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from iotqueue.redis_conn import redis_connection
from iotqueue.throttling import TokenObtainThrottle, WriteRateThrottle

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

RATE = 50
THREADS = 8
REQUESTS_PER_THREAD = 25  # 200 in all, four times the rate


def burst(send) -> list[int]:
    """Status codes of THREADS x REQUESTS_PER_THREAD calls of `send()`, the threads released
    together so that their requests overlap."""
    start = threading.Barrier(THREADS)

    def one_thread() -> list[int]:
        start.wait()
        return [send() for _ in range(REQUESTS_PER_THREAD)]

    with ThreadPoolExecutor(THREADS) as pool:
        return [code for codes in pool.map(lambda _: one_thread(), range(THREADS)) for code in codes]


def test_concurrent_writes_are_allowed_exactly_the_rate(monkeypatch):
    # given a write rate of 50 a minute, and one user writing from 8 threads at once
    monkeypatch.setattr(WriteRateThrottle, "THROTTLE_RATES", {"write": f"{RATE}/min"})
    user = User.objects.create_superuser("writer", "w@example.com", "pw")

    def write() -> int:
        client = APIClient()
        client.force_authenticate(user)
        # an invalid body: the throttle counts it, the view refuses it without a write
        return client.post("/api/groups/", {}, format="json").status_code

    # when 200 writes arrive together
    codes = burst(write)

    # then exactly the rate got through, and every other one was throttled
    assert codes.count(429) == THREADS * REQUESTS_PER_THREAD - RATE
    assert len([code for code in codes if code != 429]) == RATE


def test_concurrent_token_requests_are_allowed_exactly_the_rate(monkeypatch):
    # given a token rate of 50 a minute, and one address guessing from 8 threads at once
    monkeypatch.setattr(TokenObtainThrottle, "THROTTLE_RATES", {"token": f"{RATE}/min"})

    def guess() -> int:
        return APIClient().post("/api/token/", {"username": "nobody", "password": "guess"}).status_code

    # when 200 guesses arrive together
    codes = burst(guess)

    # then exactly the rate were answered, the rest refused
    assert codes.count(400) == RATE
    assert codes.count(429) == THREADS * REQUESTS_PER_THREAD - RATE


def test_a_throttled_client_is_told_when_its_window_ends(monkeypatch):
    monkeypatch.setattr(WriteRateThrottle, "THROTTLE_RATES", {"write": "1/min"})
    client = APIClient()
    client.force_authenticate(User.objects.create_superuser("writer", "w@example.com", "pw"))

    assert client.post("/api/groups/", {}, format="json").status_code == 400
    refused = client.post("/api/groups/", {}, format="json")

    assert refused.status_code == 429
    assert 0 < int(refused.headers["Retry-After"]) <= 60
    # one key, under the project's prefix, expiring with the window
    (key,) = redis_connection().scan_iter(f"{settings.IOTQUEUE_REDIS_KEY_PREFIX}:*:throttle_write_*")
    assert 0 < redis_connection().ttl(key) <= 60
