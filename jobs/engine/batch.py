"""Replies that arrived together, applied as one transition: one transaction, one lock call.

The bridge groups the replies that arrive together (jobs/replies.py), `run_start` asks
for new runs to start, and a worker takes what has gathered in the inbox
(jobs/inbox.py). For the runs to start and the replies that answer current attempts,
`transition_apply`:

1. reads the rows the replies answer (one SELECT, before the transaction);
2. in one transaction: pending runs start; acks mark their attempts in progress; dones
   end their attempts
   (as jobs/engine/attempts.py decides: succeeded, retrying, failed); runs whose step
   ended move their cursor or end; the rows of their next steps are made, queued, and
   named by ids reserved with those writes (they are not inserted yet);
3. makes one Redis call (devices.locks.device_locks_apply): the ended attempts' locks
   are released, each handing its device to the head of its queue, the new rows acquire
   theirs, and deadlines are set and cleared, a new attempt's only where its lock was
   granted;
4. inserts its new rows whole, dispatched where they got a lock, marks dispatched the
   other runs' rows the releases handed a device to, inserts every event, and commits;
5. publishes every resulting command at once (QoS 1, acknowledgements awaited together),
   then clears their `send` deadlines and counts the metrics in one pipeline; only then
   are the events logged and the lifecycle ones sent out (`EventLog.committed`).

Stages 1 and 2 are in batch_rows.py, 3 and 4 in batch_locks.py, 5 in batch_publish.py: the
methods of `_Batch`, which holds the batch's state.

Anything else is handed, after the commit, to the general one-at-a-time path: a reply
that matches no current attempt (reply.py records it as stale, unknown or foreign), a
run that rolls back, a fan-out or compensation row, a next step of another kind, a
device with flow control.

How it fails: each write is a compare-and-set whose count is checked. If another
transition moved a row first (a cancel, a timeout, a duplicate reply in another batch),
the transaction rolls back before any Redis write and the batch is applied again from a
fresh read (CONFLICT_RETRIES times; when the conflict is a next row another transition
made first, found by the insert after the lock call, the lock call is undone first): the
moved row's reply is then no longer current and goes the general way, the others still
apply together. A batch that keeps conflicting is applied one reply at a time. A database
error after the Redis call rolls the transaction back: the new rows' lock requests are
withdrawn, devices already handed on are dispatched the general way, and the error is
raised so the task runs again (the ended attempts are still in flight in the database, so
the replies apply again; their releases are then stale and change nothing). A worker
killed inside that window leaves a lock held for a row that was never committed; its lease
runs out and the monitor passes it on (devices/lock_recovery.py), and the monitor takes
over the inbox entries the dead worker had read and applies them again (jobs/inbox.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from functools import partial

from django.db import InterfaceError, OperationalError
from django.utils import timezone
from redis.exceptions import RedisError

from devices import protocol
from devices.locks import Grant, LockBatch

from ..deadlines import Deadline
from ..events import EventLog, event_record
from ..inbox import Work
from ..models import JobRun, RunStatus, StepRun, StepStatus
from ..rows import Writes, rows_atomic, rows_select
from .attempts import Outcome
from .batch_locks import BatchLocks, BatchRetry
from .batch_publish import BatchPublish, PipeHook
from .batch_rows import BatchConflict, BatchRows
from .dispatch import Attempt, step_acquire
from .kinds import row_batched
from .plan import RUN_ACTIVE
from .reply import step_reply
from .runs import run_advance, run_finish

log = logging.getLogger(__name__)


# A batch that conflicts is read and applied again this many times before its replies are
# applied one at a time. A conflict is another transition moving one of its rows first
# (in practice an ack whose done another drain applied): the fresh read sees it.
CONFLICT_RETRIES = 1


def inbox_apply(work: Work, *, finally_: PipeHook | None = None) -> None:
    """Apply what a worker took from the inbox (jobs/inbox.py) as one transition.

    `finally_(pipe)` adds Redis commands to the batch's last pipeline, once everything is
    committed and published (the inbox acknowledges its entries there).

    How it fails: a failure that says nothing about the input (TRANSIENT: the database or
    Redis unreachable, a lock conflict) is raised, and the task applies the batch again. Any
    other failure is taken to be one input's doing (a reply or a run the engine cannot
    apply): the batch is applied in halves, and halves of what fails, until each input that
    fails alone is found; those are dropped and recorded (`poison_drop`), everyone else's
    replies and run starts are applied, and `finally_` runs once at the end.
    """
    items = [(device, protocol.Reply(**payload)) for device, payload in work.replies]
    items += [(None, run_id) for run_id in work.starts]
    if not _items_isolate(items, finally_=finally_):
        transition_apply(finally_=finally_)  # nothing left to apply: the inbox's acknowledgement


# Failures of the batch as a whole, not of one of its inputs: applied again, whole.
TRANSIENT = (OperationalError, InterfaceError, RedisError, BatchRetry)


def _items_isolate(items: list[tuple[str | None, object]], *, finally_: PipeHook | None = None) -> bool:
    """Apply `items` as one transition (True); when that fails for a reason of their own,
    apply each half the same way, down to the inputs that fail alone, dropped (False)."""
    try:
        replies = [(device, reply) for device, reply in items if device is not None]
        starts = [run_id for device, run_id in items if device is None]
        transition_apply(replies=replies, starts=starts, finally_=finally_)
        return True
    except TRANSIENT:
        raise
    except Exception as exc:
        if len(items) == 1:
            poison_drop(items[0], exc)
            return False
        log.warning("a batch of %d inputs failed (%r); applying it in halves", len(items), exc)
        half = len(items) // 2
        _items_isolate(items[:half])
        _items_isolate(items[half:])
        return False


def poison_drop(item: tuple[str | None, object], exc: Exception) -> None:
    """An input that fails alone: a reply is dropped (`message.dropped` on its device), a run
    start fails the run; either way with what went wrong, and logged with the traceback."""
    device, subject = item
    what = f"{type(exc).__name__}: {exc}".encode("ascii", "backslashreplace").decode()[:300]
    log.error("inbox: an input failed alone and is dropped: %r", item, exc_info=exc)
    try:
        _poison_record(device, subject, what)
    except Exception:
        # The drop stands (the rest of the batch is applied); only its record is missing.
        log.exception("inbox: recording the dropped input %r failed", item)


def _poison_record(device: str | None, subject: object, what: str) -> None:
    if device is not None:
        reply = subject
        command = reply.command_id.encode("ascii", "backslashreplace").decode()[:200]
        event_record(
            "message.dropped",
            device=device,
            message=f"{reply.kind} for command {command} could not be applied ({what}); dropped",
        )
        return
    # Only a run that never started is failed: one that did (the failure came after its
    # commit) goes on, and the monitor looks after it.
    run = JobRun.objects.filter(pk=subject, status=RunStatus.PENDING).first()
    if run is not None:
        run_finish(run=run, status=RunStatus.FAILED, error=f"the run could not be started ({what})")


def transition_apply(
    *,
    replies: list[tuple[str, protocol.Reply]] = (),
    starts: list[str] = (),
    finally_: PipeHook | None = None,
    retries: int = CONFLICT_RETRIES,
) -> None:
    """Apply replies that arrived together and start pending runs (see the module docstring).

    On a conflict the batch is read and applied again, `retries` times at most, then one
    reply at a time.
    """
    rows = {}
    if replies:
        command_ids = {reply.command_id for _, reply in replies}
        rows = {
            s.command_id: s
            for s in rows_select(StepRun, "command_id", command_ids, related=("run", "device"))
        }
    batch = _Batch(rows)
    if finally_ is not None:
        batch.finally_.append(finally_)

    def prepare() -> None:
        batch.runs_begin(starts)
        batch.classify(replies)
        batch.acks_write()
        batch.ends_write()
        batch.runs_continue()

    def one_at_a_time() -> None:
        for run_id in starts:
            _safely(partial(run_advance, run_id=run_id))
        for device, reply in replies:
            _safely(partial(step_reply, device=device, reply=reply))
        batch.dispatches = []
        batch.publish()  # nothing to publish: runs the caller's `finally_` commands

    def again() -> None:
        transition_apply(replies=replies, starts=starts, finally_=finally_, retries=retries - 1)

    if retries > 0:
        _transition(batch, prepare, again, "applying it again from a fresh read")
    else:
        _transition(batch, prepare, one_at_a_time, "applying one at a time")


# Queued rows `rows_start` takes in one transition: one lock call of this many acquires
# holds Redis for a few milliseconds, and their commands leave together.
ROWS_START_BATCH = 500


def rows_start(step_run_ids: list[int]) -> None:
    """Take the device locks of queued rows (a fan-out's pump) as batched transitions of
    ROWS_START_BATCH rows: one lock call for them all, the granted rows dispatched in one
    transaction, their commands published together; a busy or offline device's row waits
    as `step_acquire` would make it wait. A row without a device, a task row and a device
    with flow control take the general path (`step_acquire`); so does every row of a batch
    in which one moved (canceled) before its dispatch was written.
    """
    for first in range(0, len(step_run_ids), ROWS_START_BATCH):
        _rows_start(step_run_ids[first : first + ROWS_START_BATCH])


def _rows_start(step_run_ids: list[int]) -> None:
    rows = rows_select(StepRun, "id", step_run_ids, related=("run", "device"))
    rows = [row for row in rows if row.status == StepStatus.QUEUED and row.run.status in RUN_ACTIVE]
    general, batched = [], []
    for row in rows:
        flow = row.device_id is not None and (row.device.min_interval_seconds or row.device.max_per_minute)
        (general if row.device_id is None or flow or not row_batched(row) else batched).append(row)
    batch = _Batch({})
    batch.dispatch_conflict = BatchConflict("a queued row moved before its dispatch")

    def prepare() -> None:
        for row in batched:
            batch._acquire(row)

    def one_at_a_time() -> None:
        for row in batched:
            _safely(partial(step_acquire, step_run=row))
        batch.dispatches = []
        batch.publish()

    if batched:
        _transition(batch, prepare, one_at_a_time, "starting its rows one at a time")
    for row in general:
        _safely(partial(step_acquire, step_run=row))


def run_begin(*, run_id: str) -> None:
    """The `run_advance` task: start a run (or its step at the cursor) as one transition."""
    transition_apply(starts=[run_id])


def _transition(
    batch: _Batch, prepare: Callable[[], None], conflicted: Callable[[], None], conflicted_what: str
) -> None:
    """The shared shape of a batched transition: `prepare` writes what ended and who moves
    on; then the next rows, the lock call, the dispatches, the events, the commit, the
    publishes; then the general-path leftovers. A conflict before the lock call rolls
    everything back and hands over to `conflicted` (which runs the caller's `finally_`)."""
    try:
        with rows_atomic():
            prepare()
            batch.rows_name()
            batch.locks_apply()
            batch.handed_dispatch()
            batch.dispatches_write()
    except BatchConflict as conflict:
        log.info("batched transition: %s; %s", conflict, conflicted_what)
        batch.undo()  # nothing to undo unless the conflict came after the lock call
        conflicted()
        return
    except Exception:
        batch.undo()
        raise
    try:
        batch.publish()
    finally:
        batch.events.committed()  # logged and told out once committed, after the commands left
    for work in batch.later:
        _safely(work)


def _safely(work: Callable[[], None]) -> None:
    """General-path work after the commit: one failing must not stop the rest."""
    try:
        work()
    except Exception:
        log.exception("after a reply batch: %s failed; the monitor's sweep finds its step again", work)


class _Batch(BatchRows, BatchLocks, BatchPublish):
    """The state of one batched transition, in the order `_transition` builds it; its stages
    are in batch_rows.py (1, 2), batch_locks.py (3, 4) and batch_publish.py (5)."""

    def __init__(self, rows: dict[str, StepRun]) -> None:
        self.rows = rows
        self.now = timezone.now()
        self.events = EventLog()
        # Compare-and-set writes, sent together before the lock call and before the commit.
        self.writes = Writes()
        self.later: list[Callable[[], None]] = []
        self.acks: dict[int, StepRun] = {}
        self.dones: list[tuple[StepRun, protocol.Reply]] = []
        self.ended: list[tuple[StepRun, Outcome]] = []
        self.moved: list[JobRun] = []
        self.finished: list[JobRun] = []
        self.starting: list[JobRun] = []
        self.new_rows: list[StepRun] = []
        self.locks = LockBatch()
        self.releases: dict[int, StepRun] = {}  # op index -> the row whose attempt ended
        self.acquires: dict[int, tuple[StepRun, Attempt]] = {}  # op index -> new row
        self.outcomes: list = []
        self.handed: list[tuple[str, Grant]] = []
        self.dispatches: list[StepRun] = []
        self.finally_: list[PipeHook] = []
        self.run_deadlines: dict[Deadline, datetime] = {}  # written after the commit
        # What a row that moved before its dispatch write raises (batch_locks.dispatches_write).
        self.dispatch_conflict: Exception = BatchRetry("a dispatched row moved during its reply batch")
