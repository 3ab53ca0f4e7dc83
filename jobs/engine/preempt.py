"""Urgent preemption: an urgent step takes its busy device from a lower-priority command.

A row whose step is `urgent` and whose run's priority is at least IOTQUEUE_PREEMPT_PRIORITY
(`plan.step_preempts`) that joins a busy device's queue is looked at once more after its
transition committed (batch.py `row_preempt_apply`). When the device's holder is a command
in flight of a run of lower priority, one transition (planned here, `preempt_plan`):

- moves that row back to `queued` (its attempt's deadlines go, its queue deadline is
  written anew) and sends its device the protocol's `cancel` for the command;
- takes the lock in one lock-script call (`LockBatch.preempt`): the fence grows, so the
  displaced command's token is stale, and the displaced row waits again at the head of its
  priority band; the urgent row holds the lock under the new fence and is dispatched;
- records `step.preempted` on both runs, each naming the other.

After the commit the `cancel` leaves before the urgent command (executor.py `_committed`
sends a plan's cancels first, on the same connection), so the device never has two commands
in flight. The canceled command's late `done` matches no attempt in flight: it is refused
as stale (`reply.stale`) and the row stays queued. When the device's lock is handed on, the
displaced row runs again as its next attempt. Nothing is compensated: the command did not
finish, and its `cancel` is the device's cue to undo what it had started.

How it fails: when the holder moved on meanwhile (its attempt ended, the lock was handed
on) the lock call does not displace it; the transaction is rolled back and planned again
from a fresh read (`PreemptExecutor`), and a row that finds nothing to preempt simply waits
in the queue. A preemption lost with a worker leaves the urgent row queued, served in
priority order as any other.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from devices.locks import Preempted, device_lock_preempt

from ..deadlines import KINDS, Deadline, deadline_score
from ..models import STEP_IN_FLIGHT, Phase, StepRun, StepStatus
from .dispatch import attempt_new
from .effects import Plan
from .executor import BatchConflict, Executor
from .kinds import row_commanded, row_ended_handler
from .plan import RUN_ACTIVE, lease_seconds, step_holder, step_preempts, step_spec

log = logging.getLogger(__name__)

# Fields the displaced row's compare-and-set writes: back in the queue (its command id is
# kept, so its late replies are recognized as stale).
PREEMPTED_FIELDS = ["status", "queued_at", "deadline"]


def preempt_refusal(row: StepRun, victim: StepRun | None, fence: int | None) -> str:
    """Why `row` may not take its device from `victim` (the row holding the device's lock
    under `fence`, or None when the holder is no step), or "" when it may."""
    if row.status != StepStatus.QUEUED or row.run.status not in RUN_ACTIVE or not step_preempts(row):
        return "the urgent row is no longer waiting"
    if victim is None or fence is None:
        return "the device is free, or held by no step"
    if victim.status not in STEP_IN_FLIGHT or victim.fence != fence:
        return "the holder has no command in flight"
    if victim.phase != Phase.FORWARD or row_ended_handler(victim) is not None or not row_commanded(victim):
        return "the holder is a fan-out's, compensation's or task's row"
    if victim.run.priority >= row.run.priority:
        return "the holder's run has the same or a higher priority"
    return ""


def preempt_plan(plan: Plan, row: StepRun, victim: StepRun, fence: int) -> int:
    """Plan `row` taking its device from `victim` (in flight under `fence`): the victim's
    row back in the queue with a `cancel` for its command, the lock taken in one call, the
    urgent row dispatched on grant (planner_locks.locks_answered), events on both runs. Returns
    the lock operation's index (its outcome must be Preempted: `PreemptExecutor`)."""
    device = row.device.name
    spec = step_spec(victim)
    # Its attempt's deadlines go; its queue deadline (of the same member) is written anew.
    plan.zset_remove([Deadline.of(kind, victim) for kind in KINDS if kind != "queue"])
    victim.status, victim.queued_at = StepStatus.QUEUED, plan.now
    victim.deadline = plan.now + timedelta(seconds=spec["queue_timeout_seconds"])
    plan.zset_add({Deadline.of("queue", victim): victim.deadline})
    plan.write(
        StepRun,
        [victim],
        PREEMPTED_FIELDS,
        status_in=STEP_IN_FLIGHT,
        match="command_id",
        conflict="the preempted attempt ended meanwhile",
    )
    plan.cancels.append(victim)
    plan.events.add(
        "step.preempted",
        step_run=victim,
        message=(
            f"preempted on {device} by urgent run {row.run_id} (priority {row.run.priority}): "
            f"command canceled, queued again"
        ),
        by_run=str(row.run_id),
        fence=fence,
    )
    # The urgent row's own compare-and-set before the lock call (it writes what the row
    # holds): a row that moved (its run canceled) is found before the device is taken, and
    # the row stays locked for its dispatch write after the lock call.
    plan.write(
        StepRun,
        [row],
        ["status"],
        status_in=(StepStatus.QUEUED,),
        match="attempt",
        conflict="the urgent row moved meanwhile",
    )
    attempt = attempt_new(row, fence=0, now=plan.now)
    index = plan.locks.preempt(
        device,
        holder=step_holder(row),
        priority=row.run.priority,
        lease_seconds=lease_seconds(step_spec(row)),
        displace=step_holder(victim),
        displace_fence=fence,
        displace_priority=victim.run.priority,
        on_grant={d.member: deadline_score(when) for d, when in attempt.deadlines.items()},
    )
    plan.acquires[index] = (row, attempt)
    plan.events.add(
        "step.preempted",
        step_run=row,
        message=(
            f"urgent: took {device} from run {victim.run_id} (priority {victim.run.priority}), "
            f"whose command was canceled and queued again"
        ),
        preempted_run=str(victim.run_id),
        preempted_step=victim.pk,
    )
    return index


