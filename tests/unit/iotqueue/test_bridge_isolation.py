"""The bridge cannot be deafened (issue 31, findings 3, 4 and 15): guarded callbacks, filters
checked one by one, device topics kept for devices. No broker: a Bridge that never connects,
driven through the callbacks paho would call. The stack tier proves the same on a real broker
(tests/iotqueue/test_bridge_isolation.py)."""

from __future__ import annotations

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.reasoncodes import ReasonCode

from iotqueue import bridge
from iotqueue.metrics import CounterBuffer

pytestmark = pytest.mark.django_db


def handler(name: str) -> bridge.Handler:
    def handle(topic: str, payload: bytes) -> None:
        raise AssertionError(f"{name} was routed to, not called")

    handle.__name__ = name
    return handle


REPLIES, RULE, LEGACY = (handler(name) for name in ("replies", "rule", "legacy"))


@pytest.fixture(autouse=True)
def registry(monkeypatch, settings):
    """An empty handler registry, a plain broker URL, counts kept in the process (no Redis)."""
    monkeypatch.setattr(bridge, "_handlers", [])
    monkeypatch.setattr(bridge, "_unshared", set())
    monkeypatch.setattr(bridge, "_providers", [])
    monkeypatch.setattr(bridge, "counter_buffer", CounterBuffer(flush_seconds=3600))
    # Which retained filters the broker session holds: a set in the process, not Redis.
    held: set[str] = set()

    def held_read(client_id: str, *, session_present: bool) -> set[str]:
        if not session_present:
            held.clear()  # a new session holds no subscription
        return set(held)

    monkeypatch.setattr(bridge, "retained_filters_held", held_read)
    monkeypatch.setattr(bridge, "retained_filter_noted", lambda client_id, topic: held.add(topic))
    settings.MQTT_URL = "mqtt://127.0.0.1:1883"
    settings.MQTT_SHARED_GROUP = ""


# A CONNACK's flags: the broker kept no session (every filter is subscribed).
NEW_SESSION = mqtt.ConnectFlags(session_present=False)
KEPT_SESSION = mqtt.ConnectFlags(session_present=True)
CONNACK_SUCCESS = ReasonCode(mqtt.PacketTypes.CONNACK, "Success")


def refreshed(*providers: bridge.TopicProvider) -> bridge.Bridge:
    for provider in providers:
        bridge.dynamic_topics_register(provider)
    subject = bridge.Bridge()
    subject.dynamic_refresh()
    return subject


def message(topic: bytes, payload: bytes = b"{}") -> mqtt.MQTTMessage:
    received = mqtt.MQTTMessage(mid=7, topic=topic)
    received.qos, received.payload = 1, payload
    return received


# --- finding 15: no callback raises into paho ------------------------------------------


def test_a_message_that_fails_outside_its_handler_is_counted_not_raised_into_paho():
    # given a bridge, and a message whose topic is not UTF-8 (a broker with other rules)
    bridge.handler_register("P/+/done", REPLIES)
    subject = refreshed()

    # when paho hands it over, then nothing escapes to paho's network thread
    subject._on_message(subject.client, None, message(b"P/\xff/done"))

    assert subject.stats["callback_error:message"] == 1


def test_a_handler_that_raises_is_counted_and_the_next_message_is_handled():
    seen = []

    def failing(topic: str, payload: bytes) -> None:
        seen.append(topic)
        raise ValueError("a bug in a handler")

    bridge.handler_register("P/+/done", failing)
    subject = refreshed()

    subject._on_message(subject.client, None, message(b"P/a/done"))
    subject._on_message(subject.client, None, message(b"P/b/done"))

    assert seen == ["P/a/done", "P/b/done"]
    assert subject.stats["handler_errors"] == 2


def test_a_failing_connect_callback_is_counted_not_raised(monkeypatch):
    # given a provider whose topics cannot even be listed (a bug), read while connecting
    subject = refreshed()
    monkeypatch.setattr(subject, "_subscribe", lambda topics: 1 / 0)

    subject._on_connect(subject.client, None, NEW_SESSION, CONNACK_SUCCESS, None)

    assert subject.stats["callback_error:connect"] == 1


