"""/metrics: families counted in Redis by every process, served to staff or a bearer token."""

from __future__ import annotations

import json
import logging
import logging.config

import pytest
from django.conf import settings as django_settings
from django.contrib.auth.models import User
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from devices.locks import device_lock_acquire, device_lock_dequeue, device_lock_release
from devtools.simulator import DeviceBehaviour
from iotqueue import metrics
from iotqueue.metrics import HISTOGRAM, Family, MetricsBatch, _histogram_metric, family_declare
from iotqueue.redis_conn import redis_connection
from jobs.events import event_record
from jobs.models import JobRun, RunStatus, StepRun, StepStatus
from jobs.services import run_start
from tests.conftest import wait_for
from tests.factories import DeviceFactory, JobStepFactory, JobTemplateFactory, template_with_steps
from tests.mqtt_device import mqtt_client

TOKEN = "scrape-token-for-tests"
FAMILIES = {
    "iotqueue_runs_started": "counter",
    "iotqueue_runs": "counter",
    "iotqueue_steps": "counter",
    "iotqueue_step_retries": "counter",
    "iotqueue_step_duration_seconds": "histogram",
    "iotqueue_lock_wait_seconds": "histogram",
    "iotqueue_bridge_messages": "counter",
    "iotqueue_monitor_actions": "counter",
    "iotqueue_device_queue_depth": "gauge",
}

Samples = dict[tuple[str, frozenset], float]


def scrape(client: Client) -> tuple[dict[str, str], Samples]:
    """GET /metrics with the bearer token; ({family: type}, {(sample, labels): value})."""
    response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain; version=0.0.4")
    families = list(text_string_to_metric_families(response.content.decode()))
    samples = {(s.name, frozenset(s.labels.items())): s.value for f in families for s in f.samples}
    return {f.name: f.type for f in families}, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def run_finished(run_id) -> JobRun | None:
    run = JobRun.objects.get(pk=run_id)
    return run if run.is_terminal else None


# --- the endpoint's access rules -------------------------------------------------------


