"""The admin login's lockout also holds against password spraying: one address trying a few
passwords on many usernames is locked out at IOTQUEUE_LOGIN_ADDRESS_FAILURE_LIMIT."""

from __future__ import annotations

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.core.management import call_command
from django.test import Client
from rest_framework.test import APIClient

pytestmark = pytest.mark.django_db

ATTACKER = "203.0.113.7"
COLLEAGUE = "198.51.100.20"
USERNAMES = 15


def admin_login(browser: Client, username: str, password: str, address: str) -> int:
    form = {"username": username, "password": password, "next": "/admin/"}
    return browser.post("/admin/login/", form, REMOTE_ADDR=address).status_code


def test_one_address_spraying_many_usernames_is_locked_out():
    # given a staff user, and an address guessing one password on each of 15 usernames
    User.objects.create_superuser("boss", "b@example.com", "right-pass")
    browser = Client()
    limit = settings.IOTQUEUE_LOGIN_ADDRESS_FAILURE_LIMIT
    assert limit < USERNAMES and settings.AXES_FAILURE_LIMIT > 1

    # when it sprays
    answers = [admin_login(browser, f"user-{n}", "Winter2026!", ATTACKER) for n in range(USERNAMES)]

    # then the guesses up to the address's limit are plain failures, and every one after is 429
    assert answers == [200] * limit + [429] * (USERNAMES - limit)
    # and from that address even the right password of a real user is refused
    assert admin_login(browser, "boss", "right-pass", ATTACKER) == 429
    assert "_auth_user_id" not in browser.session
    # and the token endpoint refuses it too (DRF answers a refused login with 400)
    credentials = {"username": "boss", "password": "right-pass"}
    token = APIClient().post("/api/token/", credentials, REMOTE_ADDR=ATTACKER)
    assert token.status_code == 400

    # but another address is not locked out by it
    assert admin_login(Client(), "boss", "right-pass", COLLEAGUE) == 302


def test_axes_reset_ip_lifts_the_address_lockout():
    User.objects.create_superuser("boss", "b@example.com", "right-pass")
    browser = Client()
    for n in range(settings.IOTQUEUE_LOGIN_ADDRESS_FAILURE_LIMIT):
        admin_login(browser, f"user-{n}", "guess", ATTACKER)
    assert admin_login(browser, "boss", "right-pass", ATTACKER) == 429

    call_command("axes_reset_ip", ATTACKER)

    assert admin_login(browser, "boss", "right-pass", ATTACKER) == 302
