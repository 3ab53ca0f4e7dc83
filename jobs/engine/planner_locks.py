"""The planner's third stage, without I/O: the next rows, the lock call's answers, the
hand-offs (the first two, inputs and outcomes, are jobs/engine/planner.py's).

The runs a plan moved on name their next rows (`rows_wanted`, `rows_name`, with the rows
kinds' starts asked for); each row asks for its device's lock (`row_acquire`: held by its
time windows, spaced by flow control, dispatched at once without a device); the lock
call's operations are ordered so that each run's next acquire follows its own release
(`locks_order`); its answers dispatch the granted rows (`locks_answered`); the rows the
releases handed a device to are dispatched in the same transaction (`handed_ids`,
`handed_plan`); and the dispatches become the transaction's last writes
(`dispatches_writes`).
"""

from __future__ import annotations

from datetime import timedelta

from devices.flow import device_flow_limited
from devices.locks import Grant, LockBatch, NotReady, Queued
from devices.models import Device

from .. import templating
from ..deadlines import Deadline, by_shard, deadline_score
from ..limits import row_slots
from ..models import (
    STEP_IN_FLIGHT,
    StepRun,
    StepStatus,
)
from ..rows import row_new
from ..timewindows import Hold
from .dispatch import Attempt, attempt_new
from .effects import NewRow, Plan, RowWrite
from .holds import hold_message, row_hold
from .kinds import (
    row_batched,
    spec_behaviour,
)
from .plan import (
    RUN_ACTIVE,
    holder_step_id,
    lease_seconds,
    queued_message,
    queued_row,
    step_args,
    step_holder,
    step_preempts,
    step_spec,
    step_target_name,
)

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
# A step handed its device's lock before its row was committed is looked at again after
# this long (the creating transaction takes milliseconds).
UNCOMMITTED_ROW_RETRY_SECONDS = 0.5


# --- 3. the next rows, the lock call's answers, the hand-offs ------------------------


def rows_wanted(plan: Plan) -> set[str]:
    """The devices the runs' next steps target (the executor reads them, and reserves as
    many row ids as `plan.naming` holds); other kinds start the general way."""
    for run in plan.starting:
        if run.cursor >= len(run.plan):
            plan.later_add("enter", run=run, index=run.cursor)
            continue
        spec = run.plan[run.cursor]
        name, _ = step_target_name(run, spec)
        if not spec_behaviour(spec).batched_start or name is None:
            plan.later_add("enter", run=run, index=run.cursor)
        else:
            plan.naming.append((run, spec, name))
    return {name for _, _, name in plan.naming}


def rows_name(plan: Plan, devices: dict[str, Device], ids: list[int]) -> None:
    """The runs' next rows, then the rows kinds' starts asked for (`plan.creating`), made
    and named by the reserved `ids`, queued, each asking for its device's lock; a refusal
    (no such device, a reference with no value) starts the general way (the step fails
    there with the reason)."""
    named = len(plan.naming)
    for (run, spec, name), pk in zip(plan.naming, ids[:named], strict=True):
        device = devices.get(name)
        try:
            args = step_args(run, spec["args"], device) if device is not None else None
        except templating.TemplateError:
            args = None
        if args is None or not device.enabled:
            plan.later_add("enter", run=run, index=run.cursor)
            continue
        row = _row_queued(plan, pk, NewRow(run, run.cursor, device, spec["action"], args))
        row_acquire(plan, row, written=True)
    for new, pk in zip(plan.creating, ids[named:], strict=True):
        row = _row_queued(plan, pk, new)
        if new.acquire:
            row_acquire(plan, row, written=True)


def _row_queued(plan: Plan, pk: int, new: NewRow) -> StepRun:
    """A new queued row, inserted whole at the end of the transition, and its `step.queued`."""
    fields = queued_row(
        new.run, new.index, device=new.device, action=new.action, args=new.args, phase=new.phase, now=plan.now
    )
    row = row_new(StepRun, pk=pk, **fields)
    plan.new_rows.append(row)
    plan.events.add("step.queued", step_run=row, message=queued_message(row))
    return row


