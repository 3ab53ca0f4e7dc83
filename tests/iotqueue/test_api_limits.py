"""Rate limits on the API (DRF throttles counted in Redis) and the admin's login lockout."""

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.test import Client
from rest_framework.test import APIClient

from iotqueue.redis_conn import redis_connection

pytestmark = pytest.mark.django_db


def token_request(client: APIClient, username: str, password: str) -> int:
    return client.post("/api/token/", {"username": username, "password": password}).status_code


def test_guessing_at_the_token_endpoint_gets_429():
    # given a real account, and a client trying one password per username (no lockout applies)
    User.objects.create_user("operator", password="s3cret-pass")
    client = APIClient()
    limit = int(settings.REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"]["token"].split("/")[0])

    # when it sends more requests in a minute than the token rate allows
    answers = [token_request(client, f"user-{n}", "guess") for n in range(limit + 2)]

    # then the ones over the rate are 429, even the right password, with a Retry-After
    assert answers == [400] * limit + [429] * 2
    refused = client.post("/api/token/", {"username": "operator", "password": "s3cret-pass"})
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) > 0


def test_the_throttle_counts_in_the_sessions_redis_under_its_prefix():
    APIClient().post("/api/token/", {"username": "nobody", "password": "x"})

    keys = list(redis_connection().scan_iter(f"{settings.IOTQUEUE_REDIS_KEY_PREFIX}:*:throttle_token_*"))

    assert len(keys) == 1
    assert redis_connection().get(keys[0]) == "1"


def test_writes_are_throttled_per_user_and_reads_are_not(admin_api, monkeypatch):
    # given a write rate of 2 a minute (the default is far above what any test writes)
    from iotqueue.throttling import WriteRateThrottle

    monkeypatch.setattr(WriteRateThrottle, "THROTTLE_RATES", {"write": "2/min"})

    answers = [admin_api.post("/api/groups/", {"name": f"g{n}"}, format="json").status_code for n in range(3)]

    assert answers == [201, 201, 429]
    assert [admin_api.get("/api/groups/").status_code for _ in range(3)] == [200] * 3


def test_admin_login_is_locked_after_the_failure_limit():
    # given a staff user and someone guessing its password
    User.objects.create_superuser("boss", "b@example.com", "right-pass")
    browser = Client()
    form = {"username": "boss", "password": "wrong", "next": "/admin/"}
    failures = [browser.post("/admin/login/", form).status_code for _ in range(settings.AXES_FAILURE_LIMIT)]

    # then each guess is refused, and after the limit even the right password is 429
    assert failures[:-1] == [200] * (settings.AXES_FAILURE_LIMIT - 1)
    assert failures[-1] == 429
    locked = browser.post("/admin/login/", {**form, "password": "right-pass"})
    assert locked.status_code == 429
    assert "_auth_user_id" not in browser.session

    # and another user is not locked out by it
    User.objects.create_superuser("other", "o@example.com", "pw-other")
    assert browser.post("/admin/login/", {"username": "other", "password": "pw-other"}).status_code == 302


def test_the_token_endpoint_counts_towards_the_lockout_and_still_issues_tokens():
    User.objects.create_user("operator", password="s3cret-pass")
    client = APIClient()

    assert token_request(client, "operator", "s3cret-pass") == 200
    answers = [token_request(client, "operator", "wrong") for _ in range(settings.AXES_FAILURE_LIMIT)]

    # DRF answers a locked-out login as any failed one (400): the right password no longer works
    assert answers == [400] * settings.AXES_FAILURE_LIMIT
    assert token_request(client, "operator", "s3cret-pass") == 400
