"""Grouping items that arrive together, flushed from a thread of their own.

The bridge receives device replies one MQTT message at a time, on paho's network thread.
Handing each to Celery costs a task per message; handing them in groups costs one task
per group and lets the worker apply a group in one transaction. A `Batcher` collects
items and flushes them when `max_items` are waiting, when `idle_seconds` passed without a
new one, or when the oldest has waited `max_wait_seconds`: at low load a group is one
item and waits only `idle_seconds`; under load groups grow by themselves, and a steady
stream still leaves every `max_wait_seconds`.

How it fails: `flush` runs on the batcher's thread; an exception there is logged and that
group is lost (as a handler that raises loses its message). Items still waiting when the
process exits are lost unless `batchers_flush()` runs first (the bridge calls it when it
stops).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

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
        self._items: list[Any] = []
        self._last_add = 0.0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        _batchers.append(self)

    def add(self, item: Any) -> None:
        with self._cond:
            self._items.append(item)
            self._last_add = time.monotonic()
            if len(self._items) == 1:
                self._first_add = self._last_add
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=f"batcher-{self.name}", daemon=True)
                self._thread.start()
            if len(self._items) == 1 or len(self._items) >= self.max_items:
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items:
                    self._cond.wait()
                # Something waits: let more arrive until the group is full or quiet.
                while len(self._items) < self.max_items:
                    due = min(self._last_add + self.idle_seconds, self._first_add + self.max_wait_seconds)
                    remaining = due - time.monotonic()
                    if remaining <= 0:
                        break
                    self._cond.wait(remaining)
                items, self._items = self._items[: self.max_items], self._items[self.max_items :]
                self._first_add = self._last_add
            self._flush(items)

    def _flush(self, items: list[Any]) -> None:
        try:
            self.flush(items)
        except Exception:
            log.exception("batcher %s: flushing %d items failed; they are lost", self.name, len(items))

    def drain(self) -> None:
        """Flush whatever waits now, on the caller's thread."""
        with self._cond:
            items, self._items = self._items, []
        for start in range(0, len(items), self.max_items):
            self._flush(items[start : start + self.max_items])


def batchers_flush() -> None:
    """Flush every batcher of this process (before it exits)."""
    for batcher in _batchers:
        batcher.drain()