def row_acquire(plan: Plan, row: StepRun, *, written: bool = False) -> None:
    """A queued row asks for its device's lock: dispatched if granted (`locks_answered`),
    else its queue deadline is written with the acquire; an offline device is not asked,
    nor is one outside the row's time windows (`_held`). `written`: the plan writes the
    row's `deadline` already (a new row, a row queued again)."""
    hold = row_hold(row, plan.now, plan.groups)
    if hold is not None:
        _held(plan, row, hold, written=written)
        return
    if row.device_id is None:
        # A row without a device (a task step with no target) takes no lock: dispatched
        # with the lock call's grants (after the writes planned so far were checked).
        attempt = attempt_new(row, fence=None, now=plan.now)
        plan.zset_add(attempt.deadlines)
        plan.lockless.append((row, attempt))
        return
    queued = {Deadline.of("queue", row): row.deadline} if row.deadline is not None else {}
    queue = {d.member: deadline_score(when) for d, when in queued.items()}
    # A row that waited before (asking again: a lock rebuild, its device back online) may
    # have a queue deadline: a grant ends it.
    waited = [Deadline.of("queue", row).member] if not written else []
    if not row.device.reachable:
        plan.zset_add(queued)
        if not plan.quiet:
            plan.events.add("step.waiting", step_run=row, message=f"device {row.device.name} is offline")
        return
    wait = plan.waits.get(row.device.name, 0.0)
    if wait > 0:
        # Flow control: granted, the row keeps the lock and is dispatched when due.
        spaced = {Deadline.of("dispatch", row).member: deadline_score(plan.now + timedelta(seconds=wait))}
        index = plan.locks.acquire(
            row.device.name,
            holder=step_holder(row),
            priority=row.run.priority,
            lease_seconds=lease_seconds(step_spec(row)) + wait,
            on_grant=spaced,
            on_queue=queue,
            slots=row_slots(row, plan.limits),
            on_grant_clear=waited,
        )
        plan.acquires[index] = (row, None)
        return
    attempt = attempt_new(row, fence=0, now=plan.now)
    index = plan.locks.acquire(
        row.device.name,
        holder=step_holder(row),
        priority=row.run.priority,
        lease_seconds=lease_seconds(step_spec(row)),
        on_grant={d.member: deadline_score(when) for d, when in attempt.deadlines.items()},
        on_queue=queue,
        slots=row_slots(row, plan.limits),
        on_grant_clear=waited,
    )
    plan.acquires[index] = (row, attempt)


def _held(plan: Plan, row: StepRun, hold: Hold, *, written: bool, locks: LockBatch | None = None) -> None:
    """The row stays queued without asking for its device (time windows: holds.py); a
    `window` deadline asks again when it may go, and its queue deadline counts from then.
    A row that may be in its device's queue (asking again) leaves it; its `queued_at` is
    the time it may go (the monitor's sweep of lost lock requests and "stuck" pass it by).
    `locks`: the lock writes to add to when the plan's own lock call was made already (a
    hand-off)."""
    row.queued_at = hold.until
    row.deadline = hold.until + timedelta(seconds=step_spec(row)["queue_timeout_seconds"])
    queue, window = Deadline.of("queue", row), Deadline.of("window", row)
    if locks is None:
        plan.zset_remove([queue])
        plan.zset_add({window: hold.until})
        if not written:
            plan.dequeues.add(plan.locks.dequeue(row.device.name, holder=step_holder(row)))
    else:
        locks.zset_remove([queue.member], shard=queue.shard)
        locks.zset_add({window.member: deadline_score(hold.until)}, shard=window.shard)
    if not written:
        if plan.held is None:
            plan.held = RowWrite(
                StepRun,
                [],
                ["queued_at", "deadline"],
                (StepStatus.QUEUED,),
                match="attempt",
                conflict="a held step moved",
            )
            plan.writes.append(plan.held)
        plan.held.rows.append(row)
    if not plan.quiet:
        plan.events.add("step.held", step_run=row, message=hold_message(hold))


