"""The MQTT bridge: one long-lived subscriber that routes device messages to app handlers.

Apps register handlers in AppConfig.ready() (`handler_register` for topic filters under the
prefix, `dynamic_topics_register` for per-device legacy topics that change at runtime), so
this module knows neither devices nor jobs. A handler gets (topic, payload) and must be
quick: validate, correlate, hand off to Celery. A handler that raises is logged and
counted; the bridge keeps running.

No message is lost while no bridge runs or when one dies: each replica has a persistent
session under a stable client id (MQTT_BRIDGE_CLIENT_ID, by default one per host), so the
broker keeps QoS 1 messages for it while it is away, and a message is acknowledged only
once it was handled — for a handler that hands it on later (a reply joining a batch,
`ack_defer`), once that hand-off succeeded. What was not acknowledged is delivered again
to the replica's next session. Device status (retained) is subscribed outside the shared
group (`shared=False`), since brokers do not deliver retained messages to shared
subscriptions and every replica needs to know who is online.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections import Counter
from collections.abc import Callable

import paho.mqtt.client as mqtt
from django.conf import settings
from django.db import close_old_connections

from .batching import batchers_flush
from .metrics import COUNTER, Family, counter_buffer, family_declare
from .mqtt import client_connect, client_create

log = logging.getLogger(__name__)

Handler = Callable[[str, bytes], None]
TopicProvider = Callable[[], dict[str, Handler]]

# How often the bridge re-reads dynamic topics (devices added or given legacy topics):
# a new device works within this many seconds, without a restart.
DYNAMIC_REFRESH_SECONDS = 2.0

# What became of each message the bridge received. The bridge counts what it decides
# itself; apps add the outcomes their handlers decide (`family_values_add`).
BRIDGE_MESSAGES = family_declare(
    Family(
        "iotqueue_bridge_messages",
        "Messages the bridge received, by what became of them. 'accepted' replies were valid and handed "
        "to the engine, which may still find them stale, unknown or from a foreign device.",
        COUNTER,
        ("kind",),
        ("unrouted", "handler_error"),
    )
)

_handlers: list[tuple[str, Handler]] = []
_unshared: set[str] = set()
_providers: list[TopicProvider] = []
# The acknowledgement of the message being handled on this thread (see ack_defer).
_current = threading.local()


def handler_register(topic_filter: str, handler: Handler, *, shared: bool = True) -> None:
    """Route messages matching `topic_filter` (MQTT wildcards allowed) to `handler`.

    `shared=False`: every bridge replica subscribes to it itself, outside MQTT_SHARED_GROUP
    (for retained messages, which brokers do not send to shared subscriptions).
    """
    if (topic_filter, handler) not in _handlers:
        _handlers.append((topic_filter, handler))
    if not shared:
        _unshared.add(topic_filter)


def ack_defer() -> Callable[[], None]:
    """For a handler that hands its message on later: the message's acknowledgement.

    Call the returned function once the hand-off succeeded; until then the broker keeps the
    message for this bridge (and delivers it again to its next session). Outside a handler
    it does nothing.
    """
    ack = getattr(_current, "ack", None)
    if ack is None:
        return lambda: None
    _current.deferred = True
    return ack


def bridge_client_id() -> str:
    """This replica's stable client id: MQTT_BRIDGE_CLIENT_ID, or <prefix>-bridge-<host>."""
    return settings.MQTT_BRIDGE_CLIENT_ID or f"{settings.MQTT_CLIENT_ID_PREFIX}-bridge-{socket.gethostname()}"


def dynamic_topics_register(provider: TopicProvider) -> None:
    """`provider()` returns {topic or filter: handler}; re-read every DYNAMIC_REFRESH_SECONDS.

    Exact topics are looked up directly; filters with + or # are tried only after the
    static handlers, so they never take a device's replies.
    """
    if provider not in _providers:
        _providers.append(provider)


