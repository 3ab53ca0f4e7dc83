"""The bridge's routing (iotqueue/bridge.py): which handler a topic goes to, and what it
subscribes to. No broker: a Bridge that never connects. Receiving, acknowledging and
redelivery run against a real broker in the stack tier (tests/jobs/test_bridge_sessions.py)."""

from __future__ import annotations

import socket

import pytest

from iotqueue import bridge

# dynamic_refresh recycles the database connection first, as it does between ticks.
pytestmark = pytest.mark.django_db


def handler(name: str) -> bridge.Handler:
    def handle(topic: str, payload: bytes) -> None:
        raise AssertionError(f"{name} was routed to, not called")

    handle.__name__ = name
    return handle


REPLIES, PRESENCE, RULE, LEGACY = (handler(name) for name in ("replies", "presence", "rule", "legacy"))


@pytest.fixture(autouse=True)
def registry(monkeypatch, settings):
    """An empty handler registry (the apps' own registrations set aside) and a plain broker URL."""
    monkeypatch.setattr(bridge, "_handlers", [])
    monkeypatch.setattr(bridge, "_unshared", set())
    monkeypatch.setattr(bridge, "_providers", [])
    settings.MQTT_URL = "mqtt://127.0.0.1:1883"
    settings.MQTT_SHARED_GROUP = ""


def refreshed(*providers: bridge.TopicProvider) -> bridge.Bridge:
    """A bridge (never connected) that has read the dynamic topics of `providers`."""
    for provider in providers:
        bridge.dynamic_topics_register(provider)
    subject = bridge.Bridge()
    subject.dynamic_refresh()
    return subject


def test_a_topic_goes_to_the_handler_of_the_filter_it_matches():
    # given handlers for device replies and presence
    bridge.handler_register("P/+/done", REPLIES)
    bridge.handler_register("P/+/status", PRESENCE, shared=False)

    # when topics are routed, then each reaches its own handler, and others none
    subject = refreshed()
    assert subject._handler_for("P/lamp-2/done") is REPLIES
    assert subject._handler_for("P/lamp-2/status") is PRESENCE
    assert subject._handler_for("P/lamp-2/cmd/on") is None
    assert subject._handler_for("Q/lamp-2/done") is None


def test_the_first_registered_filter_wins_when_two_match():
    bridge.handler_register("P/+/done", REPLIES)
    bridge.handler_register("P/#", RULE)

    assert refreshed()._handler_for("P/lamp-2/done") is REPLIES


def test_registering_a_handler_twice_routes_once():
    bridge.handler_register("P/+/done", REPLIES)
    bridge.handler_register("P/+/done", REPLIES)

    assert bridge._handlers == [("P/+/done", REPLIES)]


def test_an_exact_dynamic_topic_is_looked_up_before_any_dynamic_filter():
    # given a rule's filter and a legacy device whose fixed reply topic it also matches
    # when routed, then the legacy device's own handler takes its topic
    subject = refreshed(lambda: {"dev/#": RULE}, lambda: {"dev/face/123/Ack": LEGACY})
    assert subject._handler_for("dev/face/123/Ack") is LEGACY
    assert subject._handler_for("dev/face/124/Ack") is RULE


def test_dynamic_filters_come_after_the_static_handlers():
    # given the device replies, a rule listening to everything under P and one on a sensor
    bridge.handler_register("P/+/done", REPLIES)

    # then a rule never takes a device's replies: one that would is not listened to at all
    subject = refreshed(lambda: {"P/#": RULE, "site/+/opened": RULE})
    assert subject._handler_for("P/lamp-2/done") is REPLIES
    assert subject._handler_for("P/door/7/opened") is None
    assert subject._handler_for("site/7/opened") is RULE
    assert "P/#" in subject.refused


def test_a_refresh_routes_added_topics_and_forgets_removed_ones():
    # given a provider whose topics change (a device gets a legacy topic, another loses it)
    topics = {"dev/face/1/Ack": LEGACY}
    subject = refreshed(lambda: dict(topics))
    assert subject._handler_for("dev/face/1/Ack") is LEGACY

    # when the topics change and the bridge refreshes
    topics.clear()
    topics["dev/face/2/Ack"] = LEGACY
    subject.dynamic_refresh()

    # then the new topic is routed and the old one no longer is
    assert subject._handler_for("dev/face/2/Ack") is LEGACY
    assert subject._handler_for("dev/face/1/Ack") is None


def test_subscriptions_are_shared_in_the_group_except_the_unshared_ones(settings):
    # given replicas sharing a group, and presence subscribed by each replica itself
    settings.MQTT_SHARED_GROUP = "bridges"
    bridge.handler_register("P/+/done", REPLIES)
    bridge.handler_register("P/+/status", PRESENCE, shared=False)
    subject = refreshed()

    # then replies are shared (one replica gets each), retained presence reaches every replica
    assert subject._subscription("P/+/done") == "$share/bridges/P/+/done"
    assert subject._subscription("P/+/status") == "P/+/status"


def test_without_a_group_nothing_is_shared():
    bridge.handler_register("P/+/done", REPLIES)

    assert refreshed()._subscription("P/+/done") == "P/+/done"


def test_the_client_id_is_stable_per_host_unless_set(settings):
    # a persistent session needs the same id on every start
    settings.MQTT_BRIDGE_CLIENT_ID = ""
    settings.MQTT_CLIENT_ID_PREFIX = "iotqueue"
    assert bridge.bridge_client_id() == f"iotqueue-bridge-{socket.gethostname()}"
    settings.MQTT_BRIDGE_CLIENT_ID = "site-a-bridge"
    assert bridge.bridge_client_id() == "site-a-bridge"


def test_outside_a_handler_deferring_the_ack_does_nothing():
    ack = bridge.ack_defer()

    assert ack() is None
