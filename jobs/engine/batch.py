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
5. publishes every resulting command at once (QoS 1, into the unit of work's
   `Publications`, jobs/engine/publish.py, which awaits the acknowledgements), and gathers
   its last Redis writes (`LastWrites`: the `send` deadlines of the commands the broker
   acknowledged by now, the runs' deadlines, the metrics), sent in one pipeline by the
   transition or, with the inbox's acknowledgement, by its caller (jobs/inbox.py); then
   the events are logged and the lifecycle ones sent out (`EventLog.committed`).

The decisions of stages 1 to 4 are planner.py's and planner_locks.py's (they build a
`Plan`, effects.py, without I/O);
`Executor` (executor.py) carries the plan out (the reads between the stages, the writes,
the lock calls, the commit) and publishes (stage 5, batch_publish.py). Due `ack`, `done` and `retry`
deadlines are applied the same way (`deadlines_apply`).

Every reply and run start is planned: a reply that matches no current attempt is recorded
(sampled per device) as stale, unknown or foreign; a start of a running run resumes the
step at its cursor. What a plan leaves, after the commit, to the one-at-a-time path is a
run that rolls back, a fan-out or compensation row, a next step of another kind, a device
with flow control.

How it fails: each write is a compare-and-set whose count is checked. If another
transition moved a row first (a cancel, a timeout, a duplicate reply in another batch),
the transaction rolls back before any Redis write and the batch is applied again from a
fresh read (CONFLICT_RETRIES times; when the conflict is a next row another transition
made first, found by the insert after the lock call, the lock call is undone first): the
moved row's reply is then no longer current (recorded as stale), the others still apply
together. A batch that keeps conflicting is applied as batches of one, and a batch of one
that keeps conflicting is raised (BatchRetry) for the task to run again. A database
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
from dataclasses import replace
from functools import partial

from django.db import InterfaceError, OperationalError
from django.db.models import Q
from redis.exceptions import RedisError

from devices import protocol
from devices.flow import device_flow_waits
from devices.locks import (
    Grant,
    device_lock_handoff,
    device_lock_pass_on,
    device_lock_states,
)

from ..deadlines import Deadline
from ..events import event_record
from ..inbox import Work
from ..models import STEP_IN_FLIGHT, JobRun, Phase, RunStatus, StepRun, StepStatus
from ..rows import rows_select
from . import effects, planner, planner_locks
from .batch_publish import LastWrites
from .executor import BatchConflict, BatchRetry, Executor, safely, transition
from .holds import window_groups_read
from .kinds import PLANNED_DEADLINES, REGISTRY, row_batched, row_ended_handler
from .plan import RUN_ACTIVE, command_id_step, holder_step_id
from .preempt import PreemptExecutor, preempt_refusal
from .runs import run_finish, step_error
from .start import StepRefused, step_row_inputs, step_start

log = logging.getLogger(__name__)


# A batch that conflicts is read and applied again this many times before its replies are
# applied one at a time. A conflict is another transition moving one of its rows first
# (in practice an ack whose done another drain applied): the fresh read sees it.
CONFLICT_RETRIES = 1


def inbox_apply(work: Work) -> LastWrites:
    """Apply what a worker took from the inbox (jobs/inbox.py) as one transition; returns
    its last Redis writes, which the inbox sends with its acknowledgement (one round trip)
    once this returned: everything is then committed and published.

    How it fails: a failure that says nothing about the input (TRANSIENT: the database or
    Redis unreachable, a lock conflict) is raised, and the task applies the batch again. Any
    other failure is taken to be one input's doing (a reply or a run the engine cannot
    apply): the batch is applied in halves, and halves of what fails, until each input that
    fails alone is found; those are dropped and recorded (`poison_drop`), everyone else's
    replies and run starts are applied (the halves send their own last writes).
    """
    items = [(device, protocol.Reply(**payload)) for device, payload in work.replies]
    items += [(None, run_id) for run_id in work.starts]
    last = LastWrites()
    _items_isolate(items, last=last)
    return last


# Failures of the batch as a whole, not of one of its inputs: applied again, whole.
TRANSIENT = (OperationalError, InterfaceError, RedisError, BatchRetry)


def _items_isolate(items: list[tuple[str | None, object]], *, last: LastWrites | None = None) -> None:
    """Apply `items` as one transition; when that fails for a reason of their own, apply
    each half the same way, down to the inputs that fail alone, dropped."""
    try:
        replies = [(device, reply) for device, reply in items if device is not None]
        starts = [run_id for device, run_id in items if device is None]
        transition_apply(replies=replies, starts=starts, last=last)
    except TRANSIENT:
        raise
    except Exception as exc:
        if len(items) == 1:
            poison_drop(items[0], exc)
            return
        log.warning("a batch of %d inputs failed (%r); applying it in halves", len(items), exc)
        half = len(items) // 2
        _items_isolate(items[:half])
        _items_isolate(items[half:])


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
    last: LastWrites | None = None,
    retries: int = CONFLICT_RETRIES,
) -> None:
    """Apply replies that arrived together and start pending runs (see the module docstring).

    On a conflict the batch is read and applied again, `retries` times at most, then one
    reply at a time. With `last`, the batch's last Redis writes are added to it, for the
    caller to send with commands of its own; without, the transition sends them.
    """
    rows, earlier = {}, {}
    if replies:
        command_ids = {reply.command_id for _, reply in replies}
        rows = {
            s.command_id: s
            for s in rows_select(StepRun, "command_id", command_ids, related=("run", "device"))
        }
        # The rows that replies to no current command name (stale or unknown): rare.
        named = {command_id_step(c) for c in command_ids - rows.keys()} - {None}
        if named:
            earlier = {s.pk: s for s in rows_select(StepRun, "id", named, related=("device",))}
    runs = {run.pk: run for run in rows_select(JobRun, "id", starts)} if starts else {}
    at_cursor = _rows_at_cursor([run for run in runs.values() if run.status == RunStatus.RUNNING])
    batch = Executor(rows)
    batch.last = last
    batch.plan.waits.update(device_flow_waits([row.device for row in at_cursor.values()]))
    batch.plan.groups.update(
        window_groups_read(
            (runs[run_id], row.device.name) for run_id, row in at_cursor.items() if row.device_id
        )
    )

    def prepare() -> None:
        planner.runs_begin(batch.plan, runs, list(starts), at_cursor)
        planner.replies_plan(batch.plan, rows, list(replies), earlier)
        planner.runs_continue(batch.plan)

    def one_at_a_time() -> None:
        # Batches of one: the same plan, each from its own fresh read.
        for run_id in starts:
            transition_apply(starts=[run_id], last=last)
        for item in replies:
            transition_apply(replies=[item], last=last)

    def again() -> None:
        transition_apply(replies=replies, starts=starts, last=last, retries=retries - 1)

    def given_up() -> None:
        raise BatchRetry(f"a batch of one kept conflicting ({replies or starts})")

    if retries > 0:
        _transition(batch, prepare, again, "applying it again from a fresh read")
    elif len(replies) + len(starts) > 1:
        _transition(batch, prepare, one_at_a_time, "applying one at a time")
    else:
        _transition(batch, prepare, given_up, "the task runs again")


