"""Messages held through an outage: handed to their handler again until it goes through.

A bridge handler that fails because the database, Redis or Celery's broker is unreachable
(a restart, a failover) has done nothing it could keep: the message itself is fine. The
bridge then holds it unacknowledged (its broker keeps it for the bridge's session) and this
module hands it to its handler again, after a pause that grows to RETRY_MAX_SECONDS, until
the handler goes through or fails for a reason of its own; only then is it acknowledged.
A device's retained `status` sent while the database was restarting is so applied once it
is back, not lost.

Order is kept per device: while one of a device's messages is held, the device's next
messages wait behind it (an `offline` never overtakes the `online` before it). Other
devices are not held up: their messages are handled as they come, and each device's
pauses are its own.

How it fails: memory is bounded. A device holds at most HELD_PER_DEVICE messages: the
oldest is then dropped for the newest (for status and heartbeats the newest is what
counts); all devices together hold at most HELD_MAX_BYTES of payload, beyond which a new
message is dropped. Dropped means acknowledged and noted (`message_drop_note`, summarized
as a `message.dropped` event). When the bridge stops, what is still held is left
unacknowledged: its broker delivers it again to the bridge's next session (QoS 1; a QoS 0
message has no second delivery).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import kombu.exceptions
import redis.exceptions
from django.db import InterfaceError, OperationalError

log = logging.getLogger(__name__)

# What an outage raises: the database, Redis or Celery's broker (kombu) unreachable or
# restarting. Anything else is the message's own doing and is not tried again.
OUTAGE_ERRORS: tuple[type[BaseException], ...] = (
    OperationalError,
    InterfaceError,
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    kombu.exceptions.OperationalError,
)
# The first pause after a failed try, doubled after each further one up to the maximum: a
# blip costs a fraction of a second, and a server back after an outage is used within seconds.
RETRY_FIRST_SECONDS = 0.25
RETRY_MAX_SECONDS = 4.0
# Messages one device may have held at once: far above what a device sends during a restart
# (a status, a heartbeat every few seconds), low enough that one device cannot fill memory.
HELD_PER_DEVICE = 100
# Payload bytes held for all devices together (the broker's message size limit is 512 KiB).
HELD_MAX_BYTES = 64 * 1024 * 1024


@dataclass
class Held:
    """One message held for another try, and how to acknowledge it once handled."""

    device: str
    topic: str
    payload: bytes
    ack: Callable[[], None]
    since: float = field(default_factory=time.monotonic)


# Tries one held message again: True when that settled it (handled, or failed for a reason
# of its own: either way done, and acknowledged by the caller), False on another outage.
Attempt = Callable[[Held], bool]
# Drops one held message that no longer fits: acknowledge it and note why.
Drop = Callable[[Held, str], None]


class Redelivery:
    """Held messages by device, tried again on a thread of their own (`start`).

    Thread-safe: the MQTT network thread holds messages (`hold`, `hold_behind`); the
    redelivery thread tries them (`attempt`) and removes what is settled.
    """

    def __init__(
        self,
        attempt: Attempt,
        drop: Drop,
        *,
        per_device: int = HELD_PER_DEVICE,
        max_bytes: int = HELD_MAX_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._attempt, self._drop, self._clock = attempt, drop, clock
        self.per_device, self.max_bytes = per_device, max_bytes
        self._queues: dict[str, deque[Held]] = {}
        self._due: dict[str, float] = {}
        self._pause: dict[str, float] = {}
        self._bytes = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # --- the network thread --------------------------------------------------------------

    def hold_behind(self, held: Held) -> bool:
        """Hold `held` when its device already has messages held (True); False: handle it now."""
        # Nothing held (nearly always): no lock. Only this thread adds a device's queue, so
        # an empty dict read here cannot miss one of this device's.
        if not self._queues:
            return False
        with self._cond:
            if held.device not in self._queues:
                return False
            self._append(held)
            return True

    def hold(self, held: Held) -> None:
        """Hold a message whose handler met an outage; its first try comes after a pause."""
        with self._cond:
            if not self._queues:
                log.warning("bridge: a handler met an outage; holding messages to try again (%s)", held.topic)
            if held.device not in self._queues:
                self._pause[held.device] = RETRY_FIRST_SECONDS
                self._due[held.device] = self._clock() + RETRY_FIRST_SECONDS
            self._append(held)
            self._cond.notify()

    def _append(self, held: Held) -> None:
        if self._bytes + len(held.payload) > self.max_bytes:
            self._drop(held, f"held through an outage: the bridge holds {self.max_bytes} bytes already")
            return
        queue = self._queues.setdefault(held.device, deque())
        queue.append(held)
        self._bytes += len(held.payload)
        if len(queue) > self.per_device:
            oldest = queue.popleft()
            self._bytes -= len(oldest.payload)
            self._drop(oldest, f"held through an outage: more than {self.per_device} messages of one device")

    # --- the redelivery thread -----------------------------------------------------------

    def held_count(self) -> int:
        with self._cond:
            return sum(len(queue) for queue in self._queues.values())

    def tick(self) -> float | None:
        """Try every device whose pause is over, each in order until one meets an outage;
        seconds until the next device is due (None: nothing held)."""
        with self._cond:
            now = self._clock()
            due = [device for device, at in self._due.items() if at <= now]
        for device in due:
            self._device_try(device)
        with self._cond:
            if not self._due:
                return None
            return max(0.0, min(self._due.values()) - self._clock())

    def _device_try(self, device: str) -> None:
        while True:
            with self._cond:
                queue = self._queues.get(device)
                if not queue:
                    return
                held = queue[0]
            if not self._attempt(held):
                with self._cond:
                    pause = min(self._pause[device] * 2, RETRY_MAX_SECONDS)
                    self._pause[device] = pause
                    self._due[device] = self._clock() + pause
                return
            with self._cond:
                # `hold` may have dropped the head for a newer message meanwhile.
                if queue and queue[0] is held:
                    queue.popleft()
                    self._bytes -= len(held.payload)
                self._pause[device] = RETRY_FIRST_SECONDS
                if not queue:
                    del self._queues[device], self._due[device], self._pause[device]
                    if not self._queues:
                        log.warning("bridge: every held message went through")
                    return

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="bridge-redelivery", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self.tick()
            with self._cond:
                # Read again under the lock: a message held since the tick is not missed.
                if not self._stopping and not self._due:
                    self._cond.wait()
                elif not self._stopping:
                    wait = min(self._due.values()) - self._clock()
                    if wait > 0:
                        self._cond.wait(wait)
                if self._stopping:
                    return

    def stop(self) -> int:
        """Stop trying; the number of messages left held (their broker delivers them again)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(RETRY_MAX_SECONDS + 1.0)
        return self.held_count()
