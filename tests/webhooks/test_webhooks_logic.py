"""Run events out, module by module without the stack: signing, the API, payloads, one
delivery attempt against a local receiver, the failed-run mail and the device ACLs."""

from __future__ import annotations

import io

import pytest
from django.core import mail

from devices.credentials import device_acls
from iotqueue.topics import filters_overlap
from jobs.models import JobRun
from tests.factories import DeviceFactory, template_with_steps
from webhooks import delivery, outbox, signing
from webhooks.mail import failed_run_mail_send
from webhooks.models import Delivery, DeliveryState, Webhook

SECRET = "a-test-secret-of-some-length"


@pytest.mark.django_db
def test_the_api_creates_a_webhook_and_never_shows_its_secret(admin_api):
    template = template_with_steps()
    response = admin_api.post(
        "/api/webhooks/",
        {
            "name": "ops",
            "url": "https://example.com/hook",
            "events": ["run.failed"],
            "template": template.name,
            "secret": SECRET,
        },
        format="json",
    )
    assert response.status_code == 201, response.content
    body = response.json()
    assert "secret" not in body and body["template"] == template.name and body["enabled"] is True
    assert body["secret_status"] == "set"
    # stored in the Standard Webhooks form, the text's bytes as the key
    assert signing.secret_key(Webhook.objects.get(name="ops").secret) == SECRET.encode()
    listed = admin_api.get("/api/webhooks/").json()["results"]
    assert [w["name"] for w in listed] == ["ops"] and "secret" not in listed[0]


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("url", "ftp://example.com/hook"),
        ("url", "file:///etc/passwd"),
        ("url", "not a url"),
        ("events", []),
        ("events", ["run.exploded"]),
        ("events", ["run.failed", "run.failed"]),
        ("events", "run.failed"),
        ("secret", "short"),
        ("template", "no-such-template"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(admin_api, field, value):
    good = {"name": "ops", "url": "https://example.com/hook", "events": ["run.failed"], "secret": SECRET}
    response = admin_api.post("/api/webhooks/", {**good, field: value}, format="json")
    assert response.status_code == 400, response.content
    assert field in response.json()


@pytest.mark.django_db
def test_a_reader_sees_webhooks_and_deliveries_but_may_not_create_one(reader_api):
    webhook = Webhook.objects.create(
        name="ops", url="https://example.com/h", events=["run.failed"], secret=SECRET
    )
    Delivery.objects.create(webhook=webhook, kind="run.failed", payload={"kind": "run.failed"})
    assert reader_api.post("/api/webhooks/", {"name": "x"}, format="json").status_code == 403
    deliveries = reader_api.get(f"/api/webhooks/{webhook.pk}/deliveries/")
    assert deliveries.status_code == 200
    assert [d["kind"] for d in deliveries.json()["results"]] == ["run.failed"]
    assert reader_api.get("/api/webhooks/999999/deliveries/").status_code == 404


@pytest.mark.django_db
def test_the_payload_says_what_happened_to_which_run():
    template = template_with_steps()
    run = JobRun.objects.create(template=template)
    item = {
        "kind": "step.failed",
        "run": str(run.pk),
        "time": "t",
        "message": "no done",
        "step": 2,
        "device": "d1",
    }
    assert outbox.event_payload(item, run) == {
        "kind": "step.failed",
        "run": str(run.pk),
        "template": template.name,
        "status": "failed",
        "time": "t",
        "error": "no done",
        "step": {"index": 2, "device": "d1"},
    }
    started = outbox.event_payload({**item, "kind": "run.started", "message": "3 steps"}, run)
    assert started["status"] == "running" and started["error"] == "" and started["step"] is None


@pytest.mark.django_db(transaction=True)
def test_one_attempt_is_signed_logged_and_retried_with_a_doubling_backoff(receiver, settings):
    settings.IOTQUEUE_WEBHOOK_BACKOFF_SECONDS, settings.IOTQUEUE_WEBHOOK_MAX_ATTEMPTS = 1.0, 3
    secret = signing.secret_normalize(SECRET)
    webhook = Webhook.objects.create(name="ops", url=receiver.url, events=["run.failed"], secret=secret)
    sent = Delivery.objects.create(webhook=webhook, kind="run.failed", payload={"kind": "run.failed"})

    # a 500 is retried after 1 s, then 2 s; the third failure is the last
    receiver.status = 500
    assert delivery.delivery_attempt(delivery_id=sent.pk, attempt=1) == 1.0
    assert delivery.delivery_attempt(delivery_id=sent.pk, attempt=1) is None  # a redelivered task
    assert delivery.delivery_attempt(delivery_id=sent.pk, attempt=2) == 2.0
    # the receiver recovers: delivered, and the webhook's failures are forgotten
    receiver.status = 204
    assert delivery.delivery_attempt(delivery_id=sent.pk, attempt=3) is None
    sent.refresh_from_db()
    assert (sent.state, sent.attempts, sent.status_code) == (DeliveryState.DELIVERED, 3, 204)
    request = receiver.requests[-1]
    assert signing.delivery_verify(secret, headers=request.headers, body=request.body)
    # every attempt carries the same webhook-id, each signed anew
    assert {r.headers["webhook-id"] for r in receiver.requests} == {f"msg_{sent.pk}"}
    # the deprecated headers still come, for one release
    assert request.headers["X-Iotqueue-Delivery"] == str(sent.pk)
    key = signing.secret_key(secret)
    timestamp = request.headers["X-Iotqueue-Timestamp"]
    assert request.headers["X-Iotqueue-Signature"] == signing.signature_legacy(key, timestamp, request.body)


@pytest.mark.django_db
def test_an_unreachable_receiver_is_an_error_not_an_exception(settings):
    settings.IOTQUEUE_WEBHOOK_MAX_ATTEMPTS = 1
    webhook = Webhook.objects.create(
        name="ops", url="http://127.0.0.1:9/x", events=["run.failed"], secret=SECRET
    )
    sent = Delivery.objects.create(webhook=webhook, kind="run.failed", payload={})
    assert delivery.delivery_attempt(delivery_id=sent.pk, attempt=1) is None
    sent.refresh_from_db()
    assert sent.state == DeliveryState.FAILED and sent.status_code is None and sent.last_error
    webhook.refresh_from_db()
    assert webhook.consecutive_failures == 1 and webhook.enabled


def test_the_failed_run_mail_goes_to_the_admins(settings):
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"
    settings.ADMINS = ["ops@example.com"]
    failed_run_mail_send(
        event={"run": "0123456789", "template": "flash", "status": "failed", "time": "t", "error": "boom"}
    )
    assert len(mail.outbox) == 1
    assert "flash" in mail.outbox[0].subject and "boom" in mail.outbox[0].body
    assert mail.outbox[0].to == ["ops@example.com"]


@pytest.mark.django_db
def test_no_device_may_subscribe_to_run_events(settings):
    device = DeviceFactory(name="events")  # even one named like the topic level
    events = outbox.events_topic("some-run")
    subscribable = [acl["topic"] for acl in device_acls(device) if acl["acltype"] == "subscribePattern"]
    assert subscribable and not any(filters_overlap(topic, events) for topic in subscribable)


@pytest.mark.django_db
def test_the_admin_lists_webhooks_and_a_read_only_delivery_log(admin_client):
    webhook = Webhook.objects.create(
        name="ops", url="https://example.com/h", events=["run.failed"], secret=SECRET
    )
    sent = Delivery.objects.create(
        webhook=webhook, kind="run.failed", payload={}, status_code=500, latency_ms=12, attempts=3
    )
    assert admin_client.get("/admin/webhooks/webhook/").status_code == 200
    assert admin_client.get(f"/admin/webhooks/webhook/{webhook.pk}/change/").status_code == 200
    log = admin_client.get(f"/admin/webhooks/delivery/?webhook__id__exact={webhook.pk}")
    assert log.status_code == 200 and b"500" in log.content
    assert admin_client.get("/admin/webhooks/delivery/add/").status_code == 403
    detail = admin_client.get(f"/admin/webhooks/delivery/{sent.pk}/change/")
    assert detail.status_code == 200 and b'name="_save"' not in detail.content


@pytest.mark.django_db
def test_the_dev_stack_points_the_demo_webhook_at_its_own_receiver(settings):
    from django.core.management import call_command

    from devtools.devstack import _webhook_receiver_start

    settings.IOTQUEUE_WEBHOOK_MAX_ATTEMPTS, settings.DEBUG = 1, True  # the demo is DEBUG only
    call_command("webhook_demo", url="http://127.0.0.1:1/old", stdout=io.StringIO())
    call_command("webhook_demo", url=_webhook_receiver_start(), stdout=io.StringIO())
    (webhook,) = Webhook.objects.all()
    sent = Delivery.objects.create(webhook=webhook, kind="run.failed", payload={})
    delivery.delivery_attempt(delivery_id=sent.pk, attempt=1)
    sent.refresh_from_db()
    assert (sent.state, sent.status_code) == (DeliveryState.DELIVERED, 204)