def _rows_at_cursor(runs: list[JobRun]) -> dict:
    """The step rows at the cursor of running runs, by run (a start again resumes them)."""
    if not runs:
        return {}
    at = Q()
    for run in runs:
        at |= Q(run_id=run.pk, phase=Phase.FORWARD, index=run.cursor)
    return {row.run_id: row for row in StepRun.objects.filter(at).select_related("device")}


def deadlines_apply(deadlines: list[Deadline], *, retries: int = CONFLICT_RETRIES) -> list[Deadline]:
    """Due deadlines as one transition: `ack` / `done` time their attempts out, `retry`
    queues their steps again, `dispatch` and `queue` send a step that holds its lock, a
    `queue` times out a step that waited too long (planner.dues_plan). Returns the
    deadlines left to their kind's handler (jobs/engine/due.py): the other kinds, and those
    of a kind that takes its rows' deadlines over (a delay). A batch that keeps conflicting
    is applied as batches of one; a batch of one that still does is left to the monitor
    (its row moved: what the deadline guarded is over, or the sweep finds it again)."""
    planned = [d for d in deadlines if d.kind in PLANNED_DEADLINES]
    left = [d for d in deadlines if d.kind not in PLANNED_DEADLINES]
    if not planned:
        return left
    ids = {d.step_run_id for d in planned}
    rows = {s.pk: s for s in rows_select(StepRun, "id", ids, related=("run", "device"))}
    batch = Executor({})
    devices = [row.device for row in rows.values() if row.device_id]
    batch.plan.waits.update(device_flow_waits(devices))
    batch.plan.groups.update(
        window_groups_read((row.run, row.device.name) for row in rows.values() if row.device_id)
    )
    # Who holds the locks a due `dispatch` asks about (read before the transaction).
    asked = {
        rows[d.step_run_id].device.name
        for d in planned
        if d.kind in ("dispatch", "queue") and d.step_run_id in rows and rows[d.step_run_id].device_id
    }
    holders = (
        {
            name: Grant(state.holder, state.fence)
            for name, state in device_lock_states(sorted(asked)).items()
            if state.holder is not None and state.fence is not None
        }
        if asked
        else {}
    )
    conflicted: list[Deadline] = []

    def prepare() -> None:
        planner.dues_plan(batch.plan, rows, planned, holders)
        planner.runs_continue(batch.plan)

    def again() -> None:
        if retries > 0:
            conflicted.append(deadlines_apply(planned, retries=retries - 1))
        elif len(planned) > 1:
            conflicted.append([d for one in planned for d in deadlines_apply([one])])
        else:
            log.info("deadline %s kept finding its row moved; left to the monitor", planned[0].member)
            conflicted.append([])

    _transition(batch, prepare, again, "applying it again" if retries > 0 else "applying one at a time")
    # A batch that conflicted was rolled back: what is left is its retry's.
    return left + (conflicted[0] if conflicted else batch.plan.unplanned)


