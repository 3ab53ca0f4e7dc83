"""Stages 1 and 2 of a batched transition (jobs/engine/batch.py): which runs start and which
replies apply, then the database writes before the lock call.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from functools import partial
from uuid import UUID

from devices import protocol
from devices.models import Device

from .. import templating
from ..deadlines import Deadline, by_shard, deadline_score
from ..models import STEP_IN_FLIGHT, JobRun, OnFailure, Phase, RunStatus, StepRun, StepStatus
from ..rows import rows_select
from .attempts import attempt_deadlines, attempt_outcome
from .dispatch import attempt_new
from .kinds import row_ended_handler, spec_behaviour
from .plan import (
    lease_seconds,
    step_args,
    step_holder,
    step_spec,
    step_target_name,
)
from .reply import PROGRESS_FIELDS, progress_keep, step_reply
from .runs import RUN_STATUS_FOR_STEP, run_advance, run_continue, run_step_enter, step_error

log = logging.getLogger(__name__)

# Fields a batch writes, per kind of row write.
ACK_FIELDS = ["status", "acked_at", *PROGRESS_FIELDS]
END_FIELDS = ["status", "error", "finished_at", "result", *PROGRESS_FIELDS, "deadline", "acked_at"]


class BatchConflict(Exception):
    """A row changed under the batch; nothing was written to Redis, apply it again."""


class BatchRows:
    """Run starts, acks, attempt ends, cursors and the next rows: queued in `writes` and
    sent before the lock call; lock releases and acquires queued in `locks`. The state is
    `_Batch`'s (jobs/engine/batch.py)."""

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
        event = progress_keep(step_run, reply)
        if event:
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
            if step_run.phase == Phase.FORWARD and row_ended_handler(step_run) is not None:
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

    def rows_name(self) -> None:
        """The runs' next steps: their rows made and named, queued (they are inserted whole
        after the lock call, `dispatches_write`); other kinds start the general way."""
        plans = {}
        for run in self.starting:
            if run.cursor >= len(run.plan):
                self.later.append(partial(run_step_enter, run=run, index=run.cursor))
                continue
            spec = run.plan[run.cursor]
            name, _ = step_target_name(run, spec)
            if not spec_behaviour(spec).batched_start or name is None:
                self.later.append(partial(run_step_enter, run=run, index=run.cursor))
            else:
                plans[run.pk] = (run, spec, name)
        names = {name for _, _, name in plans.values()}
        # The writes queued so far go with this read and the ids' reservation: one round
        # trip on PostgreSQL, and every compare-and-set is checked before the lock call.
        found, ids = self.writes.send(select=(Device, "name", names, ()), reserve=(StepRun, len(plans)))
        devices = {device.name: device for device in found}
        for (run, spec, name), pk in zip(plans.values(), ids, strict=True):
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
                pk=pk,
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