class PreemptExecutor(Executor):
    """The executor of a preemption: its lock call must have displaced the holder it named
    (Preempted); any other outcome (the holder moved on) rolls the transition back, the
    lock call undone, to be planned again from a fresh read.

    How it fails: a transaction that fails after the lock displaced the holder (a database
    error) gives the lock back to the displaced holder, whose command is still running on
    the device (its `cancel` was never sent), and the urgent row waits at the head of its
    band. The lock's fence has grown meanwhile, so the displaced attempt's own release is
    refused as stale: the device stays held until that lease runs out and the monitor
    passes it on. Slower, never two commands on the device."""

    preempt_op: int | None = None
    victim: StepRun | None = None

    def preempt(self, row: StepRun, victim: StepRun, fence: int) -> None:
        """Plan `row` taking its device from `victim` (`preempt_plan`)."""
        self.victim = victim
        self.preempt_op = preempt_plan(self.plan, row, victim, fence)

    def locks_apply(self) -> None:
        super().locks_apply()
        if self.preempt_op is not None and not isinstance(self.outcomes[self.preempt_op], Preempted):
            raise BatchConflict("the device's holder moved on before the preemption")

    def undo(self) -> None:
        index = self.preempt_op
        outcome = self.outcomes[index] if index is not None and index < len(self.outcomes) else None
        if isinstance(outcome, Preempted):
            op = self.plan.locks.ops[index]
            try:
                device_lock_preempt(
                    op["d"],
                    holder=op["v"],
                    priority=op["vp"],
                    lease_seconds=lease_seconds(step_spec(self.victim)),
                    displace=outcome.holder,
                    displace_fence=outcome.fence,
                    displace_priority=op["p"],
                )
            except Exception:
                log.exception("undoing a preemption on %s; the lease will end it instead", op["d"])
            self.outcomes[index] = None  # given back: nothing for the general undo to pass on
        super().undo()
