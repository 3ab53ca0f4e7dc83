"""The kit's ears on the broker: every message on the device's topics, in arrival order, and
a way to publish what the server would (a command sent again, a late one)."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

import paho.mqtt.client as mqtt

from ..protocol import Topics

CONNECT_SECONDS = 15.0


@dataclass(frozen=True)
class Seen:
    """One message: its kind ("cmd", "ack", "progress", "done", "jobs/get", "jobs/current",
    "status", "heartbeat"), its JSON (None when it is not JSON) and its index in the log."""

    index: int
    kind: str
    topic: str
    body: Any
    at: float

    @property
    def id(self) -> str | None:
        return self.body.get("id") if isinstance(self.body, dict) else None


class Observer:
    """Subscribes to P/D/# with the kit's credentials (the URL's user: a user allowed to read
    the device's topics and publish its commands, such as iotqueue's service user)."""

    def __init__(self, mqtt_url: str, topics: Topics, *, cafile: str | None = None) -> None:
        self.topics = topics
        self.log: list[Seen] = []
        self._changed = threading.Condition()
        url = urlsplit(mqtt_url)
        self._client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id=f"conformance-{uuid.uuid4().hex[:8]}"
        )
        if url.username:
            self._client.username_pw_set(unquote(url.username), unquote(url.password or ""))
        if url.scheme == "mqtts" or cafile:
            self._client.tls_set(ca_certs=cafile)
        self._client.on_message = self._on_message
        subscribed = threading.Event()
        self._client.on_connect = lambda client, *_: client.subscribe(f"{topics.base}/#", qos=1)
        self._client.on_subscribe = lambda *_: subscribed.set()
        self._client.connect(
            url.hostname or "127.0.0.1", url.port or (8883 if url.scheme == "mqtts" else 1883)
        )
        self._client.loop_start()
        if not subscribed.wait(CONNECT_SECONDS):
            self.close()
            raise ConnectionError(f"no subscription to {topics.base}/# within {CONNECT_SECONDS:g}s")

    def _on_message(self, client, userdata, message: mqtt.MQTTMessage) -> None:
        rest = message.topic[len(self.topics.base) + 1 :]
        kind = "cmd" if rest.startswith("cmd/") else rest
        try:
            body = json.loads(message.payload) if message.payload else None
        except ValueError:
            body = message.payload.decode("utf-8", "replace")
        with self._changed:
            self.log.append(Seen(len(self.log), kind, message.topic, body, time.time()))
            self._changed.notify_all()

    def wait(self, predicate: Callable[[Seen], bool], timeout: float, *, after: int = 0) -> Seen | None:
        """The first message from index `after` on that matches, waiting up to `timeout`."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = next((seen for seen in self.log[after:] if predicate(seen)), None)
                remaining = deadline - time.monotonic()
                if found is not None or remaining <= 0:
                    return found
                self._changed.wait(remaining)

    def mark(self) -> int:
        with self._changed:
            return len(self.log)

    def since(self, index: int) -> list[Seen]:
        with self._changed:
            return self.log[index:]

    def publish(self, topic: str, body: dict[str, Any]) -> None:
        self._client.publish(topic, json.dumps(body), qos=1).wait_for_publish(CONNECT_SECONDS)

    def close(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()
