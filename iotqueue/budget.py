"""Per-device fairness at the bridge: message budgets (token buckets) and dropped-message tallies.

One device must not be able to crowd out the others (DESIGN.md decision 10). Each device
has a token bucket at the bridge (`MessageBudget`): a message over it is dropped before any
handler runs, and only counted in memory. Every message the bridge or a handler drops
(over budget, malformed) is noted in a `DropTally`, never written per message: the bridge's
run loop turns the tally into a few summaries per device and window (`summaries_take`) and
hands them to the sinks the apps registered (`drop_sink_register`; jobs writes them as
`message.dropped` events), so a flood costs the database a row per device every window,
not a row per message.

This module is plumbing: it knows neither devices nor jobs, only keys and counts.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

# After a (device, reason)'s first drop is reported, its further drops are summed and
# reported at most once per this many seconds: a device flooding for an hour adds ~360 rows,
# not millions, and an operator still sees within seconds that it started.
DROP_WINDOW_SECONDS = 10.0
# A device's drops are told apart by reason (garbage, over budget, an unknown kind...) up to
# this many reasons per device and window; further reasons fold into one "other" entry, so
# a device cannot grow the tally by varying its garbage.
REASONS_PER_DEVICE = 4
# At most this many (device, reason) entries wait in memory (~200 bytes each, ~4 MB): far
# above a fleet's devices misbehaving at once; beyond it drops are only counted and logged.
TALLY_MAX_ENTRIES = 20_000
# Buckets of devices that have been quiet this long are forgotten (they would be full again
# anyway), so the bridge's memory follows the devices that talk, not every device ever seen.
BUCKET_IDLE_SECONDS = 60.0
# The reason drops beyond REASONS_PER_DEVICE are filed under.
OTHER_REASONS = "other reasons"


class MessageBudget:
    """Token buckets keyed by device: `rate` messages per second, bursts up to `burst`.

    Thread-safe: the MQTT network thread admits, the bridge's run loop forgets idle buckets.
    How it fails: it does not; a key never seen gets a full bucket. Buckets live in this
    process only, so N bridge replicas sharing the load admit up to N times the rate.
    """

    def __init__(self, *, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError(f"a message budget needs rate > 0 and burst >= 1, not {rate} and {burst}")
        self.rate, self.burst = rate, burst
        self._clock = clock
        self._buckets: dict[str, list[float]] = {}  # key -> [tokens, when they were counted]
        self._lock = threading.Lock()
        # Idle buckets are forgotten by `admit` itself now and then, so a budget nobody
        # sweeps (a handler's own) stays as small as the set of devices that talk.
        self._next_sweep = clock() + BUCKET_IDLE_SECONDS
        self._surge_until, self._surge_burst = 0.0, burst

    def admit(self, key: str) -> bool:
        """Take one token from `key`'s bucket; False (and nothing taken) when it is empty."""
        now = self._clock()
        if now >= self._next_sweep:
            self._next_sweep = now + BUCKET_IDLE_SECONDS
            self.idle_forget()
        burst = self._surge_burst if now < self._surge_until else self.burst
        with self._lock:
            bucket = self._buckets.get(key)
            if bucket is None:
                self._buckets[key] = [burst - 1, now]
                return True
            tokens = min(burst, bucket[0] + (now - bucket[1]) * self.rate)
            bucket[1] = now
            if tokens < 1:
                bucket[0] = tokens
                return False
            bucket[0] = tokens - 1
            return True

    def surge(self, *, seconds: float, factor: float) -> None:
        """For the next `seconds`, buckets hold up to `factor` times the burst: what a device
        sent while nobody read it (a bridge away, restarting) arrives at once, and is its
        normal rate spread over the time it waited, not a flood. The time away is credited
        as it would have been, up to that larger burst."""
        self._surge_until = self._clock() + seconds
        self._surge_burst = self.burst * factor

    def idle_forget(self) -> int:
        """Forget buckets untouched for BUCKET_IDLE_SECONDS; how many were forgotten."""
        cutoff = self._clock() - BUCKET_IDLE_SECONDS
        with self._lock:
            idle = [key for key, (_, seen) in self._buckets.items() if seen < cutoff]
            for key in idle:
                del self._buckets[key]
        return len(idle)

    def __len__(self) -> int:
        return len(self._buckets)


@dataclass
class DropSummary:
    """What one device (or "" for a message of no device) had dropped for one reason."""

    device: str
    reason: str
    count: int
    # The last dropped message's own description, topic and size (an example, not a list).
    message: str
    topic: str
    size: int
    seconds: float  # over how long `count` was gathered