# A cancel that keeps finding its run's rows moved is planned again this many times (each
# time from a fresh read; a row moves a few times in a run's life, not forever).
CANCEL_RETRIES = 5


def run_cancel_apply(run_id: str, *, reason: str) -> bool:
    """Cancel a run as one transition (planner.cancel_plan); False when it had ended."""
    return _run_stop(run_id, partial(planner.cancel_plan, reason=reason))


def run_time_out_apply(run_id: str) -> bool:
    """The `run` deadline as one transition (planner.run_time_out_plan): a running run past
    its max_duration ends `timed_out` with its rows at work; False when it was not due."""
    return _run_stop(run_id, planner.run_time_out_plan)


def run_end_by_apply(run_id: str) -> bool:
    """The `end` deadline as one transition (planner.run_end_by_plan): a run at its end by
    is canceled, or (`finish`) lets its commands at work finish; False when it was not due."""
    return _run_stop(run_id, planner.run_end_by_plan)


def _run_stop(run_id: str, plan_with, retries: int = CANCEL_RETRIES) -> bool:
    """Read a run and its rows that have not ended, plan with `plan_with(plan, run, rows)`
    and carry it out; planned again from a fresh read when a row moved meanwhile."""
    runs = rows_select(JobRun, "id", [run_id])
    if not runs:
        return False
    rows = [r for r in rows_select(StepRun, "run", [run_id], related=("run", "device")) if not r.is_terminal]
    batch = Executor({})
    stopped: list[bool] = []

    def prepare() -> None:
        stopped.append(plan_with(batch.plan, runs[0], rows))

    def again() -> None:
        if retries <= 0:
            raise BatchRetry(f"stopping run {run_id} kept conflicting")
        stopped[:] = [_run_stop(run_id, plan_with, retries - 1)]

    _transition(batch, prepare, again, "planning it again from a fresh read")
    return stopped[-1]