class Bridge:
    """Subscribes to every registered topic and dispatches each message to its handler."""

    def __init__(self) -> None:
        # A persistent session: the broker keeps this replica's subscriptions and messages
        # while it is away; acknowledged by hand, after each message's hand-off.
        self.client = client_create("bridge", client_id=bridge_client_id(), clean_session=False)
        self.client.manual_ack_set(True)
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.on_message = self._on_message
        self.stats: Counter[str] = Counter()
        self.connected = threading.Event()
        self._stop = threading.Event()
        self._dynamic: dict[str, Handler] = {}
        # The wildcard entries of _dynamic, matched one by one (few: e.g. trigger rules).
        self._dynamic_filters: list[tuple[str, Handler]] = []
        self._lock = threading.Lock()

    def _subscription(self, topic: str) -> str:
        group = settings.MQTT_SHARED_GROUP
        return f"$share/{group}/{topic}" if group and topic not in _unshared else topic

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log.error("bridge: broker refused connection: %s", reason_code)
            return
        # Subscribing here (not once at start) makes every reconnect resubscribe.
        topics = [t for t, _ in _handlers] + list(self._dynamic)
        if topics:
            client.subscribe([(self._subscription(t), 1) for t in topics])
        log.info("bridge: connected, subscribed to %d topic filters", len(topics))
        self.connected.set()

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        self.connected.clear()
        if not self._stop.is_set():
            log.warning("bridge: disconnected (%s); reconnecting", reason_code)

    def _on_message(self, client, userdata, message: mqtt.MQTTMessage) -> None:
        topic = message.topic

        def ack() -> None:
            client.ack(message.mid, message.qos)

        handler = self._handler_for(topic)
        if handler is None:
            self.stats["unrouted"] += 1
            counter_buffer.add(BRIDGE_MESSAGES, "unrouted")
            ack()
            return
        close_old_connections()
        _current.ack, _current.deferred = ack, False
        try:
            handler(topic, message.payload)
            self.stats["handled"] += 1
            # By handler too, so each replica's stop line says what it handled (replies,
            # presence, ...): how a shared group split the load shows per replica.
            self.stats[f"handled:{getattr(handler, '__name__', 'handler')}"] += 1
        except Exception:
            # A handler that raises has recorded nothing it could redo (presence and
            # trigger messages come again by their nature); acknowledged, or the broker
            # would stop sending once the unacknowledged ones fill its in-flight window.
            self.stats["handler_errors"] += 1
            counter_buffer.add(BRIDGE_MESSAGES, "handler_error")
            log.exception("bridge: handler for %s failed; message dropped", topic)
        finally:
            deferred, _current.ack = _current.deferred, None
        if not deferred:
            ack()

    def _handler_for(self, topic: str) -> Handler | None:
        with self._lock:
            handler = self._dynamic.get(topic)
            dynamic_filters = self._dynamic_filters
        if handler is not None:
            return handler
        for topic_filter, candidate in (*_handlers, *dynamic_filters):
            if mqtt.topic_matches_sub(topic_filter, topic):
                return candidate
        return None

    def dynamic_refresh(self) -> None:
        """Re-read dynamic topics and (un)subscribe the difference."""
        close_old_connections()
        fresh: dict[str, Handler] = {}
        for provider in _providers:
            fresh.update(provider())
        # A dynamic filter equal to a static one (a trigger rule on P/+/done) rides on the
        # static subscription: unsubscribing it when the rule goes would deafen the bridge.
        static = {t for t, _ in _handlers}
        with self._lock:
            added = [t for t in fresh if t not in self._dynamic and t not in static]
            removed = [t for t in self._dynamic if t not in fresh and t not in static]
            self._dynamic = fresh
            self._dynamic_filters = [(t, h) for t, h in fresh.items() if "+" in t or "#" in t]
        if added and self.connected.is_set():
            self.client.subscribe([(self._subscription(t), 1) for t in added])
        if removed and self.connected.is_set():
            self.client.unsubscribe([self._subscription(t) for t in removed])
        if added or removed:
            log.info("bridge: dynamic topics +%d -%d", len(added), len(removed))

    def run(self) -> None:
        """Connect and serve until stop(); survives broker restarts and database hiccups."""
        self._refresh_safely()
        client_connect(self.client)
        try:
            while not self._stop.wait(DYNAMIC_REFRESH_SECONDS):
                self._refresh_safely()
                counter_buffer.flush()  # message counts of a quiet spell reach /metrics too
        finally:
            # Replies grouped but not handed off yet: hand them off and acknowledge them
            # while still connected (what fails now is delivered again next time).
            batchers_flush()
            self.client.disconnect()
            self.client.loop_stop()
            close_old_connections()
            counter_buffer.flush()

    def _refresh_safely(self) -> None:
        try:
            self.dynamic_refresh()
        except Exception:
            # A database outage must not kill the bridge: keep the old topics, try next tick.
            log.exception("bridge: refreshing dynamic topics failed; keeping the previous set")

    def stop(self) -> None:
        self._stop.set()
