"""Run events out on the real stack: signed webhook deliveries, retries and auto-disable,
and the lifecycle events on MQTT (worker, bridge, broker and simulated devices)."""

from __future__ import annotations

import itertools
import json
import threading
import time

import pytest
from django.conf import settings
from standardwebhooks import Webhook as StandardWebhook
from standardwebhooks import WebhookVerificationError

from devtools.simulator import DeviceBehaviour
from jobs.models import JobRun, RunEvent, RunStatus
from jobs.services import run_start
from tests.conftest import wait_for
from tests.factories import DeviceFactory, template_with_steps
from tests.mqtt_device import mqtt_client
from webhooks import signing
from webhooks.models import Delivery, DeliveryState, Webhook

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(90)]

SECRET = signing.secret_generate()


class DocumentedReceiver:
    """What docs/orchestration.md tells a receiver to do: verify with the standardwebhooks
    package (signature over id, timestamp and body; timestamp within five minutes either
    way), then drop a webhook-id already handled."""

    KEEP_SECONDS = 600

    def __init__(self, secret: str) -> None:
        self.webhook = StandardWebhook(secret)
        self.seen: dict[str, float] = {}

    def accept(self, headers: dict[str, str], body: bytes) -> dict | None:
        """The event, or None for a repeat; raises WebhookVerificationError for a forgery,
        a stale or a future delivery."""
        event = self.webhook.verify(body, headers)
        now = time.time()
        self.seen = {msg_id: at for msg_id, at in self.seen.items() if now - at <= self.KEEP_SECONDS}
        msg_id = {name.lower(): value for name, value in headers.items()}["webhook-id"]
        if msg_id in self.seen:
            return None
        self.seen[msg_id] = now
        return event


def verified(secret: str, headers: dict[str, str], body: bytes) -> dict:
    try:
        return StandardWebhook(secret).verify(body, headers)
    except WebhookVerificationError as exc:
        raise AssertionError(f"a forged delivery: {exc}") from exc


def run_ended(run: JobRun) -> JobRun | None:
    run.refresh_from_db()
    return run if run.is_terminal else None


def test_a_receiver_gets_signed_deliveries_for_a_run_that_succeeds_and_one_that_fails(
    stack, simulator, receiver
):
    # given a webhook for run ends and step failures, and a healthy and a broken device
    good, bad = DeviceFactory(), DeviceFactory()
    simulator({good.name: DeviceBehaviour(), bad.name: DeviceBehaviour(failure_rate=1.0)})
    Webhook.objects.create(
        name="ops", url=receiver.url, events=["run.succeeded", "run.failed", "step.failed"], secret=SECRET
    )
    ok_template, bad_template = template_with_steps((good, "a", {})), template_with_steps((bad, "b", {}))

    # when one run succeeds and one fails
    ok_run, _ = run_start(template=ok_template)
    bad_run, _ = run_start(template=bad_template)
    assert wait_for(lambda: run_ended(ok_run), what="the good run").status == RunStatus.SUCCEEDED
    assert wait_for(lambda: run_ended(bad_run), what="the bad run").status == RunStatus.FAILED

    # then the receiver got one signed delivery per event, each verifying with the secret
    wait_for(lambda: len(receiver.requests) >= 3, what="three deliveries")
    payloads = {
        (p["kind"], p["run"]): p for p in (verified(SECRET, r.headers, r.body) for r in receiver.requests)
    }
    assert set(payloads) == {
        ("run.succeeded", str(ok_run.pk)),
        ("step.failed", str(bad_run.pk)),
        ("run.failed", str(bad_run.pk)),
    }
    succeeded, failed = payloads["run.succeeded", str(ok_run.pk)], payloads["run.failed", str(bad_run.pk)]
    assert succeeded["template"] == ok_template.name and succeeded["status"] == "succeeded"
    assert succeeded["error"] == "" and succeeded["step"] is None
    assert failed["status"] == "failed" and "simulated failure" in failed["error"]
    assert payloads["step.failed", str(bad_run.pk)]["step"] == {"index": 0, "device": bad.name}
    assert {r.headers["X-Iotqueue-Event"] for r in receiver.requests} == {
        "run.succeeded",
        "run.failed",
        "step.failed",
    }
    # and the delivery log says each went through at the first attempt
    wait_for(
        lambda: not Delivery.objects.exclude(state=DeliveryState.DELIVERED).exists(), what="deliveries logged"
    )
    log = list(Delivery.objects.all())
    assert len(log) == 3
    assert {(d.status_code, d.attempts) for d in log} == {(200, 1)}
    assert all(d.latency_ms is not None for d in log)
    # a body changed in transit no longer verifies
    first = receiver.requests[0]
    with pytest.raises(AssertionError, match="forged"):
        verified(SECRET, first.headers, first.body.replace(b"run", b"nur", 1))


