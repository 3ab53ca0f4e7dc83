"""Slots of shared concurrency limits, beside the device locks (devices/lua/transition.lua).

A command a limit applies to (jobs/limits.py) needs one slot of the (limit, label value)
besides its device's lock: `LockBatch.acquire` (devices/locks.py) takes them together, or
the holder waits for the slot with its device left free, and the script hands freed slots
on by priority, then arrival. This module holds what a slot is (`Slot`), where its keys
live, what a batch's script call adds for them (`slots_args`, which devices/locks.py asks:
it sits below the lock's module, never importing it), and the reads of who holds and who
waits (`slot_states`, `slot_counts`, and `slot_state_read` / `slot_state_parse` for a
caller's own pipeline).

A limit's slots per label value live beside the locks, under a hash tag of their own
(`slot_tag`): a holders sorted set (holder -> since ms) and a waiters sorted set (holder ->
priority band, then arrival), and one needs hash for all (holder -> what it needs, read by
the script when it hands a device or a slot on). Those keys are outside the device shards'
hash slots, so slots are only used on a single Redis: on a Redis Cluster an acquire's
slots are left out (logged once) and the limits are not applied.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from iotqueue.redis_conn import lock_redis_connection

log = logging.getLogger(__name__)

# Keys SCAN returns per round trip when counting a limit's slots (as the lock queues' scan,
# devices/locks.py QUEUE_SCAN_BATCH): a few dozen trips for 10,000 label values.
SLOT_SCAN_BATCH = 1000

_slots_cluster_logged = False


@dataclass(frozen=True)
class Slot:
    """One slot a command needs beside its device lock: of the shared concurrency limit
    `limit` for label value `value`, of which at most `most` are held at once."""

    limit: str
    value: str
    most: int


def slot_tag() -> str:
    """The hash tag of every slot key (one of its own, outside the device shards')."""
    return "{" + f"{settings.IOTQUEUE_REDIS_KEY_PREFIX}:slots" + "}"


def slot_keys(limit: str, value: str) -> tuple[str, str]:
    """The holders and the waiters sorted sets of a limit's label value."""
    prefix, tag = settings.IOTQUEUE_REDIS_KEY_PREFIX, slot_tag()
    return f"{prefix}:slot:{tag}:{limit}={value}", f"{prefix}:slotq:{tag}:{limit}={value}"


def slots_args(prefix: str, ops: list[dict], *, cluster: bool) -> dict[int, dict[str, Any]]:
    """What each acquire, release and dequeue of a batch adds for the slots: the needs hash
    key ("n"), and for an acquire with slots their keys ("sl") and the arrival counter ("sq")."""
    global _slots_cluster_logged
    if cluster:
        if not _slots_cluster_logged and any("sl" in op for op in ops):
            log.warning("shared concurrency limits are not applied on a Redis Cluster lock store")
            _slots_cluster_logged = True
        return {index: {"sl": []} for index, op in enumerate(ops) if "sl" in op}
    tag = "{" + f"{prefix}:slots" + "}"
    needs = f"{prefix}:slot-needs:{tag}"
    added: dict[int, dict[str, Any]] = {}
    for index, op in enumerate(ops):
        if op["o"] in ("r", "q") or (op["o"] == "u" and not op.get("sl")):
            added[index] = {"n": needs}
        elif op["o"] in ("a", "u") and op.get("sl"):
            slots = [
                [
                    f"{prefix}:slot:{tag}:{limit}={value}",
                    f"{prefix}:slotq:{tag}:{limit}={value}",
                    most,
                    f"{limit}={value}",
                ]
                for limit, value, most in op["sl"]
            ]
            added[index] = {"n": needs, "sq": f"{prefix}:slot-seq:{tag}", "sl": slots}
    return added


@dataclass(frozen=True)
class SlotState:
    """Who holds a limit's slots for one label value (oldest first) and who waits (in order)."""

    limit: str
    value: str
    holders: list[str]
    waiting: list[str]


def slot_states(pairs: Sequence[tuple[str, str]]) -> dict[tuple[str, str], SlotState]:
    """The SlotState of each (limit, label value), in one round trip. Reads only."""
    if not pairs:
        return {}
    with lock_redis_connection().pipeline(transaction=False) as pipe:
        for limit, value in pairs:
            slot_state_read(limit, value, pipe=pipe)
        replies = pipe.execute()
    n = SLOT_STATE_REPLIES
    return {pair: slot_state_parse(*pair, replies[n * i : n * i + n]) for i, pair in enumerate(pairs)}


def slot_counts(limit: str) -> dict[str, tuple[int, int]]:
    """For each label value of `limit` with slots held or waited for: (held, waiting).

    Finds the keys with SCAN (O(keys in the database): for an admin page, never for the
    engine's hot path) and counts them in one pipeline."""
    conn = lock_redis_connection()
    values: set[str] = set()
    for head in slot_keys(limit, ""):
        # The key prefix and the limit's name are data: escape glob characters.
        pattern = "".join("\\" + c if c in "*?[]\\" else c for c in head) + "*"
        values |= {key[len(head) :] for key in conn.scan_iter(match=pattern, count=SLOT_SCAN_BATCH)}
    if not values:
        return {}
    ordered = sorted(values)
    with conn.pipeline(transaction=False) as pipe:
        for value in ordered:
            held, waiting = slot_keys(limit, value)
            pipe.zcard(held)
            pipe.zcard(waiting)
        replies = pipe.execute()
    return {value: (replies[2 * i], replies[2 * i + 1]) for i, value in enumerate(ordered)}


# Replies `slot_state_read` adds to a pipeline.
SLOT_STATE_REPLIES = 2


def slot_state_read(limit: str, value: str, *, pipe: Any) -> None:
    """Queue the reads of a slot set's state on `pipe` (a pipeline of the lock Redis);
    `slot_state_parse` reads its SLOT_STATE_REPLIES replies."""
    holders, waiters = slot_keys(limit, value)
    pipe.zrange(holders, 0, -1)
    pipe.zrange(waiters, 0, -1)


def slot_state_parse(limit: str, value: str, replies: Sequence[Any]) -> SlotState:
    """The SlotState from the replies `slot_state_read` queued."""
    return SlotState(limit, value, list(replies[0]), list(replies[1]))
