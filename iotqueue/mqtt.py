"""MQTT plumbing: paho clients built from MQTT_URL, and the per-process command publisher.

Every client gets a unique client id (prefix, role, host, pid, random) so replicas never
kick each other off the broker, except the bridge's, whose persistent session needs a
stable one (iotqueue/bridge.py). Credentials come from the URL, TLS from the mqtts scheme.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, NamedTuple
from urllib.parse import unquote, urlparse

import paho.mqtt.client as mqtt
from django.conf import settings

log = logging.getLogger(__name__)

# Seconds between keepalive pings; the broker declares a client dead after 1.5x this,
# which is when a device's last will ("offline") fires.
KEEPALIVE_SECONDS = 30
# How long a publisher waits for the broker's PUBACK before calling the publish failed.
PUBLISH_TIMEOUT_SECONDS = 5.0
# How long a publisher waits for the first CONNACK.
CONNECT_TIMEOUT_SECONDS = 10.0


class PublishError(RuntimeError):
    """A message could not be handed to the broker (not connected, or no PUBACK in time)."""


class Message(NamedTuple):
    """A message to publish; one not handed to the broker by `expires_at` (epoch seconds) is
    not sent at all: a command whose attempt's deadline passed while the broker was away."""

    topic: str
    payload: bytes
    expires_at: float | None = None

    def expired(self) -> bool:
        return self.expires_at is not None and time.time() >= self.expires_at


@dataclass(frozen=True)
class BrokerAddress:
    host: str
    port: int
    username: str | None
    password: str | None
    tls: bool


def broker_address(url: str | None = None) -> BrokerAddress:
    """Parse mqtt://user:pass@host:port or mqtts://... into its parts."""
    parsed = urlparse(url or settings.MQTT_URL)
    if parsed.scheme not in ("mqtt", "mqtts", "tcp", "ssl"):
        raise ValueError(f"MQTT_URL scheme must be mqtt or mqtts, not {parsed.scheme!r}")
    tls = parsed.scheme in ("mqtts", "ssl")
    return BrokerAddress(
        host=parsed.hostname or "127.0.0.1",
        port=parsed.port or (8883 if tls else 1883),
        username=unquote(parsed.username) if parsed.username else None,
        password=unquote(parsed.password) if parsed.password else None,
        tls=tls,
    )


def unique_client_id(role: str) -> str:
    """A client id unique per process and call: iotqueue-bridge-host-1234-ab12cd."""
    host = socket.gethostname().split(".")[0][:16]
    return f"{settings.MQTT_CLIENT_ID_PREFIX}-{role}-{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def client_create(
    role: str, *, url: str | None = None, client_id: str | None = None, clean_session: bool = True
) -> mqtt.Client:
    """A configured (not yet connected) paho 2.x client for MQTT 3.1.1.

    Without `client_id` the id is unique to this call (see `unique_client_id`); a client
    with a persistent session (`clean_session=False`) needs a stable one.
    """
    address = broker_address(url)
    client = mqtt.Client(
        callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
        client_id=client_id or unique_client_id(role),
        protocol=mqtt.MQTTv311,
        clean_session=clean_session,
    )
    if address.username:
        client.username_pw_set(address.username, address.password)
    if address.tls:
        client.tls_set(
            ca_certs=settings.MQTT_CA_FILE or None,
            certfile=settings.MQTT_CERT_FILE or None,
            keyfile=settings.MQTT_KEY_FILE or None,
            cert_reqs=ssl.CERT_REQUIRED,
        )
    # Back off 1 s .. 30 s between reconnect attempts so a restarting broker is not hammered.
    client.reconnect_delay_set(min_delay=1, max_delay=30)
    client.on_socket_open = _socket_nodelay
    return client


def _socket_nodelay(client, userdata, sock) -> None:
    """Small messages go out at once: with Nagle's algorithm a second publish right after
    a first (an ack then a done, two commands) waits ~40 ms for the first one's TCP ack."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (OSError, AttributeError):
        pass  # not a TCP socket (e.g. a websocket wrapper)


def client_connect(client: mqtt.Client, *, url: str | None = None) -> None:
    """Start connecting in paho's network thread; reconnects are automatic from then on."""
    address = broker_address(url)
    client.connect_async(address.host, address.port, keepalive=KEEPALIVE_SECONDS)
    client.loop_start()


class ProcessClient:
    """One connected client per process, shared by the threads of that process.

    Created lazily on first use and re-created after a fork (Celery prefork), since a paho
    client and its socket cannot be shared across processes. `_ready` is set once the
    client can be used: on connect here; a subclass that must first subscribe overrides
    `_on_ready_connect` and sets it later, and adds its callbacks in `_client_configure`.
    """

    def __init__(self, role: str) -> None:
        self.role = role
        self._lock = threading.Lock()
        self._client: mqtt.Client | None = None
        self._pid = 0
        self._ready = threading.Event()

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if not reason_code.is_failure:
            self._on_ready_connect(client)

    def _on_ready_connect(self, client: mqtt.Client) -> None:
        self._ready.set()

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        self._ready.clear()

    def _client_configure(self, client: mqtt.Client) -> None:
        """Callbacks beyond connect and disconnect, set before the client connects."""

    def _client_get(self) -> mqtt.Client:
        with self._lock:
            if self._client is None or self._pid != os.getpid():
                self._ready = threading.Event()
                client = client_create(self.role)
                client.on_connect = self._on_connect
                client.on_disconnect = self._on_disconnect
                self._client_configure(client)
                client_connect(client)
                self._client, self._pid = client, os.getpid()
            return self._client

    def close(self, client: mqtt.Client | None = None) -> None:
        """Disconnect and drop the process's client (only if it is still `client`, when given)."""
        with self._lock:
            if client is not None and self._client is not client:
                return
            if self._client is not None and self._pid == os.getpid():
                self._client.disconnect()
                self._client.loop_stop()
            self._client = None


