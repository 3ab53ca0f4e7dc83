"""The MQTT bridge: one long-lived subscriber that routes device messages to app handlers.

Apps register handlers in AppConfig.ready() (`handler_register` for topic filters under the
prefix, `dynamic_topics_register` for per-device legacy topics that change at runtime), so
this module knows neither devices nor jobs. A handler gets (topic, payload) and must be
quick: validate, correlate, hand off to Celery. A handler that raises is logged and
counted; the bridge keeps running. One that meets an outage (the database, Redis or
Celery's broker unreachable) has its message held and handed to it again once that server
is back (iotqueue/redelivery.py), so a restart loses no status, heartbeat or trigger.

No message is lost while no bridge runs or when one dies: each replica has a persistent
session under a stable client id (MQTT_BRIDGE_CLIENT_ID, by default one per host), so the
broker keeps QoS 1 messages for it while it is away, and a message is acknowledged only
once it was handled — for a handler that hands it on later (a reply joining a batch,
`ack_defer`), once that hand-off succeeded. What was not acknowledged is delivered again
to the replica's next session. Device status (retained) is subscribed outside the shared
group (`shared=False`), since brokers do not deliver retained messages to shared
subscriptions and every replica needs to know who is online.

It cannot go deaf silently. Every paho callback is guarded (an exception is logged, counted
on iotqueue_bridge_callback_errors, and the message still acknowledged). Each filter is
checked before it is subscribed and subscribed on its own, so one filter the broker refuses
(or drops the connection over) is recorded and skipped from then on, not retried forever.
What no guard can catch (a BaseException, a bug in paho) ends paho's network thread: a
watchdog thread sees it and the process exits with NETWORK_THREAD_EXIT_CODE, for its
supervisor to restart it. One device cannot crowd out the others: each device's messages
pass a token bucket (iotqueue/budget.py) before any handler runs, and what is dropped is
counted in memory and reported as summaries from the run loop, never written per message.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as mqtt
from django.conf import settings
from django.db import close_old_connections

from .batching import batchers_flush
from .budget import MessageBudget, drop_summaries_report, drop_tally, message_drop_note
from .health import MESSAGE_STATS, BridgeHeartbeat
from .metrics import COUNTER, Family, counter_buffer, family_declare
from .mqtt import client_connect, client_create
from .redelivery import OUTAGE_ERRORS, Held, Redelivery
from .retained import retained_filter_noted, retained_filters_held
from .topics import filters_overlap, topic_filter_error

log = logging.getLogger(__name__)

Handler = Callable[[str, bytes], None]
TopicProvider = Callable[[], dict[str, Handler]]

# How often the bridge re-reads dynamic topics (devices added or given legacy topics):
# a new device works within this many seconds, without a restart.
DYNAMIC_REFRESH_SECONDS = 2.0
# How often the run loop looks for dropped-message summaries that are due (iotqueue/budget.py
# sums a device's drops per window). A device's first drop wakes it at once.
DROP_REPORT_SECONDS = 0.5
# How often the watchdog looks at paho's network thread. A dead thread means no message is
# handled; a second of that before exiting costs little next to a restart's few seconds.
WATCHDOG_SECONDS = 1.0
# After the network thread died, how long the run loop gets to end in order (flush, close)
# before the watchdog ends the process itself: it may be stuck in a hung database call.
EXIT_GRACE_SECONDS = 10.0
# The exit status when paho's network thread is gone: EX_SOFTWARE (sysexits.h), an internal
# error; non-zero, so systemd, compose and Kubernetes restart the bridge.
NETWORK_THREAD_EXIT_CODE = 70
# A subscription that was the first unanswered one when the broker dropped the connection
# this many times in a row is the broker's objection (Mosquitto disconnects over a malformed
# filter): it is refused from then on. Twice, so one broker restart mid-subscribe is not.
SUBSCRIBE_STRIKES = 2
# After each connection, devices' budgets hold this many times their burst for this long:
# the broker replays at once what it kept for the bridge's session while it was away (a
# device with a long flash reporting progress every second has hundreds queued after a few
# minutes), which must not be taken for a flood and dropped, its `done` with it.
RECONNECT_SURGE_SECONDS = 60.0
RECONNECT_SURGE_FACTOR = 10.0

# What became of each message the bridge received. The bridge counts what it decides
# itself; apps add the outcomes their handlers decide (`family_values_add`).
BRIDGE_MESSAGES = family_declare(
    Family(
        "iotqueue_bridge_messages",
        "Messages the bridge received, by what became of them. 'accepted' replies were valid and handed "
        "to the engine, which may still find them stale, unknown or from a foreign device. 'over_budget': "
        "dropped unread, its device over IOTQUEUE_DEVICE_MESSAGE_RATE. 'held': its handler met an outage "
        "(database, Redis, Celery's broker); held unacknowledged and handed to it again.",
        COUNTER,
        ("kind",),
        ("unrouted", "handler_error", "over_budget", "held"),
    )
)
BRIDGE_CALLBACK_ERRORS = family_declare(
    Family(
        "iotqueue_bridge_callback_errors",
        "Exceptions caught in the bridge's MQTT callbacks outside any handler (the bridge went on).",
        COUNTER,
        ("callback",),
        ("message", "ack", "connect", "subscribe", "disconnect", "pre_connect"),
    )
)
BRIDGE_FILTERS_REFUSED = family_declare(
    Family(
        "iotqueue_bridge_filters_refused",
        "Topic filters the bridge does not subscribe to: 'invalid' (a broker would refuse it), "
        "'device_topic' (a dynamic filter on a device's reply, status, heartbeat or jobs/get topic), "
        "'broker' (the broker refused it or dropped the connection over it).",
        COUNTER,
        ("reason",),
        ("invalid", "device_topic", "broker"),
    )
)
BRIDGE_NETWORK_THREAD_LOST = family_declare(
    Family(
        "iotqueue_bridge_network_thread_lost",
        "The bridge found paho's MQTT network thread dead and exited to be restarted.",
        COUNTER,
    )
)

_handlers: list[tuple[str, Handler]] = []
_unshared: set[str] = set()
_providers: list[TopicProvider] = []
# The acknowledgement of the message being handled on this thread (see ack_defer).
_current = threading.local()


def handler_register(topic_filter: str, handler: Handler, *, shared: bool = True) -> None:
    """Route messages matching `topic_filter` (MQTT wildcards allowed) to `handler`.

    The device a message counts against (its budget, its dropped-message summary) is the
    topic level the filter's first `+` matches (P/+/done: the device's name).
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


