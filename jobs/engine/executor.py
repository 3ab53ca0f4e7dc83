"""The executor of one transition: it carries out the `Plan` the planner builds
(jobs/engine/planner.py) — the reads between its stages, the compare-and-set writes, the
lock call, the commit, undoing the lock call when the transaction fails — then publishes
(batch_publish.py) and runs what the plan left for after the commit. The entry points that
read a transition's inputs and plan them are jobs/engine/batch.py's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from functools import partial

from django.db import IntegrityError, transaction
from django.utils import timezone

from devices.flow import device_flow_waits
from devices.lock_recovery import locks_rebuild
from devices.locks import (
    Grant,
    Queued,
    device_lock_dequeue,
    device_lock_handoff,
    device_lock_pass_on,
    device_locks_apply,
)
from devices.models import Device

from ..deadlines import deadlines_key
from ..limits import limits_enabled
from ..models import StepRun
from ..rows import Writes, rows_atomic, rows_select
from . import planner_locks
from .batch_publish import BatchPublish, LastWrites
from .dispatch import cancel_command_send, queued_notice_send
from .effects import Plan, RowWrite
from .holds import window_groups_read
from .plan import step_holder

log = logging.getLogger(__name__)


class BatchConflict(Exception):
    """A row changed under the batch; nothing was written to Redis, apply it again."""


class BatchRetry(Exception):
    """A row changed under the batch after its lock call: undone, the task runs again."""


def transition(
    batch: Executor,
    prepare: Callable[[], None],
    conflicted: Callable[[], None],
    conflicted_what: str,
    later: Mapping[str, Callable[..., None]],
) -> None:
    """The shared shape of a batched transition: `prepare` plans what ended and who moves
    on; then the next rows, the lock call, the dispatches, the events, the commit, the
    publishes; then the one-at-a-time leftovers. A conflict rolls everything back (undoing
    the lock call when it came after it) and hands over to `conflicted` (the batch rolled
    back writes nothing more); `later` says what each of the plan's `Later` entries runs.
    Called inside a caller's transaction (a general-path step
    handing a device on), what follows the commit waits for that transaction's commit."""
    outermost = transaction.get_autocommit()
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
    if outermost:
        _committed(batch, later)
    else:
        transaction.on_commit(partial(_committed, batch, later))


def _committed(batch: Executor, later: Mapping[str, Callable[..., None]]) -> None:
    """After a transition's commit: the cancels and the commands leave, devices whose
    protocol wants to hear of a step joining their queue are told, the events are told,
    then the plan's one-at-a-time leftovers run."""
    try:
        for row in batch.plan.cancels:
            safely(partial(cancel_command_send, row))
        batch.publish()
        for row in batch.plan.queued.values():
            safely(partial(queued_notice_send, row))
    finally:
        batch.events.committed()  # logged and told out once committed, after the commands left
    for work in batch.later_work(later):
        safely(work)


def safely(work: Callable[[], None]) -> None:
    """General-path work after the commit: one failing must not stop the rest."""
    try:
        work()
    except Exception:
        log.exception("after a reply batch: %s failed; the monitor's sweep finds its step again", work)


