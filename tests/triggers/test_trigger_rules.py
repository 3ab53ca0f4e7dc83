"""MQTT trigger rules: a sensor's message starts a run through the real bridge and worker."""

import json
import time

import paho.mqtt.client as mqtt
import pytest

from devtools.simulator import DeviceBehaviour
from jobs.models import JobRun, RunEvent, RunStatus, Trigger
from jobs.services import run_start
from tests.conftest import wait_for
from tests.factories import DeviceFactory, JobTemplateFactory, template_with_steps
from tests.mqtt_device import mqtt_client
from triggers.models import TriggerRule
from triggers.rules import trigger_message_handle

# A message published before the bridge has subscribed to a new rule's filter is lost;
# the test publishes again this often until the run appears (the dedupe key makes
# repeats harmless).
REPUBLISH_SECONDS = 0.5


@pytest.fixture
def sensor(services):
    """A door sensor: a plain MQTT client that publishes events."""
    client = mqtt_client(services.mqtt_url)
    yield client
    client.loop_stop()
    client.disconnect()


def publish(client: mqtt.Client, topic: str, body) -> None:
    payload = body if isinstance(body, bytes) else json.dumps(body)
    client.publish(topic, payload, qos=1).wait_for_publish(5)


def run_of_rule(name: str) -> JobRun | None:
    return JobRun.objects.filter(trigger=Trigger.MQTT, triggered_by__startswith=f"mqtt {name} ").first()


def run_finished(run_id) -> JobRun | None:
    run = JobRun.objects.get(pk=run_id)
    return run if run.is_terminal else None


def dropped_count() -> int:
    return RunEvent.objects.filter(kind="message.dropped").count()


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(120)
def test_door_event_starts_a_run_end_to_end(stack, simulator, admin_api, sensor, services):
    # given a camera, a "Door opened" template and a rule created over REST
    # (a door sensor starts a camera snapshot)
    camera = DeviceFactory()
    sim = simulator({camera.name: DeviceBehaviour()})
    template = template_with_steps(
        (camera, "snapshot", {"door": "{{ params.door }}", "badge": "{{ params.badge }}"})
    )
    site = f"{services.namespace}/site/berlin"
    response = admin_api.post(
        "/api/trigger-rules/",
        {
            "name": "door opened",
            "topic_filter": f"{site}/door/+/opened",
            "template": template.name,
            "parameters": {"door": "{{ topic.4 }}", "badge": "{{ message.badge }}", "resolution": "hd"},
            "idempotency_key": "{{ message.event_id }}",
        },
        format="json",
    )
    assert response.status_code == 201, response.content

    # when door 7's sensor reports an opening (again until the bridge has subscribed)
    def event_published_and_run_started():
        publish(sensor, f"{site}/door/7/opened", {"badge": "B-17", "event_id": "ev-1"})
        return run_of_rule("door opened") or time.sleep(REPUBLISH_SECONDS)

    run = wait_for(event_published_and_run_started, what="a run started by the door event")

    # then one run starts with the message's values and succeeds on the camera
    run = wait_for(lambda: run_finished(run.pk), what="the run to finish")
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert run.parameters == {"door": "7", "badge": "B-17", "resolution": "hd"}
    assert sim.received(camera.name)[0]["args"] == {"door": "7", "badge": "B-17"}
    assert JobRun.objects.filter(trigger=Trigger.MQTT).count() == 1  # repeats of ev-1 were deduplicated

    # when malformed events arrive: not JSON, not an object, a referenced field missing
    publish(sensor, f"{site}/door/7/opened", b"\xff not json")
    publish(sensor, f"{site}/door/7/opened", [1, 2])
    publish(sensor, f"{site}/door/8/opened", {"event_id": "ev-2"})
    wait_for(lambda: dropped_count() == 3, what="three dropped messages")
    dropped = list(RunEvent.objects.filter(kind="message.dropped").order_by("id"))

    # then each is dropped with a reason, no run starts, and the bridge keeps serving
    assert [e.data["rule"] for e in dropped] == ["door opened"] * 3
    assert dropped[2].data["topic"] == f"{site}/door/8/opened"
    assert "not JSON" in dropped[0].message and "JSON object" in dropped[1].message
    assert "badge" in dropped[2].message
    assert JobRun.objects.filter(trigger=Trigger.MQTT).count() == 1
    publish(sensor, f"{site}/door/9/opened", {"badge": "B-18", "event_id": "ev-3"})
    second = wait_for(lambda: JobRun.objects.filter(trigger=Trigger.MQTT, parameters__door="9").first())
    assert second.parameters["badge"] == "B-18"