def test_a_recorded_delivery_cannot_be_replayed_nor_passed_off_under_another_id(stack, simulator, receiver):
    # given a delivery the worker made to a receiver that does what the docs say
    device = DeviceFactory()
    simulator({device.name: DeviceBehaviour()})
    template = template_with_steps((device, "a", {}))
    Webhook.objects.create(name="ops", url=receiver.url, events=["run.succeeded"], secret=SECRET)
    run, _ = run_start(template=template)
    wait_for(lambda: run_ended(run), what="the run")
    wait_for(lambda: receiver.requests, what="the delivery")
    documented = DocumentedReceiver(SECRET)
    recorded = receiver.requests[0]
    assert documented.accept(recorded.headers, recorded.body)["run"] == str(run.pk)
    # when an attacker sends it again: a repeat, dropped
    assert documented.accept(recorded.headers, recorded.body) is None
    # under a rewritten id (the old X-Iotqueue-Delivery could be rewritten): forged
    with pytest.raises(WebhookVerificationError):
        documented.accept({**recorded.headers, "webhook-id": "msg_999999"}, recorded.body)
    # with a timestamp moved into the future or the past: forged
    for moved in (int(time.time()) + 290, int(time.time()) - 290):
        with pytest.raises(WebhookVerificationError):
            documented.accept({**recorded.headers, "webhook-timestamp": str(moved)}, recorded.body)
    # and a genuine delivery signed more than five minutes off, either way, is refused too
    for offset in (-301, 301):
        genuine = signing.headers_sign(SECRET, delivery_id=1, body=recorded.body, now=time.time() + offset)
        with pytest.raises(WebhookVerificationError, match=r"too (old|new)"):
            documented.accept(genuine, recorded.body)


def test_a_failing_receiver_is_retried_with_backoff_then_disabled(stack, simulator, receiver):
    # given a receiver that answers 500 to everything (stack: 3 attempts, 0.2 s backoff
    # doubling, disabled after 2 deliveries failed for good)
    receiver.status = 500
    device = DeviceFactory()
    simulator({device.name: DeviceBehaviour()})
    template = template_with_steps((device, "a", {}))
    webhook = Webhook.objects.create(
        name="broken",
        url=receiver.url,
        events=["run.started", "run.succeeded"],
        template=template,
        secret=SECRET,
    )

    # when a run of its template starts and ends (two events, two deliveries)
    run, _ = run_start(template=template)
    wait_for(lambda: run_ended(run), what="the run")

    # then each delivery was tried 3 times, and the webhook was disabled with an event
    disabled = wait_for(
        lambda: RunEvent.objects.filter(kind="webhook.disabled").first(), what="the webhook disabled event"
    )
    assert disabled.run_id is None and webhook.name in disabled.message
    webhook.refresh_from_db()
    assert not webhook.enabled and "2 deliveries in a row failed" in webhook.disabled_reason
    log = list(Delivery.objects.filter(webhook=webhook))
    assert {(d.kind, d.state, d.attempts, d.status_code) for d in log} == {
        ("run.started", DeliveryState.FAILED, 3, 500),
        ("run.succeeded", DeliveryState.FAILED, 3, 500),
    }
    assert len(receiver.requests) == 6
    for kind in ("run.started", "run.succeeded"):
        times = [r.at for r in receiver.requests if r.headers["X-Iotqueue-Event"] == kind]
        gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
        # 0.2 s then 0.4 s: each wait at least its backoff, the second longer than the first
        assert gaps[0] >= 0.2 and gaps[1] >= 0.4, gaps


def test_the_run_end_is_published_on_mqtt(stack, simulator, services):
    # given the service user subscribed to every run's events
    received: list[tuple[str, dict]] = []
    client = mqtt_client(services.mqtt_url)
    client.on_message = lambda c, u, message: received.append((message.topic, json.loads(message.payload)))
    subscribed = threading.Event()
    client.on_subscribe = lambda *args: subscribed.set()
    prefix = settings.IOTQUEUE_TOPIC_PREFIX
    client.subscribe(f"{prefix}/events/runs/#", qos=1)
    wait_for(subscribed.is_set, what="the SUBACK")
    device = DeviceFactory()
    simulator({device.name: DeviceBehaviour()})
    template = template_with_steps((device, "a", {}))
    try:
        # when a run succeeds
        run, _ = run_start(template=template)
        topic = f"{prefix}/events/runs/{run.pk}"

        # then its start and end arrived on its topic (each event is its own message; the
        # order of two events of one run is not guaranteed, their `time` is)
        wait_for(
            lambda: sorted(p["kind"] for t, p in received if t == topic) == ["run.started", "run.succeeded"],
            what="run.started and run.succeeded on MQTT",
        )
    finally:
        client.loop_stop()
        client.disconnect()
    end = next(p for t, p in received if t == topic and p["kind"] == "run.succeeded")
    assert end["run"] == str(run.pk) and end["template"] == template.name
    assert end["status"] == "succeeded" and end["time"] and end["error"] == ""
