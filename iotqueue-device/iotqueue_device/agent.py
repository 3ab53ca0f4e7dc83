"""The device agent: an MQTT client speaking iotqueue's protocol v1.1 around `CommandBook`.

    agent = Agent("lamp-2", "mqtt://broker:1883", password="...", state_dir="/var/lib/lamp")

    @agent.action("firmware/update")
    def update(ctx):
        ctx.progress(10, "downloading", extend_seconds=900)
        ...
        return {"version": "2.1"}

    agent.run_forever()

paho's network thread receives commands, asks CommandBook what to do, saves the state file
and acknowledges; one worker thread runs the handlers, one command at a time, and publishes
their `done`. A command superseded or canceled while its handler runs sends no `done`: the
handler learns it from `ctx.abandoned`, or `ctx.progress` raises `Abandoned`.
"""

from __future__ import annotations

import logging
import queue
import ssl
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, NoReturn
from urllib.parse import unquote, urlsplit

import paho.mqtt.client as mqtt

from . import protocol
from .core import CommandBook, Decision, Verdict
from .state import StateFile

log = logging.getLogger(__name__)

# How often a heartbeat refreshes the device's last-seen (the server writes it at most every
# 15 s, so more often is wasted).
HEARTBEAT_SECONDS = 30.0
# MQTT keepalive: the broker fires the last will ("offline") about 1.5 times this after the
# device goes silent.
KEEPALIVE_SECONDS = 30
# How long stop() waits for the handler in progress to finish before abandoning it (it stays
# in the state file, so the next start asks jobs/get and carries on with it).
STOP_TIMEOUT_SECONDS = 10.0
# How long stop() waits for the broker to confirm the retained "offline".
OFFLINE_CONFIRM_SECONDS = 5.0
# Reconnect back-off bounds: a pause between attempts, as docs/protocol.md asks of firmware.
RECONNECT_MIN_SECONDS, RECONNECT_MAX_SECONDS = 1, 30
DEFAULT_PORTS = {"mqtt": 1883, "mqtts": 8883}

Handler = Callable[["Context"], dict[str, Any] | None]


class Abandoned(Exception):
    """The command stopped on the device's side (superseded, canceled, the agent stopping):
    its handler should return; no `done` is sent for it."""


class Rejected(Exception):
    """Raised by `Context.reject`: the device refuses the command (`"status": "rejected"`)."""


class CommandFailed(Exception):
    """A handler's failure with a say on retrying: `retryable=True` lets the server retry the
    step while it has attempts left. Any other exception is a failure without retry."""

    def __init__(self, error: str, *, retryable: bool = False) -> None:
        super().__init__(error)
        self.retryable = retryable


class Context:
    """What a handler gets: the command, and progress / extend / reject helpers."""

    def __init__(self, agent: Agent, command: protocol.Command, *, resumed: bool) -> None:
        self._agent, self.command, self.resumed = agent, command, resumed
        self.abandoned = threading.Event()
        self._percent: float = 0

    @property
    def id(self) -> str:
        return self.command.id

    @property
    def action(self) -> str:
        return self.command.action

    @property
    def args(self) -> dict[str, Any]:
        return self.command.args

    @property
    def token(self) -> int | None:
        return self.command.token

    def progress(
        self, percent: float, detail: str | None = None, *, extend_seconds: float | None = None
    ) -> None:
        """Report progress (0..100, a text for people); raises Abandoned when the command
        stopped meanwhile, so a loop of progress calls ends by itself."""
        if self.abandoned.is_set():
            raise Abandoned(self.id)
        body = protocol.progress_body(self.id, percent, detail=detail, extend_seconds=extend_seconds)
        self._percent = percent
        if extend_seconds is not None:
            self._agent._book_extend(self.id, time.time() + extend_seconds)
        self._agent._publish("progress", body)

    def extend(self, seconds: float, detail: str | None = None) -> None:
        """Ask for `seconds` more from now (the step's max_extend_seconds bounds it)."""
        self.progress(self._percent, detail, extend_seconds=seconds)

    def reject(self, reason: str) -> NoReturn:
        """Refuse the command: done with `"status": "rejected"`; never retried. Does not return."""
        raise Rejected(reason)