def locks_order(plan: Plan) -> None:
    """Put each new row's acquire right after the release of the row whose end started it
    (its run's), so the lock call serves the devices as the batch's inputs applied one at a
    time would: a run's next step is queued before a later input's release hands its device
    on (with a higher priority it is served first), and a device released and acquired by
    one run serves its queue first. Remaps the plan's op indexes."""
    released = {row.run_id: index for index, row in plan.releases.items()}
    new = {row.pk for row in plan.new_rows}
    follows: dict[int, list[int]] = {}
    for index, (row, _) in plan.acquires.items():
        release = released.get(row.run_id)
        if row.pk in new and release is not None and release < index:
            follows.setdefault(release, []).append(index)
    if not follows:
        return
    moved = {index for indexes in follows.values() for index in indexes}
    order = []
    for index in range(len(plan.locks.ops)):
        if index not in moved:
            order.append(index)
            order += follows.get(index, [])
    at = {old: new for new, old in enumerate(order)}
    plan.locks.ops = [plan.locks.ops[old] for old in order]
    plan.releases = {at[i]: row for i, row in plan.releases.items()}
    plan.acquires = {at[i]: acquire for i, acquire in plan.acquires.items()}
    plan.dequeues = {at[i] for i in plan.dequeues}
    plan.extends = {at[i] for i in plan.extends}


def locks_answered(plan: Plan, outcomes: list) -> None:
    """The lock call's answers: granted rows are dispatched, queued ones wait (an event),
    releases that handed a device on are kept for `handed_plan`. Rows without a device are
    dispatched here too (they took no lock)."""
    for row, attempt in plan.lockless:
        _dispatch(plan, row, attempt, None)
    for index, outcome in enumerate(outcomes):
        if index in plan.releases:
            if outcome is not None:
                plan.handed.append((plan.releases[index].device.name, outcome))
            continue
        if index in plan.dequeues or index in plan.extends:
            continue
        row, attempt = plan.acquires[index]
        if isinstance(outcome, Grant) and attempt is None:
            _spaced(plan, row)
        elif isinstance(outcome, Grant):
            _dispatch(plan, row, attempt, outcome.fence)
        elif isinstance(outcome, Queued):
            if not outcome.waiting:
                plan.queued.setdefault(row.device.name, row)
                if step_preempts(row):
                    # Urgent: after the commit it may take the device (batch.row_preempt_apply).
                    plan.later_add("preempt", step_run_id=row.pk)
            if not plan.quiet:
                position = outcome.position
                if outcome.slot:
                    # A shared concurrency limit is full for the device's label value.
                    message = f"limit {outcome.slot} full, position {position}"
                else:
                    message = f"device busy, position {position}"
                plan.events.add("step.waiting", step_run=row, message=message)
        elif isinstance(outcome, NotReady):
            plan.rebuild = True


def handed_ids(plan: Plan) -> set[int]:
    """The step rows the releases handed a device to (the executor reads them)."""
    return {step_id for _, grant in plan.handed if (step_id := holder_step_id(grant.holder)) is not None}