class Publisher(ProcessClient):
    """The process's command publisher (a ProcessClient that publishes).

    How it fails: a client whose connection drops is never reconnected; the next publish
    starts a fresh one. paho would otherwise reconnect by itself and send again every QoS 1
    message the broker had not acknowledged, however late: a command whose attempt timed
    out meanwhile would reach its device after the next holder's (issue 34). A message not
    acknowledged before the drop is a failed publish, which the caller owns: the engine's
    `send` deadline re-sends a command only while its attempt is still current
    (jobs/engine/due.py, the `send` deadline).
    """

    def __init__(self, role: str) -> None:
        super().__init__(role)
        # The client whose connection dropped: written by its network thread, which must
        # not take `_lock` (close() holds it while joining that thread).
        self._dropped: mqtt.Client | None = None

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            self._dropped = client  # before `_ready` clears: a publish now starts a fresh client
            client.disconnect()  # its network thread ends instead of reconnecting and re-sending
        super()._on_disconnect(client, userdata, flags, reason_code, properties)

    def _client_get(self) -> mqtt.Client:
        dropped = self._dropped
        if dropped is not None:
            self._dropped = None
            self.close(dropped)
        return super()._client_get()

    def connect(self) -> None:
        """Start connecting now (non-blocking), so the first publish finds a live session."""
        self._client_get()

    def _not_connected(self, client: mqtt.Client) -> str:
        """Why a publish found no connection; the client is dropped, so the next publish
        starts a fresh one (a client whose network thread died would never reconnect)."""
        self.close(client)
        address = broker_address()
        return f"not connected to MQTT broker at {address.host}:{address.port}"

    def publish(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int = 1,
        retain: bool = False,
        expires_at: float | None = None,
    ) -> None:
        """Publish and wait for the broker's acknowledgement; raise PublishError on failure.

        `expires_at` (epoch seconds): a message not handed to the broker by then is not sent
        at all (a command whose attempt's deadline passed while the broker was out of reach).
        """
        client = self._client_get()
        if not self._ready.wait(CONNECT_TIMEOUT_SECONDS):
            raise PublishError(self._not_connected(client))
        if Message(topic, payload, expires_at).expired():
            raise PublishError(_expired(topic))
        info = client.publish(topic, payload, qos=qos, retain=retain)
        try:
            if info.rc != mqtt.MQTT_ERR_SUCCESS and info.rc != mqtt.MQTT_ERR_NO_CONN:
                raise PublishError(f"publish to {topic} failed: {mqtt.error_string(info.rc)}")
            try:
                info.wait_for_publish(timeout=PUBLISH_TIMEOUT_SECONDS)
            except (RuntimeError, ValueError) as exc:
                raise PublishError(f"publish to {topic} failed: {exc}") from None
            if not info.is_published():
                raise PublishError(f"no PUBACK for {topic} within {PUBLISH_TIMEOUT_SECONDS}s")
        except PublishError:
            # paho keeps an unacknowledged QoS 1 message and sends it again after reconnecting.
            # The caller treats this command as not sent (its attempt will time out and the
            # device may get the next command), so a late copy must never leave: drop the
            # client together with its queue (this client only: another thread may already
            # publish through a fresh one).
            self.close(client)
            raise

    def publish_nowait(self, messages: list[tuple[str, bytes]] | list[Message], *, qos: int = 1) -> list[Any]:
        """Hand messages to the client without waiting for the broker.

        Per message: its MQTTMessageInfo (`is_published()` turns True when the broker's
        PUBACK arrives) or, when it could not even be queued (or expired first), why. The
        caller checks the infos later and closes the client when one is overdue
        (jobs/engine/publish.py).
        """
        if not messages:
            return []
        client = self._client_get()
        if not self._ready.wait(CONNECT_TIMEOUT_SECONDS):
            return [self._not_connected(client)] * len(messages)
        outcomes: list[Any] = []
        for message in messages:
            topic, payload = message[0], message[1]
            if isinstance(message, Message) and message.expired():
                outcomes.append(_expired(topic))
                continue
            info = client.publish(topic, payload, qos=qos)
            if info.rc in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
                outcomes.append(info)
            else:
                outcomes.append(f"publish to {topic} failed: {mqtt.error_string(info.rc)}")
        return outcomes


def _expired(topic: str) -> str:
    return f"publish to {topic} not sent: it expired while waiting for the broker"


publisher = Publisher("worker")