@pytest.mark.django_db
def test_metrics_need_staff_or_the_bearer_token(settings):
    # given a configured scrape token, a staff user and an ordinary user
    settings.IOTQUEUE_METRICS_TOKEN = TOKEN
    staff = Client()
    staff.force_login(User.objects.create_user("ops", is_staff=True))
    ordinary = Client()
    ordinary.force_login(User.objects.create_user("viewer"))

    # then anonymous and wrong tokens get 401, a non-staff user 403, the rest the metrics
    anonymous = Client().get("/metrics")
    assert anonymous.status_code == 401
    assert anonymous["WWW-Authenticate"].startswith("Bearer")
    assert Client().get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    assert Client().get("/metrics", HTTP_AUTHORIZATION=f"Token {TOKEN}").status_code == 401
    assert ordinary.get("/metrics").status_code == 403
    assert staff.get("/metrics").status_code == 200
    assert Client().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 200
    assert Client().post("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 405


@pytest.mark.django_db
def test_without_a_token_no_bearer_gets_in(settings):
    # given no token configured (the default)
    settings.IOTQUEUE_METRICS_TOKEN = ""

    # then an empty bearer does not match the empty token
    assert Client().get("/metrics", HTTP_AUTHORIZATION="Bearer ").status_code == 401
    assert Client().get("/metrics", HTTP_AUTHORIZATION="Bearer").status_code == 401


# --- what the families say after real runs -------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(120)
def test_metrics_count_runs_steps_replies_and_queues(stack, simulator, services, settings):
    settings.IOTQUEUE_METRICS_TOKEN = TOKEN
    client = Client()
    _, before = scrape(client)

    # given a healthy device and one whose "break" action always fails (retryable, 2 attempts)
    good, bad = DeviceFactory(), DeviceFactory()
    sim = simulator({good.name: DeviceBehaviour(), bad.name: DeviceBehaviour(failing_actions={"break"})})
    healthy = template_with_steps((good, "on", {}))
    failing = JobTemplateFactory()
    JobStepFactory(template=failing, position=0, device=good, action="a")
    JobStepFactory(
        template=failing, position=1, device=bad, action="break", max_attempts=2, backoff_seconds=0.1
    )

    # when one run succeeds and one fails after a retry
    ok_run, _ = run_start(template=healthy)
    failed_run, _ = run_start(template=failing)
    assert wait_for(lambda: run_finished(ok_run.pk), what="healthy run").status == RunStatus.SUCCEEDED
    assert wait_for(lambda: run_finished(failed_run.pk), what="failing run").status == RunStatus.FAILED

    # and a malformed reply and a duplicate (stale) done arrive from the device
    command_id = StepRun.objects.get(run=ok_run).command_id
    publisher = mqtt_client(services.mqtt_url)
    try:
        topic = f"{services.namespace}/{good.name}/done"
        publisher.publish(topic, b"\xff not json", qos=1).wait_for_publish(5)
        publisher.publish(topic, json.dumps({"id": command_id, "ok": True}), qos=1).wait_for_publish(5)
    finally:
        publisher.loop_stop()
        publisher.disconnect()

    # and a device has one holder working and two waiting for its lock
    busy = DeviceFactory().name
    working = device_lock_acquire(busy, holder="test:0", priority=5, lease_seconds=60)
    for n in (1, 2):
        device_lock_acquire(busy, holder=f"test:{n}", priority=5, lease_seconds=60)
    try:
        # then /metrics shows every family with what happened, once the bridge has flushed
        def settled() -> tuple[dict[str, str], Samples] | None:
            types, after = scrape(client)
            stale = delta(before, after, "iotqueue_bridge_messages_total", kind="stale")
            accepted = delta(before, after, "iotqueue_bridge_messages_total", kind="accepted")
            # The bridge counts what it drops itself, in its own next flush.
            malformed = delta(before, after, "iotqueue_bridge_messages_total", kind="malformed")
            return (types, after) if stale >= 1 and accepted >= 5 and malformed >= 1 else None

        types, after = wait_for(settled, what="stale, accepted and malformed replies on /metrics")
        assert {name: types.get(name) for name in FAMILIES} == FAMILIES

        def d(name: str, **labels: str) -> float:
            return delta(before, after, name, **labels)

        assert d("iotqueue_runs_started_total") == 2
        assert d("iotqueue_runs_total", outcome="succeeded") == 1
        assert d("iotqueue_runs_total", outcome="failed") == 1
        assert d("iotqueue_steps_total", outcome="succeeded") == 2
        assert d("iotqueue_steps_total", outcome="failed") == 1
        assert d("iotqueue_step_retries_total") == 1
        assert d("iotqueue_step_duration_seconds_count", outcome="succeeded") == 2
        assert d("iotqueue_step_duration_seconds_count", outcome="retrying") == 1
        assert d("iotqueue_step_duration_seconds_count", outcome="failed") == 1
        assert d("iotqueue_step_duration_seconds_sum", outcome="succeeded") > 0
        assert d("iotqueue_lock_wait_seconds_count") == 4  # one per dispatched attempt
        assert d("iotqueue_lock_wait_seconds_bucket", le="+Inf") == 4
        assert d("iotqueue_bridge_messages_total", kind="malformed") == 1
        assert d("iotqueue_bridge_messages_total", kind="stale") == 1
        # each of the 4 commands' done, the duplicate done, plus acks/progress the devices sent
        assert d("iotqueue_bridge_messages_total", kind="accepted") >= 5
        assert d("iotqueue_monitor_actions_total", action="tick") >= 1
        assert value(after, "iotqueue_device_queue_depth", device=busy) == 2
        assert ("iotqueue_device_queue_depth", frozenset({"device": good.name}.items())) not in after
        assert sim.stats()["totals"]["overlaps"] == 0
    finally:
        for n in (1, 2):
            device_lock_dequeue(busy, holder=f"test:{n}")
        device_lock_release(busy, holder="test:0", fence=working.fence)


# --- storage and failure modes ----------------------------------------------------------


@pytest.fixture
def declare(monkeypatch):
    """declare(family): a family counted by this test only (gone from /metrics after it)."""
    monkeypatch.setattr(metrics, "_registry", dict(metrics._registry))
    return family_declare


def test_histogram_buckets_are_cumulative_with_sum_and_count(declare):
    # given a histogram observed below, between and above its buckets
    family = declare(Family("iotqueue_test_histogram_seconds", "test only", HISTOGRAM, buckets=(0.05, 0.1)))
    redis_connection().delete(family.key)
    MetricsBatch().observe(family, 0.03).observe(family, 0.07).observe(family, 0.1).observe(
        family, 9.0
    ).send()

    # when it is read back as Prometheus sees it
    metric = _histogram_metric(family, redis_connection().hgetall(family.key))

    # then each bucket counts everything at or below its bound
    samples = {(s.name, s.labels.get("le")): s.value for s in metric.samples}
    assert samples[("iotqueue_test_histogram_seconds_bucket", "0.05")] == 1
    assert samples[("iotqueue_test_histogram_seconds_bucket", "0.1")] == 3
    assert samples[("iotqueue_test_histogram_seconds_bucket", "+Inf")] == 4
    assert samples[("iotqueue_test_histogram_seconds_count", None)] == 4
    assert samples[("iotqueue_test_histogram_seconds_sum", None)] == pytest.approx(9.2)


@pytest.mark.django_db
def test_redis_down_loses_the_count_not_the_step(settings, caplog, declare):
    # given Redis unreachable
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    settings.IOTQUEUE_METRICS_TOKEN = TOKEN
    redis_connection.cache_clear()
    try:
        # then recording logs and goes on, and a scrape fails honestly
        family = declare(Family("iotqueue_test_total", "test only", "counter"))
        with caplog.at_level(logging.WARNING, logger="iotqueue.metrics"):
            MetricsBatch().count(family).send()
        assert "not recorded" in caplog.text
        response = Client().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
        assert response.status_code == 503
    finally:
        redis_connection.cache_clear()


# --- structured logs --------------------------------------------------------------------


@pytest.mark.django_db
def test_json_log_line_carries_run_step_device_and_command(caplog):
    # given a step run that has been dispatched
    device = DeviceFactory()
    template = template_with_steps((device, "on", {}))
    run = JobRun.objects.create(template=template, plan=[{"device": device.name, "action": "on"}])
    step_run = StepRun.objects.create(
        run=run,
        index=0,
        device=device,
        action="on",
        status=StepStatus.DISPATCHED,
        attempt=1,
        command_id="7-1-abc",
    )

    # when its transition is recorded, and the line formatted as IOTQUEUE_LOG_FORMAT=json does
    with caplog.at_level(logging.INFO, logger="jobs.timeline"):
        event_record("step.in_progress", step_run=step_run, message="ack received")
    configurator = logging.config.DictConfigurator(django_settings.LOGGING)
    formatter = configurator.configure_formatter(dict(django_settings.LOGGING["formatters"]["json"]))
    (record,) = [r for r in caplog.records if r.name == "jobs.timeline"]
    line = formatter.format(record)

    # then it is one JSON object with the fields a log search filters on
    assert "\n" not in line
    fields = json.loads(line)
    assert fields["event"] == "step.in_progress"
    assert fields["run_id"] == str(run.pk)
    assert fields["step"] == 0
    assert fields["attempt"] == 1
    assert fields["device"] == device.name
    assert fields["command_id"] == "7-1-abc"
    assert fields["levelname"] == "INFO" and "timestamp" in fields
    # and the text format says the same in the message
    assert f"run={run.pk} step=0 device={device.name} command=7-1-abc ack received" in record.getMessage()
