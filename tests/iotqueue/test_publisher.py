"""The process's command publisher against the real broker: a client that can no longer
connect is replaced, so one bad moment never leaves a worker unable to publish."""

import pytest

from iotqueue import mqtt as iot_mqtt
from iotqueue.mqtt import Publisher, PublishError

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