class Executor(BatchPublish):
    """The executor of one batched transition: it carries out the `Plan` the planner builds
    (jobs/engine/planner.py) — the reads between its stages, the compare-and-set writes, the
    lock calls, the commit — and publishes (batch_publish.py)."""

    def __init__(self, rows: dict[str, StepRun]) -> None:
        self.rows = rows
        self.plan = Plan(now=timezone.now(), limits=limits_enabled())
        self.writes = Writes()  # the plan's writes, queued as they are planned
        self.queued = 0  # how many of plan.writes are in `writes`
        self.outcomes: list = []
        self.later: list[Callable[[], None]] = []  # publish failures' events (batch_publish.py)
        # Where `publish` adds the last Redis writes: the caller's, who sends them with its
        # own commands (the inbox's acknowledgement); None: `publish` sends them itself.
        self.last: LastWrites | None = None
        # What a planned write after the lock call raises when a row moved: the task runs
        # again (BatchRetry), or a fan-out's pump goes one row at a time (BatchConflict).
        self.dispatch_conflict: type[Exception] = BatchRetry

    # The plan's parts publishing reads (batch_publish.py).
    @property
    def events(self):
        return self.plan.events

    @property
    def dispatches(self) -> list[StepRun]:
        return self.plan.dispatches

    @property
    def run_deadlines(self):
        return self.plan.run_deadlines

    def _queue(self, writes: list[RowWrite]) -> None:
        for write in writes:
            conflict = (self.dispatch_conflict if write.after_locks else BatchConflict)(write.conflict)
            self.writes.update(
                write.model,
                write.rows,
                write.fields,
                status_in=write.status_in,
                match=write.match,
                conflict=conflict,
            )

    def _queue_planned(self) -> None:
        self._queue(self.plan.writes[self.queued :])
        self.queued = len(self.plan.writes)

    def rows_name(self) -> None:
        """The runs' next rows and the rows kinds' starts asked for: their devices read and
        their ids reserved with the writes planned so far (one round trip on PostgreSQL,
        every compare-and-set checked before the lock call), then named and asking for
        their locks."""
        names = planner_locks.rows_wanted(self.plan)
        self._queue_planned()
        creating = [new for new in self.plan.creating if new.device is not None]
        reserve = (StepRun, len(self.plan.naming) + len(self.plan.creating))
        found, ids = self.writes.send(select=(Device, "name", names, ()), reserve=reserve)
        self.plan.waits.update(device_flow_waits([*found, *(new.device for new in creating)]))
        self.plan.groups.update(
            window_groups_read(
                [(run, name) for run, _spec, name in self.plan.naming]
                + [(new.run, new.device.name) for new in creating]
            )
        )
        planner_locks.rows_name(self.plan, {device.name: device for device in found}, ids)

    def locks_apply(self) -> None:
        """The one lock call: releases hand devices on, new rows acquire, deadlines written."""
        planner_locks.locks_order(self.plan)
        self.outcomes = device_locks_apply(self.plan.locks, zset=deadlines_key)
        planner_locks.locks_answered(self.plan, self.outcomes)
        # Slots the releases freed (shared concurrency limits) handed other devices on:
        # dispatched in this transaction like the releases' own hand-offs.
        self.plan.handed.extend(self.plan.locks.handed)

    def handed_dispatch(self) -> None:
        """Dispatch, in this transaction, the queued rows the releases handed a device to:
        read, planned, and their deadlines and full lease written in one more lock call."""
        ids = planner_locks.handed_ids(self.plan)
        # (The batch's own new rows handed a device are not in the database yet: the plan
        # has them.)
        rows = {s.pk: s for s in rows_select(StepRun, "id", ids, related=("run", "device"))}
        self.plan.waits.update(device_flow_waits([row.device for row in rows.values() if row.device_id]))
        self.plan.groups.update(
            window_groups_read((r.run, r.device.name) for r in rows.values() if r.device_id)
        )
        writes = planner_locks.handed_plan(self.plan, rows)
        if writes.ops or writes.writes:
            device_locks_apply(writes, zset=deadlines_key)
            # Devices these writes' releases handed on through freed slots: started after the commit.
            self.later += [partial(device_lock_handoff, device, grant) for device, grant in writes.handed]

    def dispatches_write(self) -> None:
        """The new rows, whole (dispatched where the lock call granted their lock, else
        queued), the rows handed a device, and every event: sent together, the last thing
        the transaction does (on PostgreSQL the COMMIT rides in the same text unless a
        handed row's compare-and-set is in it: `Writes.send(last=True)`)."""
        self._queue_planned()
        self.writes.insert(StepRun, self.plan.new_rows)
        self._queue(planner_locks.dispatches_writes(self.plan))
        self.events.sampled_decide()
        self.events.insert(writes=self.writes)
        try:
            self.writes.send(last=True)
        except IntegrityError:
            # Another transition made a next row of one of these runs first.
            raise BatchConflict("a next step's row exists already") from None

    def later_work(self, table: Mapping[str, Callable[..., None]]) -> list[Callable[[], None]]:
        """After the commit: the plan's one-at-a-time leftovers, then the publishes' events."""
        work = [partial(table[later.what], **later.args) for later in self.plan.later]
        if self.plan.rebuild:
            # Redis lost the locks; rebuilding them re-acquires every queued step.
            work.append(locks_rebuild)
        return work + self.later

    def undo(self) -> None:
        """The transaction failed after the lock call: withdraw what it asked for."""
        for device, grant in self.plan.locks.handed:
            # A release's freed slots handed another device on: that holder is started.
            safely(partial(device_lock_handoff, device, grant))
        self.plan.locks.handed = []
        for index, outcome in enumerate(self.outcomes):
            try:
                if index in self.plan.dequeues or index in self.plan.extends:
                    # A row left queued: the monitor's sweep asks for the lock again; an
                    # extended lease runs out on its own.
                    continue
                if index in self.plan.releases:
                    if outcome is not None:
                        device_lock_handoff(self.plan.releases[index].device.name, outcome)
                    continue
                row, _ = self.plan.acquires[index]
                # A re-acquire (the row held the lock already: a hand-off or another
                # transition got there first) took nothing, so it gives nothing back.
                if isinstance(outcome, Grant) and not outcome.held:
                    device_lock_pass_on(row.device.name, holder=step_holder(row), fence=outcome.fence)
                elif isinstance(outcome, Queued) and not outcome.waiting:
                    # A row that was waiting already (asking again) keeps its place.
                    device_lock_dequeue(row.device.name, holder=step_holder(row))
            except Exception:
                log.exception("undoing a failed reply batch; the lock's lease will end it instead")
