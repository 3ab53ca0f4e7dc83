"""How long a step would take, computed from its plan entry and the devices' queues; no I/O.

A fan-out's finish is replayed pump by pump with the pump's own arithmetic
(jobs/engine/rollout_pace.py `rollout_pace`, `rollout_room`): a pump runs when a row ends and
when the oldest start of the rate's window leaves it, exactly the two occasions the engine
pumps on. Rows start in device-name order (the order the fan-out writes them in). The
preview takes the mean of such replays over where the monitor's tick falls
(`fanout_expected_seconds`).
"""

from __future__ import annotations

import heapq
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .choices import WaveGate
from .engine.rollout_pace import RATE_WINDOW, rollout_counts_notified, rollout_pace, rollout_room

# A step's duration when no recent succeeded row of its action says better: a command
# round trip to a device that answers at once takes well under this, and an estimate should
# rather be a little late than promise a finish the fleet cannot keep.
DEFAULT_STEP_SECONDS = 2.0
# Recent succeeded rows of an action the typical duration is the median of: enough to
# smooth one slow device out, few enough to follow a firmware that got faster.
TYPICAL_SAMPLE_ROWS = 50
# Pumps replayed at most: every pump starts a row or ends one, so a fleet of
# IOTQUEUE_FANOUT_MAX_DEVICES takes at most twice that many (and a bit).
ESTIMATE_MAX_PUMPS = 250_000
# Lateness values fanout_expected_seconds replays a fan-out at, spread over one monitor tick:
# enough that no one lattice of pump instants decides the estimate, few enough that a
# 100,000-device preview replays in well under a second each.
TICK_PHASES = 4
# Seconds two replayed instants may differ by and still be one: `start + window - window`
# need not equal `start` in floating point, and a start must leave its window when due.
INSTANT = 1e-6


@dataclass(frozen=True)
class RowTiming:
    """One device's row once the pump starts it: seconds until it ends, and whether it ends
    succeeded (a device that stays offline times out in the queue instead)."""

    seconds: float
    succeeds: bool = True


def typical_seconds(durations: Sequence[float], *, timeout_seconds: float) -> tuple[float, str]:
    """(seconds, source): the median of recent durations, or DEFAULT_STEP_SECONDS when there
    are none ("default"); never more than the step's timeout (it would time out first)."""
    if durations:
        seconds, source = statistics.median(durations), "recent_median"
    else:
        seconds, source = DEFAULT_STEP_SECONDS, "default"
    return min(seconds, float(timeout_seconds)), source


def row_timing(*, ahead: int, reachable: bool, typical: float, queue_timeout: float) -> RowTiming:
    """A device's row: `ahead` commands queued before it, each taking about `typical`; a row
    that waits longer than the queue timeout (or for a device that stays offline) times out."""
    if not reachable:
        return RowTiming(float(queue_timeout), succeeds=False)
    wait = ahead * typical
    if wait >= queue_timeout:
        return RowTiming(float(queue_timeout), succeeds=False)
    return RowTiming(wait + typical)


def fanout_finish_seconds(
    spec: Mapping[str, Any], rows: Sequence[RowTiming], *, deadline_lateness: float = 0.0
) -> float | None:
    """Seconds from the fan-out's start until its last row ends, replaying its pumps; None
    when ESTIMATE_MAX_PUMPS pumps do not start every row (no estimate rather than a wrong one).

    `deadline_lateness`: how much later than due a pump that waits for the rate's window
    runs (the monitor claims due deadlines once a tick: half a tick on average). A pump at
    a row's end runs at once."""
    max_in_flight = spec.get("max_in_flight") or 0
    notified = rollout_counts_notified(spec)
    at_work: list[tuple[float, bool]] = []  # (end, succeeds), soonest first
    recent: deque[tuple[float, int]] = deque()  # (start, rows started), within RATE_WINDOW
    now, started, succeeded, last_end = 0.0, 0, 0, 0.0
    for _ in range(ESTIMATE_MAX_PUMPS):
        while at_work and at_work[0][0] <= now + INSTANT:
            succeeded += heapq.heappop(at_work)[1]
        allowed, window = rollout_pace(spec, started if notified else succeeded)
        while recent and recent[0][0] <= now - RATE_WINDOW.total_seconds() + INSTANT:
            recent.popleft()
        cutoff = now - window.total_seconds() + INSTANT
        in_window = [(start, count) for start, count in recent if start > cutoff]
        room = rollout_room(
            rows=len(rows) - started,
            max_in_flight=max_in_flight,
            in_flight=len(at_work),
            rollout_per_minute=allowed,
            started_in_window=sum(count for _, count in in_window) if allowed else 0,
        )
        for row in rows[started : started + room]:
            heapq.heappush(at_work, (now + row.seconds, row.succeeds))
            last_end = max(last_end, now + row.seconds)
        if room:
            recent.append((now, room))
            in_window.append((now, room))
            started += room
        if started >= len(rows):
            return last_end
        oldest = in_window[0][0] if allowed and in_window else None
        now = _next_pump(now, at_work, oldest, window.total_seconds() + deadline_lateness)
    return None