@dataclass
class _Entry:
    count: int = 0
    message: str = ""
    topic: str = ""
    size: int = 0
    started: float = 0.0
    reported: bool = False


class DropTally:
    """Dropped messages counted in memory per (device, reason), reported as summaries.

    `note` is cheap (a dict update under a lock): safe on the bridge's network thread at
    any message rate. `summaries_take` gives, per (device, reason), the first drop at once
    (`first_noted` wakes the taker) and the rest summed once per DROP_WINDOW_SECONDS;
    entries quiet for a window go.
    How it fails: beyond TALLY_MAX_ENTRIES new entries are counted in `overflow` only (the
    bridge logs them); a sink that raises loses that window's summaries (logged).
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._entries: dict[tuple[str, str], _Entry] = {}
        self._reasons: dict[str, int] = {}  # device -> distinct reasons held
        self._lock = threading.Lock()
        self.overflow = 0
        # Set when a (device, reason) drops its first message: the bridge's run loop wakes
        # and reports it at once (sums of further drops wait for their window).
        self.first_noted = threading.Event()

    def note(self, *, device: str, reason: str, message: str, topic: str, size: int) -> None:
        """One message dropped: `reason` groups it (a short fixed phrase), `message` says why."""
        with self._lock:
            entry = self._entries.get((device, reason))
            if entry is None:
                if self._reasons.get(device, 0) >= REASONS_PER_DEVICE:
                    reason = OTHER_REASONS
                    entry = self._entries.get((device, reason))
                if entry is None:
                    if len(self._entries) >= TALLY_MAX_ENTRIES:
                        self.overflow += 1
                        return
                    entry = self._entries[(device, reason)] = _Entry(started=self._clock())
                    self._reasons[device] = self._reasons.get(device, 0) + 1
                    self.first_noted.set()
            entry.count += 1
            entry.message, entry.topic, entry.size = message, topic, size

    def summaries_take(self) -> list[DropSummary]:
        """Summaries due now: a (device, reason)'s first drops, and each window's sum after."""
        now = self._clock()
        due: list[DropSummary] = []
        with self._lock:
            self.first_noted.clear()
            for key, entry in list(self._entries.items()):
                elapsed = now - entry.started
                if entry.count and (not entry.reported or elapsed >= DROP_WINDOW_SECONDS):
                    summary = DropSummary(
                        key[0], key[1], entry.count, entry.message, entry.topic, entry.size, elapsed
                    )
                    due.append(summary)
                    entry.count, entry.started, entry.reported = 0, now, True
                elif not entry.count and elapsed >= DROP_WINDOW_SECONDS:
                    del self._entries[key]
                    self._reasons[key[0]] -= 1
                    if not self._reasons[key[0]]:
                        del self._reasons[key[0]]
        return due

    def __len__(self) -> int:
        return len(self._entries)


DropSink = Callable[[list[DropSummary]], None]
_sinks: list[DropSink] = []

# The process's tally: the bridge's handlers note here, the bridge's run loop reports it.
drop_tally = DropTally()


def drop_sink_register(sink: DropSink) -> None:
    """`sink(summaries)` records dropped-message summaries (e.g. as events); called from the
    bridge's run loop, never per message."""
    if sink not in _sinks:
        _sinks.append(sink)


def message_drop_note(*, device: str, reason: str, message: str, topic: str, size: int) -> None:
    """A bridge handler dropped a message: counted here, reported in the next summary.

    `reason` is a short fixed phrase that groups drops ("malformed", "over budget");
    `message` the drop's own description (kept as the summary's example).
    """
    drop_tally.note(device=device, reason=reason, message=message, topic=topic, size=size)


def drop_summaries_report(tally: DropTally = drop_tally) -> int:
    """Hand the tally's due summaries to every sink; how many summaries there were.

    How it fails: a sink that raises is logged and the next one still runs; its summaries
    are lost (the per-message counts on /metrics are not).
    """
    summaries = tally.summaries_take()
    if tally.overflow:
        overflow, tally.overflow = tally.overflow, 0
        log.warning("bridge: %d dropped messages not summarized (tally full)", overflow)
    if not summaries:
        return 0
    for sink in _sinks:
        try:
            sink(summaries)
        except Exception:
            log.exception("bridge: recording %d dropped-message summaries failed", len(summaries))
    if not _sinks:
        for summary in summaries:
            device, count, reason = summary.device or "-", summary.count, summary.reason
            log.warning("bridge: %s dropped %d messages (%s): %s", device, count, reason, summary.message)
    return len(summaries)
