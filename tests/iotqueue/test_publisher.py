"""The process's command publisher against the real broker: a client that can no longer
connect is replaced, so one bad moment never leaves a worker unable to publish; a message
is never sent after it expired, nor again after a dropped connection (issue 34)."""

import os
import signal
import threading
import time

import pytest

from devtools.servers import mqtt_broker_start
from iotqueue import mqtt as iot_mqtt
from iotqueue.mqtt import Message, Publisher, PublishError
from tests.conftest import wait_for
from tests.mqtt_device import mqtt_client

# Upper bound on any wait for the broker: loopback round trips take milliseconds.
WAIT_SECONDS = 5.0

pytestmark = pytest.mark.timeout(60)


def test_a_publisher_whose_network_thread_died_starts_a_fresh_client(services, monkeypatch):
    monkeypatch.setattr(iot_mqtt, "CONNECT_TIMEOUT_SECONDS", 1.0)
    publisher = Publisher("worker")
    try:
        publisher.publish(f"{services.namespace}/probe", b"{}")
        dead = publisher._client_get()
        # As when paho's network thread ends for good: no reconnect will ever come.
        dead.loop_stop()
        dead.disconnect()
        publisher._ready.clear()

        with pytest.raises(PublishError, match="not connected"):
            publisher.publish(f"{services.namespace}/probe", b"{}")

        publisher.publish(f"{services.namespace}/probe", b"{}")  # a new client, connected
        assert publisher._client_get() is not dead
    finally:
        publisher.close()


def test_a_message_past_its_expiry_is_never_handed_to_the_broker(services):
    publisher = Publisher("worker")
    topic = f"{services.namespace}/probe"
    try:
        with pytest.raises(PublishError, match="expired"):
            publisher.publish(topic, b"{}", expires_at=time.time() - 1)
        late, fresh = publisher.publish_nowait(
            [Message(topic, b"{}", time.time() - 1), Message(topic, b"{}", time.time() + 60)]
        )
        assert "expired" in late
        fresh.wait_for_publish(WAIT_SECONDS)
        assert fresh.is_published()
    finally:
        publisher.close()


@pytest.fixture
def own_broker(tmp_path, settings):
    """A broker of this test's own, to freeze and restart (the session's is shared)."""
    broker = mqtt_broker_start(tmp_path)
    settings.MQTT_URL = broker.url
    yield broker
    broker.stop()


def test_a_message_unacknowledged_when_the_connection_dropped_is_never_sent_again(own_broker):
    # Given a message the broker never acknowledged: it was frozen when it came.
    publisher = Publisher("worker")
    try:
        publisher.publish("probe/warm-up", b"{}")
        os.kill(own_broker.process.pid, signal.SIGSTOP)
        (pending,) = publisher.publish_nowait([("probe/late", b"late")])
        # When the broker dies and comes back, and the publisher notices the drop.
        os.kill(own_broker.process.pid, signal.SIGKILL)
        own_broker.restart()
        watcher = mqtt_client(own_broker.url)
        seen: list[str] = []
        watcher.on_message = lambda client, userdata, message: seen.append(message.topic)
        subscribed = threading.Event()
        watcher.on_subscribe = lambda *args: subscribed.set()
        watcher.subscribe("probe/#", qos=1)
        assert subscribed.wait(WAIT_SECONDS)
        wait_for(lambda: not publisher._ready.is_set(), what="the publisher to notice the drop")
        # Then the next message goes out through a fresh client, and the late one never:
        # paho's reconnect would have sent it again before the marker, on the same session.
        publisher.publish("probe/marker", b"{}")
        wait_for(lambda: "probe/marker" in seen, what="the marker")
        assert seen == ["probe/marker"]
        assert not pending.is_published()
        watcher.loop_stop()
        watcher.disconnect()
    finally:
        publisher.close()
