"""Replies that arrived together, applied as one transition: one transaction, one lock call.

The bridge groups the replies that arrive together (jobs/replies.py), `run_start` asks
for new runs to start, and a worker takes what has gathered in the inbox
(jobs/inbox.py). For the runs to start and the replies that answer current attempts,
`transition_apply`:

1. reads the rows the replies answer (one SELECT, before the transaction);
2. in one transaction: pending runs start; acks mark their attempts in progress; dones
   end their attempts
   (as jobs/engine/attempts.py decides: succeeded, retrying, failed); runs whose step
   ended move their cursor or end; the rows of their next steps are inserted, queued;
3. makes one Redis call (devices.locks.device_locks_apply): the ended attempts' locks
   are released, each handing its device to the head of its queue, the new rows acquire
   theirs, and deadlines are set and cleared, a new attempt's only where its lock was
   granted;
4. marks dispatched the rows that got a lock — its own new rows, and other runs' rows the
   releases handed a device to — inserts every event, and commits;
5. publishes every resulting command at once (QoS 1, acknowledgements awaited together),
   then clears their `send` deadlines and counts the metrics in one pipeline.

Anything else is handed, after the commit, to the general one-at-a-time path: a reply
that matches no current attempt (reply.py records it as stale, unknown or foreign), a
run that rolls back, a fan-out or compensation row, a next step of another kind, a
device with flow control.

How it fails: each write is a compare-and-set whose count is checked. If another
transition moved a row first (a cancel, a timeout, a duplicate reply in another batch),
the transaction rolls back before any Redis write and the batch is applied again from a
fresh read (CONFLICT_RETRIES times): the moved row's reply is then no longer current and
goes the general way, the others still apply together. A batch that keeps conflicting is
applied one reply at a time. A database error after the Redis call rolls the transaction back: the new
rows' lock requests are withdrawn, devices already handed on are dispatched the general
way, and the error is raised so the task runs again (the ended attempts are still in
flight in the database, so the replies apply again; their releases are then stale and
change nothing). A worker killed inside that window leaves a lock held for a row that
was never committed; its lease runs out and the monitor passes it on
(devices/lock_recovery.py), and the monitor takes over the inbox entries the dead
worker had read and applies them again (jobs/inbox.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timedelta
from functools import partial
from typing import Any
from uuid import UUID

from django.db import IntegrityError, transaction
from django.utils import timezone

from devices import protocol
from devices.lock_recovery import locks_rebuild
from devices.locks import (
    Grant,
    LockBatch,
    NotReady,
    Queued,
    device_lock_dequeue,
    device_lock_handoff,
    device_lock_pass_on,
    device_locks_apply,
)
from devices.models import Device
from iotqueue.redis_conn import lock_redis_connection, lock_redis_shared, redis_connection

from .. import templating
from ..deadlines import Deadline, by_shard, deadline_score, deadlines_clear, deadlines_key, deadlines_set
from ..events import EventLog, event_record
from ..inbox import Work
from ..models import STEP_IN_FLIGHT, JobRun, OnFailure, Phase, RunStatus, StepKind, StepRun, StepStatus
from ..rows import Writes, rows_create, rows_select
from .attempts import Outcome, attempt_deadlines, attempt_outcome
from .dispatch import Attempt, attempt_new, commands_confirmed, commands_publish, step_dispatch
from .plan import (
    RUN_ACTIVE,
    holder_step_id,
    is_fanout_row,
    is_task_row,
    lease_seconds,
    spec_kind,
    step_args,
    step_holder,
    step_spec,
    step_target_name,
)
from .reply import progress_event, step_reply
from .runs import RUN_STATUS_FOR_STEP, run_advance, run_continue, run_step_enter, step_error

log = logging.getLogger(__name__)

# Fields a batch writes, per kind of row write.
ACK_FIELDS = ["status", "acked_at", "progress"]
END_FIELDS = ["status", "error", "finished_at", "result", "progress", "deadline", "acked_at"]
DISPATCH_FIELDS = [
    "status",
    "attempt",
    "command_id",
    "fence",
    "deadline",
    "dispatched_at",
    "acked_at",
    "progress",
]


# Adds commands to a Redis pipeline; may return a function that is handed the replies
# to those commands (an error as its exception) once the pipeline ran.
PipeHook = Callable[[Any], Callable[[list], None] | None]


# A batch that conflicts is read and applied again this many times before its replies are
# applied one at a time. A conflict is another transition moving one of its rows first
# (in practice an ack whose done another drain applied): the fresh read sees it.
CONFLICT_RETRIES = 1


class BatchConflict(Exception):
    """A row changed under the batch; nothing was written to Redis, apply one at a time."""


class BatchRetry(Exception):
    """A row changed under the batch after its lock call: undone, the task runs again."""


def inbox_apply(work: Work, *, finally_: PipeHook | None = None) -> None:
    """Apply what a worker took from the inbox (jobs/inbox.py) as one transition.

    `finally_(pipe)` adds Redis commands to the batch's last pipeline, once everything is
    committed and published (the inbox acknowledges its entries there).
    """
    replies = [(device, protocol.Reply(**payload)) for device, payload in work.replies]
    transition_apply(replies=replies, starts=work.starts, finally_=finally_)


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
        with transaction.atomic():
            prepare()
            batch.rows_insert()
            batch.locks_apply()
            batch.handed_dispatch()
            batch.dispatches_write()
    except BatchConflict as conflict:
        log.info("batched transition: %s; %s", conflict, conflicted_what)
        conflicted()
        return
    except Exception:
        batch.undo()
        raise
    batch.publish()
    for work in batch.later:
        _safely(work)


def _safely(work: Callable[[], None]) -> None:
    """General-path work after the commit: one failing must not stop the rest."""
    try:
        work()
    except Exception:
        log.exception("after a reply batch: %s failed; the monitor's sweep finds its step again", work)


class _Batch:
    """The state of one batched transition, in the order `_transition` builds it."""

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

    # --- 1. which runs start and which replies this batch applies --------------------

    def runs_begin(self, run_ids: list[str]) -> None:
        """Pending runs start (running, their first step next); any other goes the general way
        (a running run restarts at its cursor: a redelivered start, or the monitor's sweep)."""
        if not run_ids:
            return
        runs = {run.pk: run for run in rows_select(JobRun, "id", run_ids)}
        pending = [run for run in runs.values() if run.status == RunStatus.PENDING]
        for run_id in run_ids:
            run = runs.get(UUID(str(run_id)))
            if run is not None and run.status != RunStatus.PENDING:
                self.later.append(partial(run_advance, run_id=str(run_id)))
        timed: dict[Deadline, datetime] = {}
        for run in pending:
            run.status, run.started_at = RunStatus.RUNNING, self.now
            if run.max_duration:
                run.deadline = self.now + timedelta(seconds=run.max_duration)
                timed[Deadline("run", str(run.pk), 0)] = run.deadline
            self.events.add("run.started", run=run, message=f"{len(run.plan)} steps")
            self.starting.append(run)
        fields = ["status", "started_at", *(["deadline"] if timed else [])]
        self.writes.update(
            JobRun,
            pending,
            fields,
            status_in=(RunStatus.PENDING,),
            conflict=BatchConflict("a run started meanwhile"),
        )
        # max_duration: written after the commit, with the batch's last pipeline (a
        # deadline that fired before the commit would find its run still pending).
        self.run_deadlines.update(timed)

    def classify(self, items: list[tuple[str, protocol.Reply]]) -> None:
        """Replies to current attempts are applied here; the rest go the general way."""
        ending: set[str] = set()
        for device, reply in items:
            step_run = self.rows.get(reply.command_id)
            current = (
                step_run is not None
                and step_run.device_id is not None
                and step_run.device.name == device
                and step_run.status in STEP_IN_FLIGHT
                and reply.command_id not in ending
            )
            if not current or reply.extend_seconds:
                # An extension moves a deadline and a lease: rare, so the general path has it.
                self.later.append(partial(step_reply, device=device, reply=reply))
            elif reply.kind == "done":
                ending.add(reply.command_id)
                self.dones.append((step_run, reply))
            else:
                self._ack(step_run, reply)

    def _ack(self, step_run: StepRun, reply: protocol.Reply) -> None:
        if step_run.status == StepStatus.DISPATCHED:
            step_run.status = StepStatus.IN_PROGRESS
            step_run.acked_at = step_run.acked_at or self.now
            self._zset_remove([Deadline.of(kind, step_run) for kind in ("ack", "send")])
            self.events.add("step.in_progress", step_run=step_run, message=f"{reply.kind} received")
        if reply.progress is not None:
            step_run.progress = reply.progress
        if reply.detail:
            event = progress_event(step_run, reply)
            self.events.add(event.pop("kind"), **event)
        self.acks[step_run.pk] = step_run

    # --- 2. the database writes before the lock call -------------------------------

    def acks_write(self) -> None:
        """Attempts acked in this batch; one that also ends here is written with its end."""
        ending = {step_run.pk for step_run, _ in self.dones}
        rows = [step_run for pk, step_run in self.acks.items() if pk not in ending]
        self.writes.update(
            StepRun,
            rows,
            ACK_FIELDS,
            status_in=STEP_IN_FLIGHT,
            conflict=BatchConflict("an acked attempt ended meanwhile"),
        )

    def ends_write(self) -> None:
        """End the attempts the dones answer; their locks are released in the lock call."""
        for step_run, reply in self.dones:
            outcome = attempt_outcome(
                step_run,
                ok=bool(reply.ok),
                result=reply.result,
                error=reply.error,
                retryable=reply.retryable,
                rejected=reply.rejected,
                now=self.now,
            )
            for field, value in outcome.changes.items():
                setattr(step_run, field, value)
            self.events.add(f"step.{outcome.status}", step_run=step_run, message=outcome.message)
            cleared, retry = attempt_deadlines(step_run, outcome)
            self._zset_remove(cleared)
            self._zset_add(retry)
            index = self.locks.release(
                step_run.device.name, holder=step_holder(step_run), fence=step_run.fence
            )
            self.releases[index] = step_run
            self.ended.append((step_run, outcome))
        self.writes.update(
            StepRun,
            [step_run for step_run, _ in self.dones],
            END_FIELDS,
            status_in=STEP_IN_FLIGHT,
            match="command_id",
            conflict=BatchConflict("an attempt ended meanwhile"),
        )

    def runs_continue(self) -> None:
        """Move on the runs whose step ended for good: next step, end, or the general way."""
        fanouts = set()
        for step_run, outcome in self.ended:
            if outcome.retry:
                continue
            run = step_run.run
            if step_run.phase == Phase.FORWARD and is_fanout_row(step_run):
                # One progress check per fan-out and batch, however many of its rows ended.
                if (run.pk, step_run.index) not in fanouts:
                    fanouts.add((run.pk, step_run.index))
                    self.later.append(partial(run_continue, step_run=step_run))
                continue
            if (
                step_run.phase != Phase.FORWARD
                or run.status != RunStatus.RUNNING
                or run.cursor != step_run.index
            ):
                self.later.append(partial(run_continue, step_run=step_run))
                continue
            policy = run.plan[step_run.index].get("on_failure", OnFailure.ABORT)
            if step_run.status == StepStatus.SUCCEEDED or policy == OnFailure.CONTINUE:
                run.cursor = step_run.index + 1
                if run.cursor >= len(run.plan):
                    self._run_finish(run, RunStatus.SUCCEEDED, "")
                else:
                    self.moved.append(run)
                    self.starting.append(run)
            elif policy == OnFailure.ABORT:
                self._run_finish(
                    run, RUN_STATUS_FOR_STEP.get(step_run.status, RunStatus.FAILED), step_error(step_run)
                )
            else:
                self.later.append(partial(run_continue, step_run=step_run))
        running = (RunStatus.RUNNING,)
        self.writes.update(
            JobRun, self.moved, ["cursor"], status_in=running, conflict=BatchConflict("a run moved meanwhile")
        )
        finished = ["cursor", "status", "error", "finished_at"]
        self.writes.update(
            JobRun,
            self.finished,
            finished,
            status_in=running,
            conflict=BatchConflict("a run ended meanwhile"),
        )

    def _run_finish(self, run: JobRun, status: str, error: str) -> None:
        run.status, run.error, run.finished_at = status, error, self.now
        self.finished.append(run)
        self.events.add(f"run.{status}", run=run, message=error)

    def rows_insert(self) -> None:
        """Queued rows for the runs' next steps; other kinds start the general way."""
        plans = {}
        for run in self.starting:
            if run.cursor >= len(run.plan):
                self.later.append(partial(run_step_enter, run=run, index=run.cursor))
                continue
            spec = run.plan[run.cursor]
            name, _ = step_target_name(run, spec)
            if spec_kind(spec) != StepKind.COMMAND or name is None:
                self.later.append(partial(run_step_enter, run=run, index=run.cursor))
            else:
                plans[run.pk] = (run, spec, name)
        names = {name for _, _, name in plans.values()}
        # The writes queued so far go with this read: one round trip on PostgreSQL, and
        # every compare-and-set is checked before the lock call.
        found = self.writes.send(select=(Device, "name", names, ()))
        devices = {device.name: device for device in found}
        for run, spec, name in plans.values():
            device = devices.get(name)
            try:
                args = step_args(run, spec["args"], device) if device is not None else None
            except templating.TemplateError:
                args = None
            if args is None or not device.enabled or device.min_interval_seconds or device.max_per_minute:
                # A refusal (no such device, a reference with no value) or flow control.
                self.later.append(partial(run_step_enter, run=run, index=run.cursor))
                continue
            row = StepRun(
                run=run,
                phase=Phase.FORWARD,
                index=run.cursor,
                device=device,
                action=spec["action"],
                args=args,
                status=StepStatus.QUEUED,
                queued_at=self.now,
                deadline=self.now + timedelta(seconds=spec["queue_timeout_seconds"]),
            )
            self.new_rows.append(row)
        if not self.new_rows:
            return
        try:
            # No savepoint: a conflict rolls the whole transition back anyway.
            rows_create(StepRun, self.new_rows)
        except IntegrityError:
            raise BatchConflict("a next step's row exists already") from None
        for row in self.new_rows:
            self.events.add("step.queued", step_run=row, message=f"{row.device.name} {row.action}")
            self._acquire(row)

    def _zset_add(self, entries: dict[Deadline, datetime]) -> None:
        """Deadlines the lock call writes whatever its outcomes, each in its shard."""
        for shard, group in by_shard(entries).items():
            self.locks.zset_add({d.member: deadline_score(entries[d]) for d in group}, shard=shard)

    def _zset_remove(self, deadlines: list[Deadline]) -> None:
        for shard, group in by_shard(deadlines).items():
            self.locks.zset_remove([d.member for d in group], shard=shard)

    def _acquire(self, row: StepRun) -> None:
        # In the device's shard, as the lock call writes it (Deadline.of).
        queue = {Deadline.of("queue", row).member: deadline_score(row.deadline)}
        if not row.device.reachable:
            self._zset_add({Deadline.of("queue", row): row.deadline})
            self.events.add("step.waiting", step_run=row, message=f"device {row.device.name} is offline")
            return
        attempt = attempt_new(row, fence=0, now=self.now)
        index = self.locks.acquire(
            row.device.name,
            holder=step_holder(row),
            priority=row.run.priority,
            lease_seconds=lease_seconds(step_spec(row)),
            on_grant={d.member: deadline_score(when) for d, when in attempt.deadlines.items()},
            on_queue=queue,
        )
        self.acquires[index] = (row, attempt)

    # --- 3. the lock call ------------------------------------------------------------

    def locks_apply(self) -> None:
        self.outcomes = device_locks_apply(self.locks, zset=deadlines_key)
        rebuild = False
        for index, outcome in enumerate(self.outcomes):
            if index in self.releases:
                if outcome is not None:
                    self.handed.append((self.releases[index].device.name, outcome))
                continue
            row, attempt = self.acquires[index]
            if isinstance(outcome, Grant):
                self._dispatch(row, attempt, outcome.fence)
            elif isinstance(outcome, Queued):
                self.events.add(
                    "step.waiting", step_run=row, message=f"device busy, position {outcome.position}"
                )
            elif isinstance(outcome, NotReady):
                rebuild = True
        if rebuild:
            # Redis lost the locks; rebuilding them re-acquires every queued step.
            self.later.append(locks_rebuild)

    def _dispatch(self, row: StepRun, attempt: Attempt, fence: int) -> None:
        changes = {**attempt.changes, "fence": fence}
        for field, value in changes.items():
            setattr(row, field, value)
        self.events.add("step.dispatched", step_run=row, message=f"attempt {row.attempt}, fence {fence}")
        self.dispatches.append(row)

    # --- 4. devices handed on, the dispatch writes -----------------------------------

    def handed_dispatch(self) -> None:
        """Dispatch, in this transaction, the queued rows the releases handed a device to.

        Their deadlines and full lease are written in one more round trip before the
        commit. Holders of another kind (a parked Celery task), rows that moved on, task
        steps (they send a Celery task, not a command) and devices with flow control are
        started the general way after the commit.
        """
        handed = [(device, grant, holder_step_id(grant.holder)) for device, grant in self.handed]
        step_ids = {step_id for _, _, step_id in handed if step_id is not None}
        rows = {s.pk: s for s in rows_select(StepRun, "id", step_ids, related=("run", "device"))}
        ready: list[tuple[StepRun, Attempt]] = []
        for device, grant, step_id in handed:
            row = rows.get(step_id)
            if step_id is None:
                self.later.append(partial(device_lock_handoff, device, grant))
            elif (
                row is None
                or row.status != StepStatus.QUEUED
                or row.run.status not in RUN_ACTIVE
                or row.device.min_interval_seconds
                or row.device.max_per_minute
                or is_task_row(row)
            ):
                self.later.append(partial(step_dispatch, step_run_id=step_id, fence=grant.fence))
            else:
                ready.append((row, attempt_new(row, fence=grant.fence, now=self.now)))
        if not ready:
            return
        writes = LockBatch()
        for row, attempt in ready:
            for shard, group in by_shard(attempt.deadlines).items():
                writes.zset_add({d.member: deadline_score(attempt.deadlines[d]) for d in group}, shard=shard)
            queue = Deadline.of("queue", row)
            writes.zset_remove([queue.member], shard=queue.shard)
            writes.extend(
                row.device.name,
                holder=step_holder(row),
                fence=attempt.changes["fence"],
                lease_seconds=lease_seconds(step_spec(row)),
            )
        device_locks_apply(writes, zset=deadlines_key)
        for row, attempt in ready:
            self._dispatch(row, attempt, attempt.changes["fence"])

    def dispatches_write(self) -> None:
        """The dispatched rows and every event of the batch: sent together, before the commit."""
        self.writes.update(
            StepRun,
            self.dispatches,
            DISPATCH_FIELDS,
            status_in=(StepStatus.QUEUED,),
            # A handed row was canceled meanwhile: undo and let the task run again.
            conflict=BatchRetry("a dispatched row moved during its reply batch"),
        )
        self.events.insert(writes=self.writes)
        self.writes.send()

    # --- 5. after the commit ---------------------------------------------------------

    def publish(self) -> None:
        """Publish every command of the batch; clear the `send` checks of those the broker
        has acknowledged by now, count the metrics, run the caller's `finally_` commands
        (the inbox acknowledges the batch's entries there and reads the next ones)."""
        for row, failure in commands_publish(self.dispatches):
            # The `send` deadline re-sends it; the device deduplicates by id.
            self.later.append(partial(event_record, "step.publish_failed", step_run=row, message=failure))
        confirmed = commands_confirmed()
        with redis_connection().pipeline(transaction=False) as pipe:
            # One round trip while the locks share REDIS_URL; else one more, to LOCK_REDIS_URL.
            locks = pipe if lock_redis_shared() else lock_redis_connection().pipeline(transaction=False)
            deadlines_clear(confirmed, pipe=locks)
            deadlines_set(self.run_deadlines, pipe=locks)
            self.events.metrics.pipe_add(pipe)
            takers = []
            for hook in self.finally_:
                start = len(pipe)
                take = hook(pipe)
                if take is not None:
                    takers.append((take, start, len(pipe)))
            # A hook's own commands answer to it, errors included; any other error raises.
            replies = pipe.execute(raise_on_error=False)
            if locks is not pipe:
                locks.execute()
        taken = {i for _, start, end in takers for i in range(start, end)}
        for i, reply in enumerate(replies):
            if i not in taken and isinstance(reply, Exception):
                raise reply
        for take, start, end in takers:
            take(replies[start:end])

    def undo(self) -> None:
        """The transaction failed after the lock call: withdraw what it asked for."""
        for index, outcome in enumerate(self.outcomes):
            try:
                if index in self.releases:
                    if outcome is not None:
                        device_lock_handoff(self.releases[index].device.name, outcome)
                    continue
                row, _ = self.acquires[index]
                if isinstance(outcome, Grant):
                    device_lock_pass_on(row.device.name, holder=step_holder(row), fence=outcome.fence)
                elif isinstance(outcome, Queued):
                    device_lock_dequeue(row.device.name, holder=step_holder(row))
            except Exception:
                log.exception("undoing a failed reply batch; the lock's lease will end it instead")
