"""Issue 31, webhook findings: secrets never shown back (7), no requests to internal
addresses (9: SSRF, refused at save and re-checked and pinned at delivery), and deliveries
that cannot be replayed (10) — against a real HTTP receiver and the real database."""

from __future__ import annotations

import socket

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client
from rest_framework.test import APIClient

from tests.webhooks.receiver import Receiver
from webhooks import delivery, signing
from webhooks.models import Delivery, DeliveryState, Webhook

SECRET = "a-test-secret-of-some-length"
GOOD = {"name": "ops", "url": "https://example.com/hook", "events": ["run.failed"], "secret": SECRET}


def user_with(username: str, *codenames: str, staff: bool = False) -> User:
    user = User.objects.create_user(username, password="pw-for-tests-only", is_staff=staff)
    permissions = Permission.objects.filter(content_type__app_label="webhooks", codename__in=codenames)
    user.user_permissions.add(*permissions)
    return user


def api_as(user: User) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


def admin_as(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


def webhook_stored(**fields) -> Webhook:
    values = {"name": "ops", "url": "https://example.com/hook", "events": ["run.failed"]}
    return Webhook.objects.create(**{**values, **fields, "secret": signing.secret_normalize(SECRET)})


# --- finding 9: SSRF ---------------------------------------------------------------------

INTERNAL_URLS = [
    "http://169.254.169.254/latest/meta-data/",
    "http://10.0.0.5/hook",
    "http://192.168.1.10/hook",
    "http://172.16.0.1/hook",
    "http://127.0.0.1:6379/",
    "http://localhost/hook",
    "http://[::1]/hook",
    "http://0.0.0.0/hook",
    "http://[::]/hook",
    "http://metadata.google.internal/computeMetadata/v1/",
    "http://[::ffff:127.0.0.1]/hook",
    "http://[fe80::1]/hook",
    "http://224.0.0.1/hook",
    "http://2130706433/hook",
]


@pytest.mark.django_db
@pytest.mark.parametrize("url", INTERNAL_URLS)
def test_the_api_refuses_a_webhook_to_an_internal_address_with_a_400_naming_url(admin_api, settings, url):
    settings.IOTQUEUE_WEBHOOK_ALLOWED_NETWORKS = []
    response = admin_api.post("/api/webhooks/", {**GOOD, "url": url}, format="json")
    assert response.status_code == 400, response.content
    assert "url" in response.json() and not Webhook.objects.exists()
    # nor may a change point an existing webhook there
    webhook = webhook_stored()
    changed = admin_api.patch(f"/api/webhooks/{webhook.pk}/", {"url": url}, format="json")
    assert changed.status_code == 400 and "url" in changed.json()


@pytest.mark.django_db
def test_the_allow_list_admits_its_networks_only(admin_api, settings):
    settings.IOTQUEUE_WEBHOOK_ALLOWED_NETWORKS = ["127.0.0.0/8"]
    allowed = admin_api.post("/api/webhooks/", {**GOOD, "url": "http://127.0.0.1:8080/hook"}, format="json")
    assert allowed.status_code == 201, allowed.content
    refused = admin_api.post(
        "/api/webhooks/", {**GOOD, "name": "meta", "url": "http://169.254.169.254/"}, format="json"
    )
    assert refused.status_code == 400 and "url" in refused.json()


@pytest.mark.django_db
def test_the_admin_form_refuses_an_internal_address(admin_client, settings):
    settings.IOTQUEUE_WEBHOOK_ALLOWED_NETWORKS = []
    form = {"name": "ops", "url": "http://169.254.169.254/latest/", "events": ["run.failed"], "enabled": "on"}
    response = admin_client.post("/admin/webhooks/webhook/add/", form)
    assert response.status_code == 200 and not Webhook.objects.exists()
    assert b"169.254.169.254 is link-local" in response.content


@pytest.mark.django_db(transaction=True)
def test_without_the_allow_list_a_delivery_to_loopback_is_refused_and_no_request_made(receiver, settings):
    # given a webhook to the local receiver, stored when 127.0.0.0/8 was allowed
    webhook = webhook_stored(url=receiver.url)
    sent = Delivery.objects.create(webhook=webhook, kind="run.failed", payload={"kind": "run.failed"})
    # when the allow-list no longer has it and an attempt is made
    settings.IOTQUEUE_WEBHOOK_ALLOWED_NETWORKS = []
    assert delivery.delivery_attempt(delivery_id=sent.pk, attempt=1) is None  # no retry: it cannot change
    # then the receiver got nothing, and the log says why
    sent.refresh_from_db()
    assert receiver.requests == []
    assert (sent.state, sent.attempts, sent.status_code) == (DeliveryState.FAILED, 1, None)
    assert "refused, no request made" in sent.last_error and "127.0.0.1 is loopback" in sent.last_error


@pytest.fixture
def resolver(monkeypatch):
    """Names resolved as the test says (a DNS server an attacker controls): each lookup of
    a name takes the next address from its list; numeric hosts resolve as usual."""
    real = socket.getaddrinfo
    answers: dict[str, list[str]] = {}
    lookups: list[str] = []

    def getaddrinfo(host, port, *args, **kwargs):
        if host in answers:
            lookups.append(host)
            address = answers[host].pop(0) if len(answers[host]) > 1 else answers[host][0]
            return real(address, port, *args, **kwargs)
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return answers, lookups


@pytest.mark.django_db(transaction=True)
def test_a_name_that_resolves_to_an_internal_address_at_delivery_is_refused(receiver, settings, resolver):
    # given a name that did not resolve when the webhook was saved (accepted then)
    answers, _ = resolver
    settings.IOTQUEUE_WEBHOOK_ALLOWED_NETWORKS = []
    port = receiver.server.server_address[1]
    response = api_as(user_with("ops", "add_webhook")).post(
        "/api/webhooks/", {**GOOD, "url": f"http://hooks.rebind.test:{port}/hook"}, format="json"
    )
    assert response.status_code == 201, response.content
    webhook = Webhook.objects.get()
    # when, at delivery, it resolves to loopback (DNS rebinding)
    answers["hooks.rebind.test"] = ["127.0.0.1"]
    sent = Delivery.objects.create(webhook=webhook, kind="run.failed", payload={})
    delivery.delivery_attempt(delivery_id=sent.pk, attempt=1)
    # then no request reached the receiver and the delivery failed, saying why
    sent.refresh_from_db()
    assert receiver.requests == [] and sent.state == DeliveryState.FAILED
    assert "127.0.0.1 is loopback" in sent.last_error


@pytest.mark.django_db(transaction=True)
def test_the_attempt_connects_to_the_address_it_checked_not_to_a_second_lookup(settings, resolver):
    # given a receiver on 127.0.0.1 (allowed) and a name whose next lookup says 127.0.0.2
    # (nothing listens there; not allowed)
    settings.IOTQUEUE_WEBHOOK_ALLOWED_NETWORKS = ["127.0.0.1/32"]
    receiver = Receiver(status=204).start()
    try:
        answers, lookups = resolver
        answers["pinned.rebind.test"] = ["127.0.0.1", "127.0.0.2"]
        port = receiver.server.server_address[1]
        webhook = webhook_stored(url=f"http://pinned.rebind.test:{port}/hook?a=1")
        sent = Delivery.objects.create(webhook=webhook, kind="run.failed", payload={})
        # when one attempt is made
        delivery.delivery_attempt(delivery_id=sent.pk, attempt=1)
        # then it looked the name up once and delivered to the checked address, by name
        sent.refresh_from_db()
        assert (sent.state, sent.status_code) == (DeliveryState.DELIVERED, 204), sent.last_error
        assert lookups == ["pinned.rebind.test"]
        assert receiver.requests[0].headers["Host"] == f"pinned.rebind.test:{port}"
    finally:
        receiver.stop()


# --- finding 7: secrets are write-only ------------------------------------------------------


@pytest.mark.django_db
def test_view_only_staff_see_that_a_secret_is_set_never_the_secret_nor_a_rotate_action():
    webhook = webhook_stored()
    viewer = admin_as(user_with("viewer", "view_webhook", staff=True))
    page = viewer.get(f"/admin/webhooks/webhook/{webhook.pk}/change/")
    assert page.status_code == 200
    assert webhook.secret.encode() not in page.content and SECRET.encode() not in page.content
    assert b'<div class="readonly">set</div>' in page.content and b"rotate-secret" not in page.content
    listing = viewer.get("/admin/webhooks/webhook/")
    assert listing.status_code == 200 and webhook.secret.encode() not in listing.content
    # and the rotate view refuses them, changing nothing
    before = webhook.secret
    assert viewer.post(f"/admin/webhooks/webhook/{webhook.pk}/rotate-secret/").status_code == 403
    webhook.refresh_from_db()
    assert webhook.secret == before


@pytest.mark.django_db
def test_a_user_who_may_change_webhooks_rotates_the_secret_in_the_admin_and_sees_it_once():
    webhook = webhook_stored()
    editor = admin_as(user_with("editor", "view_webhook", "change_webhook", staff=True))
    page = editor.get(f"/admin/webhooks/webhook/{webhook.pk}/change/")
    assert b"rotate-secret" in page.content and webhook.secret.encode() not in page.content
    assert editor.get(f"/admin/webhooks/webhook/{webhook.pk}/rotate-secret/").status_code == 200  # asks
    rotated = editor.post(f"/admin/webhooks/webhook/{webhook.pk}/rotate-secret/")
    webhook.refresh_from_db()
    assert rotated.status_code == 200 and webhook.secret.startswith("whsec_")
    assert webhook.secret.encode() in rotated.content and "no-store" in rotated["Cache-Control"]
    # shown once: the change page does not show it again
    assert webhook.secret.encode() not in editor.get(f"/admin/webhooks/webhook/{webhook.pk}/change/").content


@pytest.mark.django_db
def test_the_admin_keeps_a_secret_left_empty_and_shows_a_generated_one_once_on_add(admin_client):
    form = {"name": "ops", "url": "https://example.com/hook", "events": ["run.failed"], "enabled": "on"}
    added = admin_client.post("/admin/webhooks/webhook/add/", form)
    webhook = Webhook.objects.get()
    assert added.status_code == 200 and webhook.secret.encode() in added.content
    kept = webhook.secret
    admin_client.post(f"/admin/webhooks/webhook/{webhook.pk}/change/", {**form, "new_secret": ""})
    webhook.refresh_from_db()
    assert webhook.secret == kept
    admin_client.post(f"/admin/webhooks/webhook/{webhook.pk}/change/", {**form, "new_secret": SECRET})
    webhook.refresh_from_db()
    assert signing.secret_key(webhook.secret) == SECRET.encode()


@pytest.mark.django_db
def test_the_api_says_set_and_rotates_a_secret_only_for_users_who_may_change_webhooks():
    webhook = webhook_stored()
    before = webhook.secret
    reader = api_as(user_with("reader", "view_webhook"))
    shown = reader.get(f"/api/webhooks/{webhook.pk}/").json()
    assert shown["secret_status"] == "set" and "secret" not in shown
    adder = api_as(user_with("adder", "view_webhook", "add_webhook"))
    for client in (reader, adder):
        assert client.post(f"/api/webhooks/{webhook.pk}/rotate-secret/").status_code == 403
    webhook.refresh_from_db()
    assert webhook.secret == before
    editor = api_as(user_with("editor", "view_webhook", "change_webhook"))
    rotated = editor.post(f"/api/webhooks/{webhook.pk}/rotate-secret/")
    assert rotated.status_code == 200 and "no-store" in rotated["Cache-Control"]
    webhook.refresh_from_db()
    assert rotated.json() == {"secret": webhook.secret} and webhook.secret != before
    assert len(signing.secret_key(webhook.secret)) == signing.SECRET_KEY_BYTES
    assert "secret" not in editor.get(f"/api/webhooks/{webhook.pk}/").json()


@pytest.mark.django_db
def test_a_webhook_created_without_a_secret_gets_one_shown_in_the_answer_only(admin_api):
    without = {key: value for key, value in GOOD.items() if key != "secret"}
    created = admin_api.post("/api/webhooks/", without, format="json")
    assert created.status_code == 201, created.content
    webhook = Webhook.objects.get()
    assert created.json()["secret"] == webhook.secret and webhook.secret.startswith("whsec_")
    assert "secret" not in admin_api.get(f"/api/webhooks/{webhook.pk}/").json()