def attempt_end_apply(step_run_id: int, *, fence: int, error: str, timed_out: bool = False) -> bool:
    """End the attempt in flight under `fence` as a failure with budget for a retry (the
    lock's lease ran out, an operator force-released the lock), as one transition: the
    attempt ends as planner.attempts_end decides, its lock goes to the next waiter and the
    run moves on as for a device's failed `done`. False when no attempt under that fence
    was in flight (it ended, or the row moved on)."""
    return _attempt_end(
        step_run_id, fence, {"ok": False, "error": error, "retryable": True, "timed_out": timed_out}
    )


def _attempt_end(step_run_id: int, fence: int, how: dict, retries: int = CANCEL_RETRIES) -> bool:
    rows = rows_select(StepRun, "id", [step_run_id], related=("run", "device"))
    if not rows or rows[0].status not in STEP_IN_FLIGHT or rows[0].fence != fence:
        return False
    batch = Executor({})
    ended = [True]

    def prepare() -> None:
        planner.attempts_end(batch.plan, [(rows[0], how)])
        planner.runs_continue(batch.plan)

    def again() -> None:
        if retries <= 0:
            raise BatchRetry(f"ending the attempt of step {step_run_id} kept conflicting")
        ended[:] = [_attempt_end(step_run_id, fence, how, retries - 1)]

    _transition(batch, prepare, again, "planning it again from a fresh read")
    return ended[-1]


def step_done_apply(run_id: str, index: int, *, ok: bool, status: str, error: str) -> None:
    """A step's final outcome reached outside a plan (a fan-out's summary or abort, a step
    refused at its start, a delay or wait_online row that ended) moves its run as one
    transition (planner.steps_decide): the next step started in it, the run's end, or its
    failure policy after the commit. Nothing happens when the run is no longer running at
    that step (the outcome was decided before)."""
    _step_done(planner.StepDone(None, index, ok, status, error), run_id)


def _step_done(step: planner.StepDone, run_id: str, retries: int = CANCEL_RETRIES) -> None:
    runs = rows_select(JobRun, "id", [run_id])
    if not runs:
        return
    batch = Executor({})

    def prepare() -> None:
        planner.steps_decide(batch.plan, [replace(step, run=runs[0])])

    def again() -> None:
        if retries <= 0:
            raise BatchRetry(f"the outcome of step {step.index} of run {run_id} kept conflicting")
        _step_done(step, run_id, retries - 1)

    _transition(batch, prepare, again, "deciding it again from a fresh read")


def run_continue(*, step_run: StepRun) -> None:
    """After a step row ended for good outside a plan (a delay's, a wait_online's, one the
    monitor found): move its run on; a row that is not its step's whole outcome (a
    fan-out's, a compensation's) reports to the handler its kind declared."""
    if step_run.status == StepStatus.CANCELED:
        return
    ended = row_ended_handler(step_run)
    if ended is not None:
        ended(step_run)
        return
    ok = step_run.status == StepStatus.SUCCEEDED
    step_done_apply(
        str(step_run.run_id), step_run.index, ok=ok, status=step_run.status, error=step_error(step_run)
    )


def run_step_enter(*, run: JobRun, index: int) -> None:
    """Start the step at `index` the way its kind does (a kind a plan does not start, or a
    step refused: no such device, a reference with no value, which fails it as a planned
    outcome), or end the run when the plan is done."""
    if index >= len(run.plan):
        run_finish(run=run, status=RunStatus.SUCCEEDED)
        return
    try:
        step_start(run=run, index=index)
    except StepRefused as refused:
        step_refused_apply(run, index, refused)


def step_refused_apply(run: JobRun, index: int, refused: StepRefused) -> None:
    """A step that could not start (no such device, a reference with no value, no device
    matching a fan-out) fails at once: `step.failed` with the reason, and its failure
    policy decides the run (a planned transition)."""
    event_record("step.failed", run=run, device=refused.device, message=str(refused), index=index)
    step_done_apply(str(run.pk), index, ok=False, status=StepStatus.FAILED, error=f"step {index}: {refused}")


def _policy(*, run: JobRun, policy: str, error: str) -> None:
    """A failure policy that decides on its own (a rollback), after the commit."""
    REGISTRY.failure_policies[policy](run, error)


