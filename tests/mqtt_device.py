"""A hand-driven device for tests: a real MQTT client that records commands and replies on cue."""

from __future__ import annotations

import json
import queue
import threading
import uuid
from urllib.parse import urlparse

import paho.mqtt.client as mqtt
from django.conf import settings

# How long a test waits for a command to reach the device before failing.
COMMAND_WAIT_SECONDS = 15.0


class ManualDevice:
    def __init__(self, name: str, url: str) -> None:
        self.name = name
        self.prefix = settings.IOTQUEUE_TOPIC_PREFIX
        self.commands: queue.Queue[dict] = queue.Queue()
        self.client = mqtt.Client(
            callback_api_version=mqtt.CallbackAPIVersion.VERSION2, client_id=f"manual-{uuid.uuid4().hex[:8]}"
        )
        self.client.on_message = lambda c, u, m: self.commands.put(json.loads(m.payload))
        subscribed = threading.Event()
        self.client.on_subscribe = lambda *args: subscribed.set()
        parsed = urlparse(url)
        self.client.connect(parsed.hostname, parsed.port)
        self.client.loop_start()
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