def message_again() -> bool:
    """True while a handler is given a message again (its first call met an outage and the
    message was held, iotqueue/redelivery.py): a handler's own budget charged it then."""
    return getattr(_current, "again", False)


def bridge_client_id() -> str:
    """This replica's stable client id: MQTT_BRIDGE_CLIENT_ID, or <prefix>-bridge-<host>."""
    return settings.MQTT_BRIDGE_CLIENT_ID or f"{settings.MQTT_CLIENT_ID_PREFIX}-bridge-{socket.gethostname()}"


def dynamic_topics_register(provider: TopicProvider) -> None:
    """`provider()` returns {topic or filter: handler}; re-read every DYNAMIC_REFRESH_SECONDS.

    The static handlers always win: a dynamic topic or filter that overlaps a registered
    filter (a device's reply, status, heartbeat or jobs/get topic) is refused, never
    subscribed. A handler may carry a `budget_key` attribute (a legacy device's reply topic
    names its device); otherwise an exact topic counts as its own device, and a filter's
    messages share one budget.
    """
    if provider not in _providers:
        _providers.append(provider)


def wildcard_device(topic_filter: str, topic: str) -> str:
    """The level of `topic` that `topic_filter`'s first `+` matches (P/+/done -> the device);
    the filter itself when it has no `+`."""
    levels = topic.split("/")
    for position, level in enumerate(topic_filter.split("/")):
        if level == "+":
            return levels[position] if position < len(levels) else ""
    return topic_filter


