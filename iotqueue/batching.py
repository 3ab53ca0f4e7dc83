"""Grouping items that arrive together, flushed from a thread of their own.

The bridge receives device replies one MQTT message at a time, on paho's network thread.
Handing each to Celery costs a task per message; handing them in groups costs one task
per group and lets the worker apply a group in one transaction. A `Batcher` collects
items and flushes them when `max_items` are waiting, when `idle_seconds` passed without a
new one, or when the oldest has waited `max_wait_seconds`: at low load a group is one
item and waits only `idle_seconds`; under load groups grow by themselves, and a steady
stream still leaves every `max_wait_seconds`. An item added as `urgent` (one that nothing
is expected to follow, such as a device's `done`) flushes its group at once, with whatever
gathered before it.

Each item may bring a `settled` callback, called once its group was flushed: the bridge
acknowledges a device's MQTT message only then.

How it fails: `flush` runs on the batcher's thread; an exception there is logged and the
same group is flushed again, after a pause that grows to RETRY_MAX_SECONDS, until it goes
through (items added meanwhile wait behind it). Its items are not settled meanwhile, so
the bridge's broker keeps their messages; if the process dies first, they are delivered
again to its next session. `batchers_flush()` flushes what waits when the process stops
(once: what still fails then is left to that redelivery).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

# Pauses between attempts to flush a group that failed: short first (a blip), then at
# most this long (an outage), so a recovered server is used within seconds.
RETRY_FIRST_SECONDS = 0.1
RETRY_MAX_SECONDS = 2.0

Settled = Callable[[], None]

_batchers: list[Batcher] = []


class Batcher:
    """Collects items from any thread; `flush(items)` gets them in arrival order."""

    def __init__(
        self,
        flush: Callable[[list[Any]], None],
        *,
        max_items: int,
        idle_seconds: float,
        max_wait_seconds: float,
        name: str,
    ):
        if max_items < 1 or idle_seconds < 0 or max_wait_seconds < idle_seconds:
            raise ValueError("a batcher needs max_items >= 1 and 0 <= idle_seconds <= max_wait_seconds")
        self.flush = flush
        self.max_items = max_items
        self.idle_seconds = idle_seconds
        self.max_wait_seconds = max_wait_seconds
        self._first_add = 0.0
        self.name = name
        self._items: list[tuple[Any, Settled | None]] = []
        self._stopping = threading.Event()
        self._last_add = 0.0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._urgent = False
        _batchers.append(self)

    def add(self, item: Any, settled: Settled | None = None, *, urgent: bool = False) -> None:
        """Queue `item`; `settled()` is called (on the batcher's thread) once it was flushed.

        `urgent`: flush the group now instead of waiting for it to be quiet."""
        with self._cond:
            self._items.append((item, settled))
            self._last_add = time.monotonic()
            if len(self._items) == 1:
                self._first_add = self._last_add
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=f"batcher-{self.name}", daemon=True)
                self._thread.start()
            self._urgent = self._urgent or urgent
            if len(self._items) == 1 or len(self._items) >= self.max_items or urgent:
                self._cond.notify()

    def waiting(self) -> int:
        """Items added and not flushed yet, the group being flushed (or tried again) aside."""
        with self._cond:
            return len(self._items)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items:
                    self._cond.wait()
                # Something waits: let more arrive until the group is full, quiet or urgent.
                while len(self._items) < self.max_items and not self._urgent:
                    due = min(self._last_add + self.idle_seconds, self._first_add + self.max_wait_seconds)
                    remaining = due - time.monotonic()
                    if remaining <= 0:
                        break
                    self._cond.wait(remaining)
                group, self._items = self._items[: self.max_items], self._items[self.max_items :]
                self._first_add = self._last_add
                self._urgent = self._urgent and bool(self._items)  # an urgent item may be left over
            pause = RETRY_FIRST_SECONDS
            while not self._flush(group) and not self._stopping.wait(pause):
                pause = min(pause * 2, RETRY_MAX_SECONDS)

    def _flush(self, group: list[tuple[Any, Settled | None]]) -> bool:
        """Flush one group and settle its items; False (logged) when the flush raised."""
        try:
            self.flush([item for item, _ in group])
        except Exception:
            log.exception("batcher %s: flushing %d items failed; trying again", self.name, len(group))
            return False
        for _, settled in group:
            if settled is not None:
                settled()
        return True

    def drain(self) -> None:
        """Flush whatever waits now, once, on the caller's thread; stop retrying."""
        self._stopping.set()
        with self._cond:
            group, self._items = self._items, []
        for start in range(0, len(group), self.max_items):
            self._flush(group[start : start + self.max_items])


def batchers_flush() -> None:
    """Flush every batcher of this process (before it exits)."""
    for batcher in _batchers:
        batcher.drain()