class Agent:
    """One device's connection to iotqueue. Credentials: `password` (user name: the device's
    name), or a client certificate (`certfile`, `keyfile`, with `cafile` to verify the broker);
    without either, the URL's user and password if it has them."""

    def __init__(
        self,
        device: str,
        mqtt_url: str,
        *,
        password: str | None = None,
        certfile: str | None = None,
        keyfile: str | None = None,
        cafile: str | None = None,
        state_dir: str | None = None,
        prefix: str = protocol.DEFAULT_PREFIX,
        heartbeat_seconds: float = HEARTBEAT_SECONDS,
        keepalive: int = KEEPALIVE_SECONDS,
        clock_trusted: bool = True,
        client_id: str | None = None,
    ) -> None:
        self.device, self.topics = device, protocol.Topics(device, prefix)
        self._url = urlsplit(mqtt_url)
        if self._url.scheme not in DEFAULT_PORTS:
            raise ValueError(f"mqtt_url must be mqtt:// or mqtts://, not {mqtt_url!r}")
        self._handlers: dict[str, Handler] = {}
        self._state = StateFile(state_dir, device) if state_dir else None
        saved = self._state.load() if self._state else None
        self._book = CommandBook.restore(saved) if saved else CommandBook()
        self._lock = threading.Lock()
        self._work: queue.Queue[tuple[protocol.Command, bool] | None] = queue.Queue()
        self._contexts: dict[str, Context] = {}
        self._heartbeat_seconds, self._keepalive, self._clock_trusted = (
            heartbeat_seconds,
            keepalive,
            clock_trusted,
        )
        self._stopping = threading.Event()
        self.ready = threading.Event()  # subscribed and jobs/get asked, after each (re)connect
        self._client = self._client_create(client_id or f"{device}-{uuid.uuid4().hex[:8]}")
        self._credentials(password, certfile, keyfile, cafile)
        self._threads: list[threading.Thread] = []

    def action(self, name: str) -> Callable[[Handler], Handler]:
        """Decorator: `@agent.action("firmware/update")` handles that action's commands."""

        def register(handler: Handler) -> Handler:
            self._handlers[name] = handler
            return handler

        return register

    def start(self) -> None:
        """Connect (retrying in the background) and start the worker and heartbeat threads."""
        port = self._url.port or DEFAULT_PORTS[self._url.scheme]
        self._client.connect_async(self._url.hostname or "127.0.0.1", port, keepalive=self._keepalive)
        self._client.loop_start()
        for target, name in ((self._work_loop, "work"), (self._heartbeat_loop, "heartbeat")):
            thread = threading.Thread(
                target=target, name=f"iotqueue-device-{self.device}-{name}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def run_forever(self) -> None:
        """start(), then wait until stop() (from a signal handler or another thread)."""
        self.start()
        self._stopping.wait()

    def stop(self, timeout: float = STOP_TIMEOUT_SECONDS) -> None:
        """Stop gracefully: the handler in progress gets `timeout` seconds to finish (its
        `done` is sent), else it is abandoned and stays in the state file for the next start
        to ask about; then a retained "offline" and a clean disconnect."""
        self._stopping.set()
        self._work.put(None)
        worker = self._threads[0] if self._threads else None
        if worker is not None:
            worker.join(timeout)
        with self._lock:
            for context in self._contexts.values():
                context.abandoned.set()
        info = self._client.publish(self.topics.status, protocol.OFFLINE, qos=1, retain=True)
        try:
            info.wait_for_publish(OFFLINE_CONFIRM_SECONDS)
        except (RuntimeError, ValueError) as exc:
            log.warning("iotqueue-device %s: offline status not confirmed: %s", self.device, exc)
        self._client.disconnect()
        self._client.loop_stop()

    def _client_create(self, client_id: str) -> mqtt.Client:
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id)
        client.will_set(self.topics.status, protocol.OFFLINE, qos=1, retain=True)
        client.reconnect_delay_set(RECONNECT_MIN_SECONDS, RECONNECT_MAX_SECONDS)
        client.on_connect, client.on_subscribe = self._on_connect, self._on_subscribe
        client.on_message, client.on_disconnect = self._on_message, self._on_disconnect
        return client

    def _credentials(
        self, password: str | None, certfile: str | None, keyfile: str | None, cafile: str | None
    ) -> None:
        if self._url.scheme == "mqtts" or certfile or cafile:
            self._client.tls_set(
                ca_certs=cafile, certfile=certfile, keyfile=keyfile, tls_version=ssl.PROTOCOL_TLS_CLIENT
            )
        if password is not None:
            self._client.username_pw_set(self.device, password)
        elif self._url.username:
            self._client.username_pw_set(unquote(self._url.username), unquote(self._url.password or ""))

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log.warning("iotqueue-device %s: connect refused: %s", self.device, reason_code)
            return
        client.subscribe([(self.topics.commands, 1), (self.topics.jobs_current, 1)])
        client.publish(self.topics.status, protocol.ONLINE, qos=1, retain=True)

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:
        if any(code.is_failure for code in reason_codes):
            log.error("iotqueue-device %s: subscription refused: %s", self.device, reason_codes)
            return
        with self._lock:
            self._book.asked()
        # After every (re)connect: what should I be doing? (a reboot lost track, or a command
        # was sent while the device was away)
        client.publish(self.topics.jobs_get, b"{}", qos=1)
        self.ready.set()

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        self.ready.clear()
        if reason_code.is_failure and not self._stopping.is_set():
            log.info("iotqueue-device %s: disconnected (%s), reconnecting", self.device, reason_code)

    def _on_message(self, client, userdata, message: mqtt.MQTTMessage) -> None:
        try:
            if message.topic == self.topics.jobs_current:
                command = protocol.current_parse(message.payload)
                with self._lock:
                    decision = self._book.current(command, self._now())
                    self._decision_apply(decision)
                return
            action = self.topics.action_of(message.topic)
            if action is None:
                return
            command = protocol.command_parse(protocol.json_load(message.payload), action=action)
        except protocol.ProtocolError as exc:
            log.warning("iotqueue-device %s: malformed message on %s: %s", self.device, message.topic, exc)
            return
        with self._lock:
            self._decision_apply(self._book.command(command, self._now()))

    def _decision_apply(self, decision: Decision) -> None:
        """Carry out a decision (lock held): stop superseded handlers, answer what needs an
        answer, queue what runs. The state file is saved before anything is published."""
        for command_id in decision.superseded:
            context = self._contexts.pop(command_id, None)
            if context is not None:
                context.abandoned.set()
        command = decision.command
        if decision.verdict in (Verdict.DUPLICATE, Verdict.STALE, Verdict.EXPIRED) and command:
            log.info(
                "iotqueue-device %s: %s command %s: %s",
                self.device,
                decision.verdict,
                command.id,
                decision.reason,
            )
        if decision.verdict is Verdict.CANCEL:
            self._cancel(decision)
            return
        self._save()
        if decision.verdict is Verdict.DUPLICATE and decision.replay is not None:
            self._publish("done", decision.replay)
        elif decision.verdict is Verdict.RUN and command is not None:
            self._publish("ack", protocol.ack_body(command.id))
            self._work.put((command, decision.resumed))

    def _cancel(self, decision: Decision) -> None:
        """Abort the target if it runs here; answer it "canceled" and the cancel itself ok."""
        target = decision.target or ""
        canceled = protocol.done_failed_body(target, "canceled")
        running = self._book.abandon(target, canceled)
        context = self._contexts.pop(target, None)
        if context is not None:
            context.abandoned.set()
        assert decision.command is not None
        done = protocol.done_ok_body(decision.command.id, {"canceled": running})
        self._book.remember(decision.command.id, done)
        self._save()
        if running:
            self._publish("done", canceled)
        self._publish("done", done)

    def _work_loop(self) -> None:
        """The worker thread: one handler at a time, in arrival order."""
        while (item := self._work.get()) is not None:
            command, resumed = item
            with self._lock:
                if command.id not in self._book.flights or self._stopping.is_set():
                    continue  # superseded or canceled while it waited
                context = self._contexts[command.id] = Context(self, command, resumed=resumed)
            done = self._handler_run(context)
            with self._lock:
                self._contexts.pop(command.id, None)
                if done is None or context.abandoned.is_set() or not self._book.finish(command.id, done):
                    continue
                self._save()
                self._publish("done", done)

    def _handler_run(self, context: Context) -> dict[str, Any] | None:
        """The handler's outcome as a `done` body; None when it was abandoned."""
        handler = self._handlers.get(context.action)
        try:
            if handler is None:
                context.reject(f"unsupported action {context.action!r}")
            result = handler(context)
        except Abandoned:
            return None
        except Rejected as exc:
            return protocol.done_rejected_body(context.id, str(exc))
        except CommandFailed as exc:
            return protocol.done_failed_body(context.id, str(exc), retryable=exc.retryable)
        except Exception as exc:
            log.exception("iotqueue-device %s: handler for %s failed", self.device, context.action)
            return protocol.done_failed_body(context.id, f"{type(exc).__name__}: {exc}")
        if result is not None and not isinstance(result, dict):
            result = {"value": result}
        return protocol.done_ok_body(context.id, result)

    def _heartbeat_loop(self) -> None:
        while not self._stopping.wait(self._heartbeat_seconds):
            if self.ready.is_set():
                self._client.publish(self.topics.heartbeat, protocol.json_bytes({"ts": time.time()}), qos=0)

    def _book_extend(self, command_id: str, until: float) -> None:
        with self._lock:
            self._book.extend(command_id, until)

    def _publish(self, kind: str, body: dict[str, Any]) -> None:
        self._client.publish(self.topics.reply(kind), protocol.json_bytes(body), qos=1)

    def _save(self) -> None:
        """Write the state file (lock held). A failed write is logged: the device goes on, and
        after a reboot jobs/get recovers what the file missed."""
        if self._state is None:
            return
        try:
            self._state.save(self._book.snapshot())
        except OSError as exc:
            log.error("iotqueue-device %s: state file not written: %s", self.device, exc)

    def _now(self) -> float | None:
        return time.time() if self._clock_trusted else None