def handoffs_apply(handed: list[tuple[str, Grant]], *, retries: int = CONFLICT_RETRIES) -> None:
    """Dispatch the queued rows that were handed their device's lock outside a transition
    (a lock passed on by the general path, a lease expiry, a force-release) or that hold
    it already (a lost hand-off), as one transition: planner_locks.handed_plan, as for the
    devices a transition's releases hand on. A row that moved meanwhile is planned again
    from a fresh read, where its lock is passed on."""
    batch = Executor({})
    batch.dispatch_conflict = BatchConflict

    def prepare() -> None:
        batch.plan.handed.extend(handed)

    def again() -> None:
        if retries <= 0:
            raise BatchRetry(f"dispatching {handed} kept conflicting")
        handoffs_apply(handed, retries=retries - 1)

    _transition(batch, prepare, again, "planning it again from a fresh read")


def step_handoff(device: str, grant: Grant) -> None:
    """Grant handler for "step" holders (jobs/apps.py registers it): the lock was handed to
    a queued step outside a transition; dispatch it as a transition of one hand-off."""
    handoffs_apply([(device, grant)])


# Queued rows `rows_start` takes in one transition: one lock call of this many acquires
# holds Redis for a few milliseconds, and their commands leave together.
ROWS_START_BATCH = 500


def rows_start(step_run_ids: list[int], *, quiet: bool = False) -> None:
    """Take the device locks of queued rows as batched transitions of ROWS_START_BATCH rows
    (a fan-out's pump, devices back online, a row started or queued again): one lock call
    for them all, the granted rows dispatched in one transaction, their attempts sent
    together. A busy device's row waits in its queue and an offline device's outside it
    (`step.waiting`, unless `quiet`: the monitor's sweep asking again), one of a device
    with flow control keeps the lock until it may be sent (`step.spaced`), and a row
    without a device (a task step with no target) is dispatched at once. Rows that moved
    meanwhile (ended, canceled) are left alone; a batch in which one moved before its
    dispatch was written is applied again as batches of one.
    """
    for first in range(0, len(step_run_ids), ROWS_START_BATCH):
        _rows_start(step_run_ids[first : first + ROWS_START_BATCH], quiet=quiet)


def _rows_start(step_run_ids: list[int], *, quiet: bool, retries: int = CONFLICT_RETRIES) -> None:
    order = {pk: n for n, pk in enumerate(step_run_ids)}
    rows = sorted(
        rows_select(StepRun, "id", step_run_ids, related=("run", "device")), key=lambda r: order[r.pk]
    )
    # In the caller's order: a device's rows join its queue in it (oldest first).
    rows = [row for row in rows if row.status == StepStatus.QUEUED and row.run.status in RUN_ACTIVE]
    for row in [row for row in rows if not row_batched(row)]:
        log.warning("step %s is of a kind that takes no lock; not started here", row.pk)
        rows.remove(row)
    if not rows:
        return
    batch = Executor({})
    batch.dispatch_conflict = BatchConflict
    batch.plan.quiet = quiet
    batch.plan.waits.update(device_flow_waits([row.device for row in rows if row.device_id]))
    batch.plan.groups.update(window_groups_read((row.run, row.device.name) for row in rows if row.device_id))

    def prepare() -> None:
        for row in rows:
            planner_locks.row_acquire(batch.plan, row)

    def one_at_a_time() -> None:
        for row in rows:
            safely(partial(_rows_start, [row.pk], quiet=quiet, retries=0))

    def given_up() -> None:
        log.warning("step %s kept moving while it was started; the monitor's sweep asks again", rows[0].pk)

    if retries > 0 and len(rows) > 1:
        _transition(batch, prepare, one_at_a_time, "starting its rows one at a time")
    elif retries > 0:
        _transition(batch, prepare, partial(_rows_start, [rows[0].pk], quiet=quiet, retries=0), "again")
    else:
        _transition(batch, prepare, given_up, "leaving it to the sweep")


