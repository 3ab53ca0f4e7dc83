"""/metrics state gauges: runs, steps, the fleet, stuck runs, the inbox, the beat lease and
webhooks as they stand at scrape time (jobs/gauges.py, webhooks/metrics.py); a gauge whose
dependency is away is left out and said so, never failing the scrape."""

from __future__ import annotations

import logging

import pytest
import redis
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families
from redis.backoff import NoBackoff
from redis.retry import Retry

from jobs import gauges
from jobs.models import StepRun, StepStatus
from jobs.services import run_start
from tests.conftest import wait_for
from tests.factories import DeviceFactory, template_with_steps
from tests.mqtt_device import mqtt_client
from webhooks.models import Webhook

TOKEN = "scrape-token-for-gauge-tests"

Samples = dict[tuple[str, frozenset], float]


def scrape(client: Client) -> Samples:
    response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 200, response.content
    families = text_string_to_metric_families(response.content.decode())
    return {(s.name, frozenset(s.labels.items())): s.value for f in families for s in f.samples}


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


@pytest.mark.django_db(transaction=True)
def test_a_run_blocked_on_an_offline_device_shows_as_running_stuck_and_offline(stack, settings):
    # given every wait counted as stuck, and the gauges before the run
    settings.IOTQUEUE_METRICS_TOKEN = TOKEN
    settings.IOTQUEUE_STUCK_AFTER_SECONDS = 0
    client = Client()
    before = scrape(client)

    # when a run's only step is queued on a device that is offline
    device = DeviceFactory(online=False)
    run, _ = run_start(template=template_with_steps((device, "unlock", {})))
    wait_for(
        lambda: StepRun.objects.filter(run=run, status=StepStatus.QUEUED).exists(),
        what="the step queued on the offline device",
    )
    after = scrape(client)

    # then one more run is running and stuck, one more step queued, one more device offline
    def grew(name: str, **labels: str) -> float:
        return (value(after, name, **labels) or 0) - (value(before, name, **labels) or 0)

    assert grew("iotqueue_runs_active", status="running") == 1
    assert grew("iotqueue_runs_stuck") == 1
    assert grew("iotqueue_steps_at_work", status="queued") == 1
    assert grew("iotqueue_devices", state="offline") == 1
    assert grew("iotqueue_devices", state="total") == 1
    # and every gauge was read, the inbox and the beat lease included
    for name in ("iotqueue_inbox_entries", "iotqueue_inbox_oldest_age_seconds", "iotqueue_beat_lease_held"):
        assert value(after, name) is not None, name
        assert value(after, "iotqueue_gauge_read_errors", gauge=name) == 0, name


def bridge_ages(samples: Samples) -> dict[str, float]:
    name = "iotqueue_bridge_last_message_age_seconds"
    return {dict(labels)["bridge"]: v for (sample, labels), v in samples.items() if sample == name}


@pytest.mark.django_db(transaction=True)
def test_the_bridge_reports_when_it_last_heard_a_message(stack, services, settings):
    settings.IOTQUEUE_METRICS_TOKEN = TOKEN
    client = Client()
    # given a device's heartbeat published to the broker
    device = DeviceFactory()
    publisher = mqtt_client(services.mqtt_url)
    try:
        publisher.publish(f"{services.namespace}/{device.name}/heartbeat", b"{}", qos=1).wait_for_publish(5)
    finally:
        publisher.loop_stop()
        publisher.disconnect()

    # then the bridge's heartbeat notes it, and /metrics shows a bridge that heard it moments ago
    ages = wait_for(
        lambda: {b: age for b, age in bridge_ages(scrape(client)).items() if age < 10},
        what="a bridge that heard the heartbeat",
    )
    assert ages
    assert (
        value(scrape(client), "iotqueue_gauge_read_errors", gauge="iotqueue_bridge_last_message_age_seconds")
        == 0
    )


@pytest.mark.django_db(transaction=True)
def test_a_webhook_disabled_by_its_failures_is_counted_one_switched_off_is_not(stack, settings):
    settings.IOTQUEUE_METRICS_TOKEN = TOKEN
    client = Client()
    before = value(scrape(client), "iotqueue_webhooks_disabled")
    # given one webhook the delivery disabled and one an admin switched off
    Webhook.objects.create(
        name="failing", url="https://example.com/a", enabled=False, disabled_reason="HTTP 500"
    )
    Webhook.objects.create(name="paused", url="https://example.com/b", enabled=False)
    # then one more is counted
    assert value(scrape(client), "iotqueue_webhooks_disabled") == before + 1


@pytest.mark.django_db(transaction=True)
def test_gauges_whose_redis_is_away_are_left_out_and_the_scrape_still_answers(
    stack, settings, monkeypatch, caplog
):
    # given the gauges' Redis unreachable (the counters' store still answers)
    settings.IOTQUEUE_METRICS_TOKEN = TOKEN
    # Refused at once and not retried: redis-py's default retries back off for about 4 s per
    # call, which would only make each of the four gauges slower to fail the same way.
    away = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    monkeypatch.setattr(gauges, "redis_connection", lambda: away)

    # when /metrics is scraped
    with caplog.at_level(logging.WARNING, logger="iotqueue.metrics"):
        samples = scrape(Client())

    # then the inbox, bridge and beat lease gauges are left out and said so, the rest are there
    assert bridge_ages(samples) == {}
    for name in (
        "iotqueue_inbox_entries",
        "iotqueue_inbox_oldest_age_seconds",
        "iotqueue_bridge_last_message_age_seconds",
        "iotqueue_beat_lease_held",
    ):
        assert value(samples, name) is None, name
        assert value(samples, "iotqueue_gauge_read_errors", gauge=name) == 1, name
    assert value(samples, "iotqueue_gauge_read_errors", gauge="iotqueue_runs_stuck") == 0
    assert value(samples, "iotqueue_runs_stuck") is not None
    assert value(samples, "iotqueue_runs_started_total") is not None
    assert "iotqueue_inbox_entries left out" in caplog.text