# --- finding 3: one bad filter is refused, the rest subscribed ------------------------


def test_a_filter_with_a_control_character_is_refused_and_never_subscribed():
    # given a rule stored before topics were validated: ctl/<U+0001>/x
    bridge.handler_register("P/+/done", REPLIES)
    subject = refreshed(lambda: {"ctl/\x01/x": RULE, "site/+/opened": RULE})

    # then it is refused with the reason, and the good rule is routed
    assert "control character" in subject.refused["ctl/\x01/x"]
    assert subject._handler_for("site/7/opened") is RULE
    assert subject._handler_for("ctl/\x01/x") is None

    # and a reconnect subscribes everything else, filter by filter
    sent = []
    subject.client.subscribe = lambda topic, qos: sent.append(topic) or (mqtt.MQTT_ERR_SUCCESS, len(sent))
    subject._on_connect(subject.client, None, NEW_SESSION, CONNACK_SUCCESS, None)
    assert sent == ["P/+/done", "site/+/opened"]


def test_a_filter_the_broker_drops_the_connection_over_twice_is_refused():
    # given a filter a broker objects to though it looks valid (a broker with other rules)
    subject = refreshed(lambda: {"site/odd": RULE, "site/+/opened": RULE})
    sent: list[str] = []
    subject.client.subscribe = lambda topic, qos: sent.append(topic) or (mqtt.MQTT_ERR_SUCCESS, len(sent))
    success = ReasonCode(mqtt.PacketTypes.CONNACK, "Success")
    malformed = ReasonCode(mqtt.PacketTypes.DISCONNECT, "Malformed packet")

    for _ in range(bridge.SUBSCRIBE_STRIKES):
        # when the broker drops the connection before answering its SUBSCRIBE, each time
        sent.clear()
        subject._on_connect(subject.client, None, NEW_SESSION, success, None)
        subject._on_disconnect(subject.client, None, {}, malformed, None)

    # then it is refused, and the next connection subscribes the rest only
    assert "dropped the connection" in subject.refused["site/odd"]
    sent.clear()
    subject._on_connect(subject.client, None, NEW_SESSION, success, None)
    assert sent == ["site/+/opened"]


def test_a_device_filter_waiting_when_the_connection_drops_is_never_struck_off():
    # given a bridge whose device filters are still unanswered when the network blips, twice
    bridge.handler_register("iotqueue/+/done", handler("replies"))
    subject = refreshed(lambda: {"site/+/opened": RULE})
    sent: list[str] = []
    subject.client.subscribe = lambda topic, qos: sent.append(topic) or (mqtt.MQTT_ERR_SUCCESS, len(sent))
    success = ReasonCode(mqtt.PacketTypes.CONNACK, "Success")
    for _ in range(bridge.SUBSCRIBE_STRIKES + 1):
        sent.clear()
        subject._on_connect(subject.client, None, NEW_SESSION, success, None)
        subject._on_disconnect(
            subject.client, None, {}, ReasonCode(mqtt.PacketTypes.DISCONNECT, "Keep alive timeout"), None
        )

    # then every device filter is subscribed again on the next connection
    sent.clear()
    subject._on_connect(subject.client, None, NEW_SESSION, success, None)
    assert "iotqueue/+/done" not in subject.refused and "iotqueue/+/done" in sent


def test_a_filter_the_broker_refuses_in_its_suback_is_recorded():
    subject = refreshed(lambda: {"site/+/opened": RULE})
    subject.client.subscribe = lambda topic, qos: (mqtt.MQTT_ERR_SUCCESS, 41)
    subject._on_connect(subject.client, None, NEW_SESSION, CONNACK_SUCCESS, None)

    refusal = ReasonCode(mqtt.PacketTypes.SUBACK, identifier=0x80)
    subject._on_subscribe(subject.client, None, 41, [refusal], None)

    assert "refused" in subject.refused["site/+/opened"]
    assert subject._handler_for("site/7/opened") is None