@pytest.mark.django_db
def test_every_matching_rule_starts_its_own_run():
    # given two rules whose filters overlap and one that does not match
    template = template_with_steps((DeviceFactory(), "snapshot", {}))
    rules = [
        TriggerRule.objects.create(name="any door", topic_filter="site/+/door/#", template=template),
        TriggerRule.objects.create(
            name="berlin doors",
            topic_filter="site/berlin/door/+/opened",
            template=template,
            parameters={"door": "{{ topic.3 }}"},
            priority=9,
        ),
        TriggerRule.objects.create(name="windows", topic_filter="site/+/window/#", template=template),
    ]

    # when one message arrives
    trigger_message_handle("site/berlin/door/3/opened", b'{"badge": "x"}', rules=rules)

    # then the two matching rules each started a run
    runs = {r.triggered_by: r for r in JobRun.objects.all()}
    assert set(runs) == {
        "mqtt any door site/berlin/door/3/opened",
        "mqtt berlin doors site/berlin/door/3/opened",
    }
    berlin = runs["mqtt berlin doors site/berlin/door/3/opened"]
    assert (berlin.parameters, berlin.priority) == ({"door": "3"}, 9)


@pytest.mark.django_db
def test_a_template_without_steps_drops_the_message():
    rule = TriggerRule.objects.create(name="empty", topic_filter="site/#", template=JobTemplateFactory())

    trigger_message_handle("site/x", b"{}", rules=[rule])

    event = RunEvent.objects.get(kind="message.dropped")
    assert "no steps" in event.message and event.data == {"topic": "site/x", "rule": "empty"}
    assert not JobRun.objects.exists()


@pytest.mark.django_db
def test_an_empty_dedupe_value_drops_the_message():
    template = template_with_steps((DeviceFactory(), "snapshot", {}))
    rule = TriggerRule.objects.create(
        name="dedupe", topic_filter="site/#", template=template, idempotency_key="{{ message.event_id }}"
    )

    trigger_message_handle("site/x", b'{"event_id": ""}', rules=[rule])
    trigger_message_handle("site/x", b'{"event_id": 5}', rules=[rule])
    trigger_message_handle("site/x", b'{"event_id": 5}', rules=[rule])

    assert RunEvent.objects.filter(kind="message.dropped").count() == 1
    assert list(JobRun.objects.values_list("idempotency_key", flat=True)) == [f"mqtt:{rule.pk}:5"]


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(120)
def test_a_rule_on_a_protocol_filter_going_away_leaves_the_bridge_listening(
    stack, simulator, sensor, services
):
    # given a rule on the bridge's own `done` filter (allowed: replies are routed first)
    lamp = DeviceFactory()
    simulator({lamp.name: DeviceBehaviour()})
    template = template_with_steps((lamp, "on", {}))
    done_rule = TriggerRule.objects.create(
        name="done watch", topic_filter=f"{services.namespace}/+/done", template=template
    )

    def refreshed_with(probe: str) -> None:
        # A rule saved after the change under test: once the bridge drops its bad message,
        # the bridge has read the rules as they are now.
        topic = f"{services.namespace}/site/{probe}"
        TriggerRule.objects.create(name=probe, topic_filter=topic, template=template)

        def dropped():
            publish(sensor, topic, b"not json")
            seen = RunEvent.objects.filter(kind="message.dropped", data__rule=probe).exists()
            return seen or time.sleep(REPUBLISH_SECONDS)

        wait_for(dropped, what=f"the bridge to read the rules with {probe}")

    refreshed_with("probe-1")

    # when the rule goes away
    done_rule.enabled = False
    done_rule.save()
    refreshed_with("probe-2")

    # then devices' replies still reach the engine: a run on the lamp ends succeeded
    run, _ = run_start(template=template)
    assert wait_for(lambda: run_finished(run.pk)).status == RunStatus.SUCCEEDED