def fanout_expected_seconds(
    spec: Mapping[str, Any], rows: Sequence[RowTiming], *, tick: float = 0.0
) -> float | None:
    """The fan-out's finish averaged over where the monitor's tick falls: the mean of
    fanout_finish_seconds with a window's pump late by each of TICK_PHASES lateness values
    spread over one `tick` (the midpoints of its quarters for 4); None when one replay is.

    A due deadline is claimed at the first tick after it, so a pump that waits for the
    rate's window runs late by anything from 0 to a tick. One replay at the mean lateness
    (half a tick) lines every pump up on a half-tick lattice, and a row duration on that
    lattice (the default 2 s against a ramp's 1-s windows) resonates with it: each row's end
    finds its window freed at that very instant, a tie no engine pump meets, and the replay
    finished 13-18 % sooner than at 2.01 or 1.99 s (bench/preview_eta.py). The finish is
    not linear in the lateness, so the mean of the finishes is the estimate, not the finish
    at the mean lateness. `tick` 0: the plain replay (pumps on time)."""
    if tick <= 0:
        return fanout_finish_seconds(spec, rows)
    finishes = [
        fanout_finish_seconds(spec, rows, deadline_lateness=tick * (phase + 0.5) / TICK_PHASES)
        for phase in range(TICK_PHASES)
    ]
    if any(seconds is None for seconds in finishes):
        return None
    return sum(finishes) / TICK_PHASES


def _next_pump(now: float, at_work: list[tuple[float, bool]], oldest: float | None, window: float) -> float:
    """When the engine pumps next: a row's end, or (`window` after it) the window's oldest
    start having left it."""
    due = [at_work[0][0]] if at_work else []
    if oldest is not None:
        due.append(oldest + window)
    return max(now, min(due)) if due else now


@dataclass(frozen=True)
class WavesEstimate:
    """A fan-out in waves: its finish (None: no estimate), the soak it includes, and the
    gates between waves that wait for people (their time is not in `seconds`)."""

    seconds: float | None
    waves: int
    soak_seconds: int
    approval_gates: int


def waves_finish_seconds(
    spec: Mapping[str, Any],
    rows: Sequence[RowTiming],
    assigned: Sequence[int],
    waves: Sequence[Mapping[str, Any]],
    *,
    tick: float = 0.0,
) -> WavesEstimate:
    """A fan-out in waves (jobs/engine/waves.py `waves_expand` gives `assigned` and `waves`):
    each wave estimated as fanout_expected_seconds estimates a fan-out, one after the other, with
    each soak between them; an auto or webhook gate adds nothing, an approval gate is counted
    for the reader to add. A ramp is replayed from its base in each wave (the engine's goes
    on counting across waves): for a ramped rollout the estimate errs long, never short."""
    total, soak, approvals = 0.0, 0, 0
    for number, wave in enumerate(waves):
        seconds = fanout_expected_seconds(
            spec, [row for row, w in zip(rows, assigned, strict=True) if w == number], tick=tick
        )
        if seconds is None:
            return WavesEstimate(None, len(waves), 0, 0)
        total += seconds
        if number < len(waves) - 1:
            soak += wave.get("soak_seconds") or 0
            approvals += wave.get("gate") == WaveGate.APPROVAL
    return WavesEstimate(total + soak, len(waves), soak, approvals)