def test_a_kept_session_keeps_its_status_subscription_and_a_new_session_subscribes_it_again():
    # Resubscribing the retained status filter would replay every device's status ahead of
    # the replies queued for the session (iotqueue/retained.py).
    bridge.handler_register("P/+/done", REPLIES)
    bridge.handler_register("P/+/status", RULE, shared=False)
    subject = refreshed()
    sent = []
    subject.client.subscribe = lambda topic, qos: sent.append(topic) or (mqtt.MQTT_ERR_SUCCESS, len(sent))
    granted = ReasonCode(mqtt.PacketTypes.SUBACK, identifier=1)

    subject._on_connect(subject.client, None, NEW_SESSION, CONNACK_SUCCESS, None)
    assert sent == ["P/+/done", "P/+/status"]
    subject._on_subscribe(subject.client, None, 1, [granted], None)
    subject._on_subscribe(subject.client, None, 2, [granted], None)

    sent.clear()
    subject._on_connect(subject.client, None, KEPT_SESSION, CONNACK_SUCCESS, None)
    assert sent == ["P/+/done"]

    sent.clear()
    subject._on_connect(subject.client, None, NEW_SESSION, CONNACK_SUCCESS, None)
    assert sent == ["P/+/done", "P/+/status"]


def test_a_status_filter_never_acknowledged_is_subscribed_again_in_a_kept_session():
    # The process died between CONNACK and SUBACK: nothing was noted, so nothing is skipped.
    bridge.handler_register("P/+/status", RULE, shared=False)
    subject = refreshed()
    sent = []
    subject.client.subscribe = lambda topic, qos: sent.append(topic) or (mqtt.MQTT_ERR_SUCCESS, len(sent))
    subject._on_connect(subject.client, None, KEPT_SESSION, CONNACK_SUCCESS, None)
    assert sent == ["P/+/status"]


# --- finding 4: device topics belong to the static handlers ---------------------------


@pytest.mark.parametrize(
    "rule_filter", ["P/victim-1/done", "+/victim-1/done", "P/victim-1/+", "P/+/jobs/get", "P/#", "#"]
)
def test_a_dynamic_topic_or_filter_never_takes_a_device_topic(rule_filter):
    # given the device replies, and a rule (or a legacy topic) on a device's reply topic
    bridge.handler_register("P/+/done", REPLIES)
    bridge.handler_register("P/+/jobs/get", REPLIES)
    subject = refreshed(lambda: {rule_filter: RULE})

    # then the device's reply goes to the reply handler, and the rule is not listened to
    assert subject._handler_for("P/victim-1/done") is REPLIES
    assert "belongs to devices" in subject.refused[rule_filter]


def test_a_message_counts_against_the_device_its_topic_names():
    legacy = handler("legacy")
    legacy.budget_key = "face-123"
    bridge.handler_register("P/+/done", REPLIES)
    subject = refreshed(lambda: {"dev/face/123/Ack": legacy, "site/+/opened": RULE})

    assert subject._route("P/lamp-2/done") == (REPLIES, "lamp-2")
    assert subject._route("dev/face/123/Ack") == (legacy, "face-123")
    assert subject._route("site/7/opened") == (RULE, "site/+/opened")


# --- finding 5: over its budget a device's messages are dropped unread ------------------


def test_over_its_budget_a_device_is_dropped_unread_and_others_still_pass(settings):
    settings.IOTQUEUE_DEVICE_MESSAGE_RATE, settings.IOTQUEUE_DEVICE_MESSAGE_BURST = 0.001, 3
    handled = []
    bridge.handler_register("P/+/done", lambda topic, payload: handled.append(topic))
    subject = refreshed()

    for _ in range(10):
        subject._on_message(subject.client, None, message(b"P/flood/done"))
    subject._on_message(subject.client, None, message(b"P/quiet/done"))

    assert handled == ["P/flood/done"] * 3 + ["P/quiet/done"]
    assert subject.stats["over_budget"] == 7
