"""A hand-driven device for tests: a real MQTT client that records commands and replies on cue."""

from __future__ import annotations

import json
import queue
import threading
import uuid

import paho.mqtt.client as mqtt
from django.conf import settings

from iotqueue.mqtt import broker_address

# How long a test waits for a command to reach the device before failing.
COMMAND_WAIT_SECONDS = 15.0


def mqtt_client(url: str, *, username: str | None = None, password: str | None = None) -> mqtt.Client:
    """A connected, looping paho client: as the URL's user, or as the one given."""
    address = broker_address(url)
    client = mqtt.Client(
        callback_api_version=mqtt.CallbackAPIVersion.VERSION2, client_id=f"test-{uuid.uuid4().hex[:8]}"
    )
    if username or address.username:
        client.username_pw_set(username or address.username, password if username else address.password)
    connected = threading.Event()

    def on_connect(client, userdata, flags, reason_code, properties) -> None:
        if not reason_code.is_failure:
            connected.set()

    client.on_connect = on_connect
    client.connect(address.host, address.port)
    client.loop_start()
    if not connected.wait(COMMAND_WAIT_SECONDS):
        client.loop_stop()
        who = username or address.username or "anonymous"
        raise ConnectionError(f"the broker refused {who} or did not answer")
    return client


class ManualDevice:
    """A device driven by the test; it logs in with its own credentials when given them."""

    def __init__(self, name: str, url: str, *, password: str | None = None) -> None:
        self.name = name
        self.prefix = settings.IOTQUEUE_TOPIC_PREFIX
        self.commands: queue.Queue[dict] = queue.Queue()
        self.client = mqtt_client(url, username=name if password else None, password=password)
        self.client.on_message = lambda c, u, m: self.commands.put(json.loads(m.payload))
        subscribed = threading.Event()
        self.client.on_subscribe = lambda *args: subscribed.set()
        self.client.subscribe(f"{self.prefix}/{name}/cmd/#", qos=1)
        if not subscribed.wait(COMMAND_WAIT_SECONDS):
            raise TimeoutError(f"{name}: no SUBACK from the broker")

    def next_command(self, timeout: float = COMMAND_WAIT_SECONDS) -> dict:
        return self.commands.get(timeout=timeout)

    def reply(self, kind: str, body: dict) -> None:
        self.client.publish(f"{self.prefix}/{self.name}/{kind}", json.dumps(body), qos=1).wait_for_publish(5)

    def done(self, command_id: str, ok: bool = True, **extra) -> None:
        self.reply("done", {"id": command_id, "ok": ok, **extra})

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()