def step_row_queue(run: JobRun, index: int, *, acquire: bool = True) -> StepRun:
    """The row of the one-device step (or device-less task step) at `index`, made once as
    a plan (`row_create`); raises StepRefused (no such device, a reference with no value)."""
    device, args = step_row_inputs(run, index)
    new = effects.NewRow(run, index, device, run.plan[index]["action"], args, acquire=acquire)
    return row_create(new)


def row_create(new: effects.NewRow) -> StepRun:
    """A step's row, made once as a transition (planner_locks.rows_name, as a plan names a run's
    next row): queued with its `step.queued`, asking for its device's lock when
    `new.acquire` (dispatched in the same transaction when granted). A redelivered start
    finds the row it made before instead; still queued, that row asks for its lock again."""
    row = _row_made(new)
    if row is None:
        batch = Executor({})
        conflicted: list[bool] = []
        batch.plan.creating.append(new)
        _transition(batch, lambda: None, lambda: conflicted.append(True), "reading the row made meanwhile")
        if not conflicted:
            made = batch.plan.new_rows[0]
            made.run = new.run
            return made
        # Another transition made it first (the unique run, phase, index, device).
        row = _row_made(new)
        if row is None:
            raise BatchRetry(f"the row of step {new.index} of run {new.run.pk} could not be made")
    if new.acquire and row.status == StepStatus.QUEUED:
        rows_start([row.pk])
    return row


def _row_made(new: effects.NewRow) -> StepRun | None:
    row = (
        StepRun.objects.select_related("device")
        .filter(run=new.run, phase=new.phase, index=new.index, device=new.device)
        .first()
    )
    if row is not None:
        row.run = new.run
    return row


# A preemption that keeps finding the device's holder moved is planned again this many times
# (each from a fresh read of the lock and the rows); then the urgent row waits in the queue.
PREEMPT_RETRIES = 3


def row_preempt_apply(*, step_run_id: int, retries: int = PREEMPT_RETRIES) -> bool:
    """An urgent row that joined a busy device's queue takes the device from the command in
    flight there, if that command's run has a lower priority (preempt.py: the command is
    canceled on the device and its row queued again, one transition, one lock call).
    Returns whether it did; a row with nothing to preempt waits in the queue as any other."""
    rows = rows_select(StepRun, "id", [step_run_id], related=("run", "device"))
    if not rows or rows[0].device_id is None:
        return False
    row = rows[0]
    state = device_lock_states([row.device.name])[row.device.name]
    victim_id = holder_step_id(state.holder) if state.holder else None
    victims = rows_select(StepRun, "id", [victim_id], related=("run", "device")) if victim_id else []
    victim = victims[0] if victims else None
    why_not = preempt_refusal(row, victim, state.fence)
    if why_not:
        log.info("urgent step %s does not preempt on %s: %s", row.pk, row.device.name, why_not)
        return False
    batch = PreemptExecutor({})
    done = [False]

    def prepare() -> None:
        batch.preempt(row, victim, state.fence)
        done[0] = True

    def again() -> None:
        done[0] = retries > 0 and row_preempt_apply(step_run_id=step_run_id, retries=retries - 1)

    _transition(batch, prepare, again, "planning it again from a fresh read")
    return done[0]


def run_begin(*, run_id: str) -> None:
    """The `run_advance` task: start a run (or its step at the cursor) as one transition."""
    transition_apply(starts=[run_id])


# What a plan's `Later` entries run after the commit (effects.Later.what -> the function).
LATER_WORK: dict[str, Callable[..., None]] = {
    "continue": run_continue,
    "enter": run_step_enter,
    "pass_on": lambda *, device, holder, fence: device_lock_pass_on(device, holder=holder, fence=fence),
    "handoff": lambda *, device, grant: device_lock_handoff(device, grant),
    "policy": _policy,
    "preempt": row_preempt_apply,
}


def _transition(
    batch: Executor, prepare: Callable[[], None], conflicted: Callable[[], None], conflicted_what: str
) -> None:
    """A transition (executor.transition) whose one-at-a-time leftovers run as LATER_WORK says."""
    transition(batch, prepare, conflicted, conflicted_what, LATER_WORK)