def _guarded(callback: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Run a paho callback so that an Exception is logged and counted, never raised into paho
    (which would end its network thread: the bridge deaf, with nothing said)."""

    def decorate(method: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(method)
        def guarded(self: Bridge, *args: Any) -> None:
            try:
                method(self, *args)
            except Exception:
                self.stats[f"callback_error:{callback}"] += 1
                counter_buffer.add(BRIDGE_CALLBACK_ERRORS, callback)
                log.exception("bridge: the %s callback failed; carrying on", callback)

        return guarded

    return decorate


class Bridge:
    """Subscribes to every registered topic and dispatches each message to its handler."""

    def __init__(self) -> None:
        # A persistent session: the broker keeps this replica's subscriptions and messages
        # while it is away; acknowledged by hand, after each message's hand-off.
        self.client = client_create("bridge", client_id=bridge_client_id(), clean_session=False)
        self.client.manual_ack_set(True)
        self.client.on_pre_connect = self._on_pre_connect
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.on_subscribe = self._on_subscribe
        self.client.on_message = self._on_message
        self.stats: Counter[str] = Counter()
        self.connected = threading.Event()
        self.budget = MessageBudget(
            rate=settings.IOTQUEUE_DEVICE_MESSAGE_RATE, burst=settings.IOTQUEUE_DEVICE_MESSAGE_BURST
        )
        # Non-zero once the bridge decided to exit for a restart (the command exits with it).
        self.exit_code = 0
        self._stop = threading.Event()
        self._finished = threading.Event()
        self._dynamic: dict[str, Handler] = {}
        # The wildcard entries of _dynamic, matched one by one (few: e.g. trigger rules).
        self._dynamic_filters: list[tuple[str, Handler]] = []
        # Filters never subscribed again, with why; subscriptions waiting for their SUBACK
        # (mid -> filter, in the order sent); strikes against a filter (SUBSCRIBE_STRIKES).
        self.refused: dict[str, str] = {}
        self._pending: dict[int, str] = {}
        self._strikes: Counter[str] = Counter()
        self._refusals_uncounted: list[str] = []
        self._lock = threading.Lock()
        # paho's network thread, learnt from inside it at its first connection attempt.
        self._network_thread: threading.Thread | None = None
        # Messages whose handler met an outage, handed to it again from a thread of their own.
        self.held = Redelivery(self._again, self._held_drop)

    def _subscription(self, topic: str) -> str:
        group = settings.MQTT_SHARED_GROUP
        return f"$share/{group}/{topic}" if group and topic not in _unshared else topic

    # --- paho callbacks (network thread) ---------------------------------------------------

    @_guarded("pre_connect")
    def _on_pre_connect(self, client, userdata) -> None:
        # The public way to know paho's thread: its callbacks run on it.
        self._network_thread = threading.current_thread()

    @_guarded("connect")
    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log.error("bridge: broker refused connection: %s", reason_code)
            return
        # Subscribing here (not once at start) makes every reconnect resubscribe; except the
        # retained filters a session the broker kept holds already, whose resubscription
        # would replay every device's status ahead of the replies queued meanwhile.
        held = retained_filters_held(bridge_client_id(), session_present=bool(flags.session_present))
        with self._lock:
            self._pending.clear()
            topics = [t for t, _ in _handlers if t not in held] + list(self._dynamic)
        # The broker now delivers what it kept for this session while the bridge was away.
        self.budget.surge(seconds=RECONNECT_SURGE_SECONDS, factor=RECONNECT_SURGE_FACTOR)
        try:
            sent = self._subscribe(topics)
            log.info("bridge: connected, subscribed to %d topic filters", sent)
        finally:
            self.connected.set()  # so that dynamic_refresh subscribes what this missed

    @_guarded("disconnect")
    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        self.connected.clear()
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        # The broker answers subscriptions in order: the first unanswered one is what it
        # dropped the connection over (Mosquitto does so for a malformed filter). The
        # built-in device filters are checked by the project and never struck off: a
        # network blip while they wait must not leave the bridge deaf to devices.
        static = {t for t, _ in _handlers}
        suspect = next((topic for topic in pending if topic not in static), None)
        if suspect is not None:
            self._strikes[suspect] += 1
            if self._strikes[suspect] >= SUBSCRIBE_STRIKES:
                why = f"the broker dropped the connection on subscribing to it ({reason_code})"
                self._refuse(suspect, "broker", why)
        if not self._stop.is_set():
            log.warning("bridge: disconnected (%s); reconnecting", reason_code)

    @_guarded("subscribe")
    def _on_subscribe(self, client, userdata, mid, reason_code_list, properties) -> None:
        with self._lock:
            topic = self._pending.pop(mid, None)
        if topic is None:
            return
        self._strikes.pop(topic, None)
        failures = [code for code in reason_code_list if code.is_failure]
        if failures and topic in {t for t, _ in _handlers}:
            # The broker's access rules do not let this bridge hear devices: a deployment
            # error, said loudly on every connect rather than struck off for good.
            log.critical("bridge: the broker refused the device filter %r (%s)", topic, failures[0])
        elif failures:
            self._refuse(topic, "broker", f"the broker refused the subscription ({failures[0]})")
        elif topic in _unshared:
            retained_filter_noted(bridge_client_id(), topic)

    def _on_message(self, client, userdata, message: mqtt.MQTTMessage) -> None:
        # Guarded by hand: whatever fails, the message is still acknowledged (an unacknowledged
        # one holds a slot of the broker's in-flight window for this session for good).
        try:
            deferred = self._message_dispatch(message)
        except Exception:
            deferred = False
            self.stats["callback_error:message"] += 1
            counter_buffer.add(BRIDGE_CALLBACK_ERRORS, "message")
            log.exception("bridge: handling a message failed outside its handler; message dropped")
        if not deferred:
            self._ack(message)

    def _ack(self, message: mqtt.MQTTMessage) -> None:
        try:
            self.client.ack(message.mid, message.qos)
        except Exception:
            self.stats["callback_error:ack"] += 1
            counter_buffer.add(BRIDGE_CALLBACK_ERRORS, "ack")
            log.exception("bridge: acknowledging message %s failed", message.mid)

    def _message_dispatch(self, message: mqtt.MQTTMessage) -> bool:
        """Route, budget and hand one message to its handler; True when the handler deferred
        its acknowledgement (ack_defer)."""
        topic = message.topic
        route = self._route(topic)
        if route is None:
            self.stats["unrouted"] += 1
            counter_buffer.add(BRIDGE_MESSAGES, "unrouted")
            return False
        handler, device = route
        if not self.budget.admit(device):
            self.stats["over_budget"] += 1
            counter_buffer.add(BRIDGE_MESSAGES, "over_budget")
            message_drop_note(
                device=device,
                reason="over budget",
                message=self._over_budget_text(),
                topic=topic,
                size=len(message.payload),
            )
            return False
        ack = functools.partial(self._ack, message)
        held = Held(device=device, topic=topic, payload=message.payload, ack=ack)
        if self.held.hold_behind(held):
            return True  # behind the device's held messages, in order
        outcome = self._handler_run(handler, held, again=False)
        if outcome == "outage":
            self.stats["held"] += 1
            counter_buffer.add(BRIDGE_MESSAGES, "held")
            self.held.hold(held)
            return True
        return outcome == "deferred"

    def _handler_run(self, handler: Handler, held: Held, *, again: bool) -> str:
        """Call `handler`: "handled", "deferred" (it acknowledges later, ack_defer), "outage"
        (it met one: nothing done, try again) or "failed" (logged, dropped)."""
        close_old_connections()
        _current.ack, _current.deferred, _current.again = held.ack, False, again
        try:
            handler(held.topic, held.payload)
            self.stats["handled"] += 1
            # By handler too, so each replica's stop line says what it handled (replies,
            # presence, ...): how a shared group split the load shows per replica.
            self.stats[f"handled:{getattr(handler, '__name__', 'handler')}"] += 1
            return "deferred" if _current.deferred else "handled"
        except OUTAGE_ERRORS as exc:
            # The database, Redis or Celery's broker is away: the message is fine, held.
            log.debug("bridge: handler for %s met an outage (%r)", held.topic, exc)
            return "outage"
        except Exception:
            # A handler that raises has recorded nothing it could redo (presence and
            # trigger messages come again by their nature); acknowledged, or the broker
            # would stop sending once the unacknowledged ones fill its in-flight window.
            self.stats["handler_errors"] += 1
            counter_buffer.add(BRIDGE_MESSAGES, "handler_error")
            log.exception("bridge: handler for %s failed; message dropped", held.topic)
            return "failed"
        finally:
            _current.ack, _current.again = None, False

    def _again(self, held: Held) -> bool:
        """The redelivery thread's try of a held message: True once it is settled."""
        route = self._route(held.topic)
        if route is None:  # its dynamic topic is gone meanwhile
            held.ack()
            return True
        outcome = self._handler_run(route[0], held, again=True)
        if outcome == "outage":
            return False
        if outcome != "deferred":
            held.ack()
        return True

    def _held_drop(self, held: Held, why: str) -> None:
        self.stats["held_dropped"] += 1
        device, size = held.device, len(held.payload)
        message_drop_note(device=device, reason="held too long", message=why, topic=held.topic, size=size)
        held.ack()

    def _over_budget_text(self) -> str:
        return (
            f"over the device's message budget ({self.budget.rate:g}/s, bursts of {self.budget.burst:g}): "
            "dropped unread"
        )

    def _route(self, topic: str) -> tuple[Handler, str] | None:
        """The handler for `topic` and the device it counts against, or None.

        The static handlers come first: a device's replies, status, heartbeat and jobs/get
        are theirs whatever dynamic topics exist. Then exact dynamic topics, then filters.
        """
        for topic_filter, handler in _handlers:
            if mqtt.topic_matches_sub(topic_filter, topic):
                return handler, wildcard_device(topic_filter, topic)
        with self._lock:
            handler = self._dynamic.get(topic)
            dynamic_filters = self._dynamic_filters
        if handler is not None:
            return handler, getattr(handler, "budget_key", None) or topic
        for topic_filter, candidate in dynamic_filters:
            if mqtt.topic_matches_sub(topic_filter, topic):
                return candidate, getattr(candidate, "budget_key", None) or topic_filter
        return None

    def _handler_for(self, topic: str) -> Handler | None:
        route = self._route(topic)
        return route[0] if route is not None else None

    # --- subscriptions ------------------------------------------------------------------------

    def _subscribe(self, topics: list[str]) -> int:
        """Subscribe to each filter in its own SUBSCRIBE (refused ones skipped); how many were sent.

        One per packet, so the broker's SUBACK (or its dropping the connection) points at
        the one filter it objects to.
        """
        sent = 0
        for topic in topics:
            if topic in self.refused:
                continue
            problem = topic_filter_error(self._subscription(topic))
            if problem:
                self._refuse(topic, "invalid", str(problem))
                continue
            try:
                with self._lock:
                    result, mid = self.client.subscribe(self._subscription(topic), qos=1)
                    if result == mqtt.MQTT_ERR_SUCCESS:
                        self._pending[mid] = topic
                        sent += 1
            except ValueError as exc:  # paho's own check of the filter
                self._refuse(topic, "invalid", str(exc))
        return sent

    def _refuse(self, topic: str, reason: str, why: str) -> None:
        """Never subscribe to `topic` again: recorded (log, metric) once."""
        with self._lock:
            if topic in self.refused:
                return
            self.refused[topic] = why
            self._dynamic.pop(topic, None)
            self._dynamic_filters = [(t, h) for t, h in self._dynamic_filters if t != topic]
            # Counted from the run loop (`_report_safely`): no Redis round trip from here.
            self._refusals_uncounted.append(reason)
        log.error("bridge: not subscribing to %r: %s", topic, why)

    def _dynamic_refusal(self, topic: str, static: list[str]) -> tuple[str, str] | None:
        """Why a dynamic topic or filter must not be subscribed, as (reason, text), or None."""
        problem = topic_filter_error(topic)
        if problem:
            return "invalid", str(problem)
        for topic_filter in static:
            if filters_overlap(topic, topic_filter):
                return "device_topic", f"it overlaps {topic_filter}, which belongs to devices"
        return None

    def dynamic_refresh(self) -> None:
        """Re-read dynamic topics and (un)subscribe the difference."""
        close_old_connections()
        fresh: dict[str, Handler] = {}
        for provider in _providers:
            fresh.update(provider())
        static = [t for t, _ in _handlers]
        for topic in fresh:
            if topic not in self.refused:
                refusal = self._dynamic_refusal(topic, static)
                if refusal:
                    self._refuse(topic, *refusal)
        accepted = {t: h for t, h in fresh.items() if t not in self.refused}
        with self._lock:
            added = [t for t in accepted if t not in self._dynamic]
            removed = [t for t in self._dynamic if t not in accepted]
            self._dynamic = accepted
            self._dynamic_filters = [(t, h) for t, h in accepted.items() if "+" in t or "#" in t]
        if added and self.connected.is_set():
            self._subscribe(added)
        if removed and self.connected.is_set():
            self.client.unsubscribe([self._subscription(t) for t in removed])
        if added or removed:
            log.info("bridge: dynamic topics +%d -%d", len(added), len(removed))

    # --- the run loop and the watchdog -------------------------------------------------------------

    def run(self) -> None:
        """Connect and serve until stop(); survives broker restarts and database hiccups.

        How it fails: when paho's network thread dies, the watchdog stops this loop and
        sets `exit_code` (the command exits with it); a database outage only delays the
        dynamic topics and the dropped-message summaries.
        """
        self._refresh_safely()
        client_connect(self.client)
        watchdog = threading.Thread(target=self._watch, name="bridge-watchdog", daemon=True)
        watchdog.start()
        # Liveness for `manage.py healthcheck bridge` (iotqueue/health.py), off the message path.
        heartbeat = BridgeHeartbeat(bridge_client_id(), self._health_state, log)
        heartbeat.start()
        self.held.start()
        refreshed = time.monotonic()
        try:
            while not self._stop.is_set():
                drop_tally.first_noted.wait(DROP_REPORT_SECONDS)
                self._report_safely()
                if time.monotonic() - refreshed >= DYNAMIC_REFRESH_SECONDS:
                    refreshed = time.monotonic()
                    self._refresh_safely()
                    self.budget.idle_forget()
                    counter_buffer.flush()  # message counts of a quiet spell reach /metrics too
        finally:
            heartbeat.stop()
            if left := self.held.stop():
                log.warning("bridge: %d held messages left unacknowledged (delivered again later)", left)
            # Replies grouped but not handed off yet: hand them off and acknowledge them
            # while still connected (what fails now is delivered again next time).
            batchers_flush()
            self._report_safely()
            self.client.disconnect()
            self.client.loop_stop()
            close_old_connections()
            counter_buffer.flush()
            self._finished.set()

    def _health_state(self) -> tuple[bool, bool, int]:
        """(connected, paho's network thread alive, messages received so far), for the heartbeat."""
        thread = self._network_thread
        messages = sum(self.stats.get(name, 0) for name in MESSAGE_STATS)
        return self.connected.is_set(), thread is None or thread.is_alive(), messages

    def _watch(self) -> None:
        """The watchdog: exit for a restart once paho's network thread is gone.

        How it fails: a network thread that hangs (alive, but blocked) is not seen here; the
        broker's keepalive then drops the session and the health check's last-message age
        tells. A run loop that does not end within EXIT_GRACE_SECONDS is cut short (os._exit).
        """
        while not self._stop.wait(WATCHDOG_SECONDS):
            thread = self._network_thread
            if thread is not None and not thread.is_alive():
                self._network_thread_lost()
                return

    def _network_thread_lost(self) -> None:
        counter_buffer.add(BRIDGE_NETWORK_THREAD_LOST)
        counter_buffer.flush()
        log.critical(
            "bridge: the MQTT network thread has died, no message can be received; exiting with status %d "
            "so the supervisor restarts the bridge",
            NETWORK_THREAD_EXIT_CODE,
        )
        self.exit_code = NETWORK_THREAD_EXIT_CODE
        self._stop.set()
        if not self._finished.wait(EXIT_GRACE_SECONDS):
            log.critical("bridge: the run loop did not end in %ss; exiting now", EXIT_GRACE_SECONDS)
            logging.shutdown()
            os._exit(NETWORK_THREAD_EXIT_CODE)

    def _refresh_safely(self) -> None:
        try:
            self.dynamic_refresh()
        except Exception:
            # A database outage must not kill the bridge: keep the old topics, try next tick.
            log.exception("bridge: refreshing dynamic topics failed; keeping the previous set")

    def _report_safely(self) -> None:
        with self._lock:
            refusals, self._refusals_uncounted = self._refusals_uncounted, []
        for reason in refusals:
            counter_buffer.add(BRIDGE_FILTERS_REFUSED, reason)
        try:
            drop_summaries_report()
        except Exception:
            log.exception("bridge: reporting dropped messages failed")

    def stop(self) -> None:
        self._stop.set()
