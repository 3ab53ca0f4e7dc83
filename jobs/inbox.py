"""The engine's inbox: device replies and run starts, handed to the workers in a Redis stream.

The bridge appends each group of replies that arrived together, and `run_start` each run
it created (on commit), to one stream, and wakes a worker with one `jobs.step_replies`
task — only if no wake-up is outstanding (a flag set with NX that the draining task keeps
alive), so one task at a time drains the stream (and, while a backlog lasts, one
helper beside it). It takes what waits (up to IOTQUEUE_REPLY_BATCH_MAX entries) through a
consumer group, applies it
as one batched transition (jobs/engine/batch.py), acknowledges it, and takes again until
the stream is empty or its time slice is over. Under saturation batches thus grow by
themselves, with no Celery message per reply or run and no two batches competing for the
same rows; at low load a batch is the one reply that woke the worker. The stream's
mechanics (wake flag, consumer group, take-over) are iotqueue/workstream.py's; the drain
loop, its linger and its helper are this module's.

How it fails: an entry is acknowledged only after its batch committed and published: the
drain sends the batch's last Redis writes (the `LastWrites` that applying it returns) in
one pipeline with the acknowledgement and its next read, once `apply` returned. An
input the engine cannot apply (a poison reply or run) never takes its batch down: the
engine applies the batch in halves and drops only what fails alone, recorded
(jobs/engine/batch.py `inbox_apply`). A worker that dies (or whose batch raised, e.g. with
the database away) leaves the entries it took pending under its
consumer name; a retried task takes its own pending entries again first, and the monitor
re-claims entries pending longer than workstream.RECLAIM_IDLE_SECONDS from consumers that
are gone. A lost wake-up (its worker died before draining) is covered by the flag's
expiry: the next entry appended after it sends a new one. Redis losing the stream loses
what was in it, as it would lose Celery's queue: replies' attempts time out and are
retried, and the monitor's sweep starts runs that stayed pending.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from celery import current_app

from iotqueue.redis_conn import redis_connection
from iotqueue.workstream import WAKE_TTL_MS, WorkStream

log = logging.getLogger(__name__)

DRAIN_TASK = "jobs.step_replies"
INBOX = WorkStream("inbox", DRAIN_TASK)
GROUP = INBOX.group
# One task drains for at most this long, then hands over to a new task, so it never nears
# Celery's time limits and other tasks get the worker too.
DRAIN_SECONDS = 2.0


@dataclass
class Work:
    """What a batch of entries asks for: replies [[device, payload], ...] and runs to start."""

    replies: list[list] = field(default_factory=list)
    starts: list[str] = field(default_factory=list)


class Applied(Protocol):
    """What applying a batch leaves to write to Redis (the engine's `LastWrites`), sent by
    the inbox in the pipeline of its acknowledgement."""

    def execute(self, pipe: Any) -> list:
        """Send the writes after the commands on `pipe`; returns the replies to those."""


# apply(work): applies a batch, committed and published when it returns; raises when the
# batch as a whole failed (its entries stay pending and are applied again).
Apply = Callable[[Work], Applied]


# A summary names at most this many runs, steps or devices, then "+N more".
SUMMARY_ITEMS = 10


def replies_enqueue(replies: list[list]) -> None:
    """Bridge side: append a group of replies [[device, payload], ...]; wake a worker if due.

    A drain task it sends carries what woke it as its `argsrepr` (`wake: size=1, steps=[…],
    devices=[…]`), built only then, from the replies alone (no row is read)."""
    INBOX.append(
        redis_connection(),
        {"r": json.dumps(replies, separators=(",", ":"))},
        summary=lambda: "wake: " + summary_text(work_summary(Work(replies=replies))),
    )


def run_enqueue(run_id: str) -> None:
    """Ask for a run (created and committed) to be started; wake a worker if due."""
    INBOX.append(redis_connection(), {"s": run_id}, summary=lambda: f"wake: size=1, runs=[{run_id}]")


def _bounded(values: list) -> str:
    """`[a, b]`: the distinct values in order, at most SUMMARY_ITEMS of them, then `+N more`."""
    distinct = list(dict.fromkeys(str(value) for value in values))
    shown = distinct[:SUMMARY_ITEMS]
    if len(distinct) > SUMMARY_ITEMS:
        shown.append(f"+{len(distinct) - SUMMARY_ITEMS} more")
    return "[" + ", ".join(shown) + "]"


def _command_step(payload: Any) -> str | None:
    """The step run id a reply's command id starts with (`<step run>-<attempt>-<hex>`)."""
    command_id = payload.get("command_id") if isinstance(payload, dict) else None
    head = str(command_id or "").split("-", 1)[0]
    return head if head.isdigit() else None


def work_summary(work: Work) -> dict[str, int | str]:
    """What a batch holds, for people: `size` (replies and run starts), the `runs` it starts,
    the `steps` (step run ids, from the replies' command ids) and `devices` it answers for;
    each list bounded (`_bounded`), an empty one left out. String building only, no row read."""
    fields: dict[str, int | str] = {"size": len(work.replies) + len(work.starts)}
    steps = [step for step in (_command_step(reply[-1]) for reply in work.replies if reply) if step]
    devices = [reply[0] for reply in work.replies if reply]
    for name, values in (("runs", work.starts), ("steps", steps), ("devices", devices)):
        if values:
            fields[name] = _bounded(values)
    return fields


def summary_text(fields: dict[str, int | str]) -> str:
    """`size=2, steps=[12, 13], devices=[gate-1]`: a summary as a Celery argsrepr."""
    return ", ".join(f"{name}={value}" for name, value in fields.items())


def _work(entries: list[tuple[str, dict]]) -> Work:
    work = Work()
    for _, fields in entries:
        if not fields:
            continue  # deleted meanwhile
        if "r" in fields:
            work.replies.extend(json.loads(fields["r"]))
        if "s" in fields:
            work.starts.append(fields["s"])
    return work


def entries_done(ids: list[str], pipe: Any) -> None:
    """Acknowledge and delete applied entries (joins the caller's pipeline)."""
    INBOX.done(ids, pipe)


def _batch_acknowledge(
    conn: Any, ids: list[str], applied: Applied, *, count: int, helper: bool, read: bool
) -> list[tuple[str, dict]] | None:
    """Send the batch's last writes, `entries_done` and (with `read`) the drain's next
    read in one round trip; returns what the read found (None: nothing was read, or the
    read failed; the drain reads again)."""
    with conn.pipeline(transaction=False) as pipe:
        entries_done(ids, pipe)
        if read:
            INBOX.read_queue(pipe, count=count, helper=helper)
        replies = applied.execute(pipe)
    if not read or isinstance(replies[-1], Exception):
        return None
    return INBOX.entries_of(replies[-1])


def inbox_drain(
    apply: Apply,
    *,
    batch_max: int,
    linger_ms: int,
    retried: bool,
    helper: bool = False,
    on_batch: Callable[[Work], None] | None = None,
) -> int:
    """Worker side: take, apply and acknowledge entries until none wait; returns entries.

    When the inbox is empty the drain waits up to `linger_ms` for a next entry before it
    returns (0: not at all). A read that comes back full (`batch_max` entries: a backlog)
    calls in one `helper` drain, a second worker process that shares the backlog and returns
    as soon as it finds the inbox empty. A raise in `apply`
    leaves the entries it got pending (the task is retried). Within the time slice, one
    pipeline after each batch sends its last writes, acknowledges its entries and reads
    the next ones (one round trip); entries read that way are applied even when the
    slice ended meanwhile (they are pending under this consumer: a new task would not
    read them). `on_batch(work)` is called with each batch before it is applied (the
    task's batch event).
    """
    conn = redis_connection()
    count = max(1, batch_max)
    done = 0
    own_pending = retried
    stop = time.monotonic() + DRAIN_SECONDS
    read_next: list[tuple[str, dict]] | None = None  # what the last batch's pipeline read
    while True:
        if read_next is not None:
            entries, read_next = read_next, None
        elif time.monotonic() < stop:
            entries = INBOX.read(conn, count=count, own_pending=own_pending, helper=helper)
        else:
            break
        if not entries and own_pending:
            own_pending = False
            continue
        if not entries and helper:
            conn.delete(INBOX.wake_key(helper=True))
            return done
        if not entries and linger_ms:
            # Stay a moment: at a steady trickle the next entry comes before a new task would.
            entries = INBOX.read(conn, count=count, own_pending=False, block_ms=linger_ms)
        if not entries:
            entries = INBOX.read(conn, count=count, own_pending=False, last=True)
        if not entries:
            return done
        if (
            len(entries) == count
            and not helper
            and conn.set(INBOX.wake_key(helper=True), "1", nx=True, px=WAKE_TTL_MS)
        ):
            current_app.signature(DRAIN_TASK, kwargs={"helper": True}).delay()
        ids = [entry_id for entry_id, _ in entries]
        read = time.monotonic() < stop  # the last batch of this slice reads nothing more
        work = _work(entries)
        if on_batch is not None:
            on_batch(work)
        applied = apply(work)
        read_next = _batch_acknowledge(conn, ids, applied, count=count, helper=helper, read=read)
        done += len(entries)
    # Time slice over with entries perhaps still waiting: hand the drain to a new task
    # (its wake flag stays set, so it is the only one of its kind).
    current_app.signature(DRAIN_TASK, kwargs={"helper": helper}).delay()
    return done


def inbox_reclaim(apply: Apply, *, count: int) -> int:
    """Monitor side: apply entries left pending by consumers that are gone; returns entries."""
    conn = redis_connection()
    entries = INBOX.reclaim(conn, count=count, consumer="reclaim")
    if not entries:
        return 0
    ids = [entry_id for entry_id, _ in entries]
    applied = None
    try:
        applied = apply(_work(entries))
    except Exception:
        log.exception("inbox: re-claimed entries %s failed again; dropping them", ids)
    finally:
        # Acknowledged even when applying failed again (`apply` raises only what failed the
        # batch as a whole, e.g. the database away; one input at fault is dropped by it
        # alone): an entry that fails twice would otherwise come back forever; its attempts
        # end by their own deadlines and its runs are found by the monitor's sweep.
        with conn.pipeline(transaction=False) as pipe:
            entries_done(ids, pipe)
            replies = pipe.execute() if applied is None else applied.execute(pipe)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
    return len(entries)