def handed_plan(plan: Plan, rows: dict[int, StepRun]) -> LockBatch:
    """Dispatch the queued rows the releases handed a device to; returns the lock writes
    for them (their deadlines, the queue deadline cleared, the full lease), which the
    executor applies before the commit. One of the batch's own new rows (queued by its
    acquire, then handed the device by a later release: `locks_order`) is dispatched the
    same way and inserted dispatched. A device whose next command is not due yet keeps it
    with a `dispatch` deadline. A holder of another kind is started by its grant handler
    after the commit; a row that moved on (ended, canceled, its run over) passes the lock
    on after the commit (unless it holds it already in flight under this fence: a grant
    told twice), and a row not committed yet is looked at again shortly (`dispatch`)."""
    writes = LockBatch()
    new = {row.pk: row for row in plan.new_rows}
    for device, grant in plan.handed:
        step_id = holder_step_id(grant.holder)
        row = (rows.get(step_id) or new.get(step_id)) if step_id is not None else None
        if step_id is None:
            plan.later_add("handoff", device=device, grant=grant)
            continue
        if row is None:
            # Handed the lock before the transaction that created the row committed (two
            # batches at once): look again shortly. A row that never commits keeps the lock
            # until its lease runs out and the monitor passes it on.
            # (In `writes`: the plan's own lock call has been made by now.)
            retry = Deadline("dispatch", step_id, 0, device)
            retry_at = plan.now + timedelta(seconds=UNCOMMITTED_ROW_RETRY_SECONDS)
            writes.zset_add({retry.member: deadline_score(retry_at)}, shard=retry.shard)
            continue
        if row.status != StepStatus.QUEUED or row.run.status not in RUN_ACTIVE or not row_batched(row):
            if not (row.status in STEP_IN_FLIGHT and row.fence == grant.fence):
                plan.later_add("pass_on", device=device, holder=grant.holder, fence=grant.fence)
            continue
        hold = row_hold(row, plan.now, plan.groups)
        if hold is not None:
            # Its window closed while it waited in the queue: the device goes to the next
            # waiter, the row asks again when it may go.
            plan.later_add("pass_on", device=device, holder=grant.holder, fence=grant.fence)
            _held(plan, row, hold, written=False, locks=writes)
            continue
        wait = plan.waits.get(device, 0.0)
        if wait > 0:
            # Flow control: the row keeps the lock and is dispatched when due.
            spaced = Deadline.of("dispatch", row)
            writes.zset_add(
                {spaced.member: deadline_score(plan.now + timedelta(seconds=wait))}, shard=spaced.shard
            )
            writes.extend(
                device,
                holder=step_holder(row),
                fence=grant.fence,
                lease_seconds=lease_seconds(step_spec(row)) + wait,
            )
            _spaced(plan, row)
            continue
        attempt = attempt_new(row, fence=grant.fence, now=plan.now)
        for shard, group in by_shard(attempt.deadlines).items():
            writes.zset_add({d.member: deadline_score(attempt.deadlines[d]) for d in group}, shard=shard)
        queue = Deadline.of("queue", row)
        writes.zset_remove([queue.member], shard=queue.shard)
        writes.extend(
            row.device.name,
            holder=step_holder(row),
            fence=grant.fence,
            lease_seconds=lease_seconds(step_spec(row)),
        )
        _dispatch(plan, row, attempt, grant.fence)
    return writes


def _dispatch(plan: Plan, row: StepRun, attempt: Attempt, fence: int | None) -> None:
    for name, value in {**attempt.changes, "fence": fence}.items():
        setattr(row, name, value)
    plan.events.add("step.dispatched", step_run=row, message=f"attempt {row.attempt}, fence {fence}")
    plan.dispatches.append(row)
    if row.device_id is not None and device_flow_limited(row.device):
        plan.flow_sent.append(row.device)  # its send time, for the device's next wait


def _spaced(plan: Plan, row: StepRun) -> None:
    wait = plan.waits[row.device.name]
    plan.events.add("step.spaced", step_run=row, message=f"flow control: sending in {wait:.1f}s")


def dispatches_writes(plan: Plan) -> list[RowWrite]:
    """The last writes: the rows dispatched that existed before this transition (the new
    ones are inserted whole, dispatched or queued)."""
    new = {row.pk for row in plan.new_rows}
    handed = [row for row in plan.dispatches if row.pk not in new]
    if not handed:
        return []
    # A handed row canceled meanwhile: undo the lock call and plan again.
    conflict = "a dispatched row moved during its transition"
    return [
        RowWrite(StepRun, handed, DISPATCH_FIELDS, (StepStatus.QUEUED,), conflict=conflict, after_locks=True)
    ]
