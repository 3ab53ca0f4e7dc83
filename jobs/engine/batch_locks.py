"""Stages 3 and 4 of a batched transition (jobs/engine/batch.py): the lock call, the devices
it handed on, the dispatch writes; and undoing the lock call when the transaction fails.
"""

from __future__ import annotations

import logging
from functools import partial

from django.db import IntegrityError

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

from ..deadlines import Deadline, by_shard, deadline_score, deadlines_key
from ..models import StepRun, StepStatus
from ..rows import rows_select
from .batch_rows import BatchConflict
from .dispatch import Attempt, attempt_new, step_dispatch
from .kinds import row_batched
from .plan import RUN_ACTIVE, holder_step_id, lease_seconds, step_holder, step_spec

log = logging.getLogger(__name__)

# Fields a dispatch writes.
DISPATCH_FIELDS = [
    "status",
    "attempt",
    "command_id",
    "fence",
    "deadline",
    "dispatched_at",
    "acked_at",
    "progress",
    "progress_detail",
    "progress_messages",
]


class BatchRetry(Exception):
    """A row changed under the batch after its lock call: undone, the task runs again."""


class BatchLocks:
    """The one Redis call for the batch's locks and what follows from its outcomes. The
    state is `_Batch`'s (jobs/engine/batch.py)."""

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
        # (The batch's own new rows are not among them: its releases come before its acquires.)
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
                or not row_batched(row)
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
        """The batch's new rows, whole (dispatched where the lock call granted their lock,
        else queued), the rows handed a device, and every event: sent together, the last
        thing the transaction does (on PostgreSQL the COMMIT rides in the same text unless a
        handed row's compare-and-set is in it: `Writes.send(last=True)`)."""
        self.writes.insert(StepRun, self.new_rows)
        new = {row.pk for row in self.new_rows}
        self.writes.update(
            StepRun,
            [row for row in self.dispatches if row.pk not in new],
            DISPATCH_FIELDS,
            status_in=(StepStatus.QUEUED,),
            # A handed row was canceled meanwhile: undo and let the task run again (a
            # batch that starts queued rows, `rows_start`, goes one row at a time instead).
            conflict=self.dispatch_conflict,
        )
        self.events.insert(writes=self.writes)
        try:
            self.writes.send(last=True)
        except IntegrityError:
            # Another transition made a next row of one of these runs first.
            raise BatchConflict("a next step's row exists already") from None

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
