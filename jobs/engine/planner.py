"""The step engine's decisions for a batch of inputs, without I/O: the plan of a transition.

A transition (jobs/engine/batch.py runs it) reads the rows its inputs name, asks this
module what follows, and carries the answer out. Every function here takes rows already
read (model instances with their run and device loaded) and adds to a `Plan`; none reads
or writes the database, Redis or the broker, so the same decisions run in the unit tier's
simulation (tests/unit/jobs/test_engine_simulation.py) with an in-memory executor. The plan
itself is effects.py's; this module holds the first two stages (inputs, and the runs they
move on), planner_locks.py the third (the next rows, the lock call's answers, hand-offs).

| input                     | facts it is planned from          | effects in the plan                  |
| ------------------------- | --------------------------------- | ------------------------------------ |
| run start `runs_begin`    | the run rows                      | run compare-and-set, `run.started`,  |
|                           |                                   | the run's max_duration deadline      |
| start of a running run    | the row at its cursor             | the row named, or its lock asked     |
| `runs_begin`              |                                   | again (still queued)                 |
| ack, progress             | the step row its command id names | row compare-and-set (in progress,    |
| `replies_plan`            |                                   | progress), ack/send deadlines gone   |
| extend_seconds            | the same                          | deadline compare-and-set, `done`     |
|                           |                                   | deadline and lease moved             |
| stale, unknown, foreign   | the row the id names, if any      | a sampled event (`add_sampled`)      |
| done `replies_plan`       | the same                          | attempt end (`attempt_outcome`),     |
|                           |                                   | lock release and hand-on, deadlines  |
| due ack, done `dues_plan` | the step row the deadline names   | as a failed, retryable done          |
| due retry `dues_plan`     | the same                          | row queued again, lock acquire       |
| due window `dues_plan`    | the same                          | the same (held again if it must)     |
| cancel `cancel_plan`      | the run, its rows not ended       | run and rows canceled, locks handed  |
|                           |                                   | on or left, `cancel` commands        |
| due run `run_time_out_plan` | the same                        | the same, timed out; the run ended   |
| due end `run_end_by_plan` | the same                          | canceled, or (finish) rows not sent  |
|                           |                                   | canceled, those at work go on        |
| row ended `runs_continue` | its run                           | cursor moved, or the run ended       |
| a step's outcome decided  | the run                           | the same (`steps_decide`; a fan-out's|
| elsewhere `steps_decide`  |                                   | summary, a refused start, a delay)   |
| next rows, rows a kind's  | their devices, reserved ids       | row inserted, lock acquire (attempt  |
| start asks for `rows_name`|                                   | deadlines written on grant); held by |
|                           |                                   | its time windows: a `window` deadline|
| lock `locks_answered`     | the lock call's answers           | attempt dispatched, or `waiting`     |
| hand-off `handed_plan`    | the rows handed a device          | their dispatch, lease extended       |

What a plan cannot decide (a rollback's compensations, a fan-out or compensation row's
report to its kind, the start of a step of another kind, a holder that is no step) is a
`Later`: one-at-a-time work the executor runs after the commit (batch.py `LATER_WORK`).
Every row write is a compare-and-set (`RowWrite`): when another transition moved a row
first, the executor's transaction rolls back and the batch is planned again from a fresh
read.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from uuid import UUID

from devices import protocol
from devices.locks import Grant

from ..deadlines import KINDS, Deadline
from ..models import (
    STEP_IN_FLIGHT,
    STEP_TERMINAL,
    EndBehaviour,
    JobRun,
    Phase,
    RunStatus,
    StepRun,
    StepStatus,
)
from .attempts import Outcome, attempt_deadlines, attempt_extension, attempt_outcome
from .effects import Plan
from .kinds import (
    row_batched,
    row_behaviour,
    row_commanded,
    row_deadline_handler,
    row_ended_handler,
    spec_behaviour,
)
from .plan import (
    RUN_ACTIVE,
    command_id_step,
    step_answerer,
    step_holder,
    step_spec,
)
from .planner_locks import row_acquire
from .progress import PROGRESS_FIELDS, progress_keep
from .runs import run_next, step_error

# Fields a plan writes, per kind of row write.
ACK_FIELDS = ["status", "acked_at", *PROGRESS_FIELDS]
END_FIELDS = ["status", "error", "finished_at", "result", *PROGRESS_FIELDS, "deadline", "acked_at"]
REQUEUE_FIELDS = ["status", "queued_at", "deadline"]
RUN_FINISH_FIELDS = ["cursor", "status", "error", "finished_at"]
# Fields a queue timeout writes.
QUEUE_TIMEOUT_FIELDS = ["status", "error", "finished_at"]


# --- 1. inputs: run starts, replies, due deadlines ---------------------------------


def runs_begin(
    plan: Plan, runs: dict[UUID, JobRun], run_ids: list[str], at_cursor: dict[UUID, StepRun]
) -> None:
    """Pending runs start (running, their first step next). A running run's start again (a
    redelivered start, the monitor's sweep) resumes the step at its cursor: its row is
    named if it has none (`at_cursor` holds the rows read there), asks for its device's
    lock again if it is still queued, and is left alone otherwise; another kind of step
    starts the general way. A run in any other state stays as it is."""
    pending, seen = [], set()
    for run_id in run_ids:
        run = runs.get(UUID(str(run_id)))
        if run is None or run.pk in seen:
            continue
        seen.add(run.pk)
        if run.status == RunStatus.RUNNING:
            _run_resume(plan, run, at_cursor.get(run.pk))
            continue
        if run.status != RunStatus.PENDING or (run.not_before is not None and run.not_before > plan.now):
            continue  # (a run not due yet is started by its `start` deadline)
        run.status, run.started_at = RunStatus.RUNNING, plan.now
        if run.max_duration:
            run.deadline = plan.now + timedelta(seconds=run.max_duration)
            # Set after the commit: a deadline that fired before it would find the run pending.
            plan.run_deadlines[Deadline("run", str(run.pk), 0)] = run.deadline
        plan.events.add("run.started", run=run, message=f"{len(run.plan)} steps")
        plan.starting.append(run)
        pending.append(run)
    timed = any(run.max_duration for run in pending)
    fields = ["status", "started_at", *(["deadline"] if timed else [])]
    plan.write(JobRun, pending, fields, status_in=(RunStatus.PENDING,), conflict="a run started meanwhile")


def _run_resume(plan: Plan, run: JobRun, row: StepRun | None) -> None:
    if run.cursor >= len(run.plan) or not spec_behaviour(run.plan[run.cursor]).batched_start:
        plan.later_add("enter", run=run, index=run.cursor)
    elif row is None:
        plan.starting.append(run)
    elif row.status == StepStatus.QUEUED:
        row.run = run
        row_acquire(plan, row)


def replies_plan(
    plan: Plan,
    rows: dict[str, StepRun],
    replies: list[tuple[str, protocol.Reply]],
    earlier: dict[int, StepRun] | None = None,
) -> None:
    """Every reply of the batch. To a current attempt, an ack or progress marks it in
    progress (`extend_seconds` pushes its deadline out), a done ends it (the first done of
    a batch for a command; a second is stale). Anything else is recorded, sampled: a reply
    to an attempt that ended or an earlier attempt (`earlier`: the rows the unmatched
    command ids name) is stale, one to no step's command unknown, one to a command of
    another device foreign."""
    dones: list[tuple[StepRun, dict]] = []
    ending: set[str] = set()
    extended: dict[int, StepRun] = {}
    for device, reply in replies:
        row = rows.get(reply.command_id)
        if row is None:
            _unmatched(plan, (earlier or {}).get(command_id_step(reply.command_id)), device, reply)
        elif row.device_name != device:
            # A task step's outcome comes from its device's name, or "" without one.
            plan.events.add_sampled(
                "reply.foreign_device",
                step_run=row,
                device=device,
                message=f"{device} answered a command of {row.device_name or 'no device'}; ignored",
            )
        elif row.status not in STEP_IN_FLIGHT or reply.command_id in ending:
            ended = "outcome for" if reply.kind == "done" else f"{reply.kind} after"
            plan.events.add_sampled(
                "reply.stale", device=device, step_run=row, message=f"{ended} an attempt that already ended"
            )
        elif reply.kind == "done":
            ending.add(reply.command_id)
            how = {
                "ok": bool(reply.ok),
                "result": reply.result,
                "error": reply.error,
                "retryable": reply.retryable,
                "rejected": reply.rejected,
            }
            dones.append((row, how))
        else:
            _ack(plan, row, reply)
            if reply.extend_seconds and _extend(plan, row, reply.extend_seconds):
                extended[row.pk] = row
    ending_ids = {row.pk for row, _ in dones}
    acked = [row for pk, row in plan.acks.items() if pk not in ending_ids]
    plan.write(
        StepRun, acked, ACK_FIELDS, status_in=STEP_IN_FLIGHT, conflict="an acked attempt ended meanwhile"
    )
    plan.write(
        StepRun,
        [row for pk, row in extended.items() if pk not in ending_ids],
        ["deadline"],
        status_in=STEP_IN_FLIGHT,
        match="command_id",
        conflict="an extended attempt ended meanwhile",
    )
    attempts_end(plan, dones)


def _unmatched(plan: Plan, row: StepRun | None, device: str, reply: protocol.Reply) -> None:
    """A reply whose id is no step's current command: late (an earlier attempt) or unknown."""
    if row is not None and row.device_name == device:
        plan.events.add_sampled(
            "reply.stale",
            device=device,
            step_run=row,
            message=f"{reply.kind} for an earlier attempt ({reply.command_id}); ignored",
            reply_id=reply.command_id,
        )
        return
    plan.events.add_sampled(
        "reply.unknown", device=device, message=f"{reply.kind} for unknown command {reply.command_id}"
    )


def _extend(plan: Plan, row: StepRun, seconds: float) -> bool:
    """The device asks for more time (`attempt_extension`); True when its deadline moved."""
    extension = attempt_extension(row, seconds=seconds, now=plan.now)
    if extension.deadline is None:
        plan.events.add_sampled(
            "step.extend_refused",
            device=row.device_name,
            step_run=row,
            message=f"asked for {seconds:g}s more; {extension.refused}; deadline unchanged",
            extend_seconds=seconds,
            max_extend_seconds=extension.maximum,
        )
        return False
    if row.deadline is not None and row.deadline <= plan.now:
        plan.events.add_sampled(
            "reply.stale",
            device=row.device_name,
            step_run=row,
            message="extend_seconds after the attempt's deadline",
        )
        return False
    row.deadline = extension.deadline
    plan.zset_add({Deadline.of("done", row): row.deadline})
    if row.device_id is not None:
        op = plan.locks.extend(
            row.device.name, holder=step_holder(row), fence=row.fence, lease_seconds=extension.lease_seconds
        )
        plan.extends.add(op)
    plan.events.add_sampled(
        "step.extended",
        device=row.device_name,
        step_run=row,
        message=f"deadline moved to {row.deadline.isoformat()} (+{seconds:g}s asked)",
        extend_seconds=seconds,
        deadline=row.deadline.isoformat(),
    )
    return True


def _ack(plan: Plan, row: StepRun, reply: protocol.Reply) -> None:
    if row.status == StepStatus.DISPATCHED:
        row.status = StepStatus.IN_PROGRESS
        row.acked_at = row.acked_at or plan.now
        plan.zset_remove([Deadline.of(kind, row) for kind in ("ack", "send")])
        plan.events.add("step.in_progress", step_run=row, message=f"{reply.kind} received")
    event = progress_keep(row, reply)
    if event:
        plan.events.add(event.pop("kind"), **event)
    plan.acks[row.pk] = row


def dues_plan(
    plan: Plan, rows: dict[int, StepRun], deadlines: list[Deadline], holders: dict[str, Grant] | None = None
) -> None:
    """Due `ack` / `done` deadlines time their attempt out (retried while it has budget),
    a due `retry` queues the step again for the device's lock, a due `dispatch` (flow
    control's, or a hand-off's that was lost) or `queue` dispatches a queued row that holds
    its device's lock (`holders`: the lock's holder per device, read for them) as a
    hand-off would, and a `queue` whose row holds nothing times it out (it waited too long
    for a busy or offline device); a deadline that no longer matches its row (another
    attempt, another status) changes nothing. A `done` whose row says later (the device
    extended the attempt) is watched again at the row's deadline. A kind that takes its
    rows' deadlines over (a delay) is left to its handler (`plan.unplanned`)."""
    timing_out: list[StepRun] = []
    requeued: list[StepRun] = []
    queue_timed_out: list[StepRun] = []
    reopened: list[StepRun] = []
    seen: set[int] = set()
    for deadline in deadlines:
        row = rows.get(deadline.step_run_id)
        if row is None or row.attempt != deadline.attempt or row.pk in seen:
            continue
        if row_deadline_handler(row) is not None:
            plan.unplanned.append(deadline)
            continue
        if deadline.kind in ("retry", "dispatch", "window") and not row_batched(row):
            continue  # a kind that dispatches nothing (wait_online) is never retried or spaced
        answering = (StepStatus.DISPATCHED,) if deadline.kind == "ack" else STEP_IN_FLIGHT
        if deadline.kind in ("ack", "done") and row.status in answering:
            if deadline.kind == "done" and row.deadline is not None and row.deadline > plan.now:
                plan.zset_add({Deadline.of("done", row, deadline.attempt): row.deadline})
                continue
            spec = step_spec(row)
            waited = spec["ack_timeout_seconds"] if deadline.kind == "ack" else spec["timeout_seconds"]
            error = f"no {deadline.kind} from {step_answerer(row)} within {waited}s"
            # Its lock operations in the deadlines' order, as one at a time would make them.
            _attempt_end(plan, row, {"ok": False, "error": error, "retryable": True, "timed_out": True})
            timing_out.append(row)
            seen.add(row.pk)
        elif deadline.kind == "retry" and row.status == StepStatus.RETRYING:
            spec = step_spec(row)
            row.status, row.queued_at = StepStatus.QUEUED, plan.now
            row.deadline = plan.now + timedelta(seconds=spec["queue_timeout_seconds"])
            plan.events.add("step.queued", step_run=row, message=f"for attempt {row.attempt + 1}")
            requeued.append(row)
            row_acquire(plan, row, written=True)
            seen.add(row.pk)
        elif deadline.kind == "window" and row.status == StepStatus.QUEUED:
            # Its window opened (or its quiet hours ended): it asks for its device again,
            # with a queue deadline from now (`row_acquire` holds it again if it must).
            spec = step_spec(row)
            row.queued_at = plan.now
            row.deadline = plan.now + timedelta(seconds=spec["queue_timeout_seconds"])
            reopened.append(row)
            row_acquire(plan, row, written=True)
            seen.add(row.pk)
        elif deadline.kind in ("dispatch", "queue") and row.status == StepStatus.QUEUED:
            seen.add(row.pk)
            grant = (holders or {}).get(row.device.name) if row.device_id is not None else None
            if row.device_id is None and row_batched(row):
                row_acquire(plan, row)  # a row without a device whose dispatch was lost: now
            elif grant is not None and grant.holder == step_holder(row):
                plan.handed.append((row.device.name, grant))  # it holds the lock: dispatched
            elif deadline.kind == "queue":
                _queue_time_out(plan, row)
                queue_timed_out.append(row)
    plan.write(
        StepRun,
        requeued,
        REQUEUE_FIELDS,
        status_in=(StepStatus.RETRYING,),
        match="attempt",
        conflict="a retrying step moved meanwhile",
    )
    plan.write(
        StepRun,
        reopened,
        ["queued_at", "deadline"],
        status_in=(StepStatus.QUEUED,),
        match="attempt",
        conflict="a held step moved meanwhile",
    )
    _attempts_write(plan, timing_out)
    plan.write(
        StepRun,
        queue_timed_out,
        QUEUE_TIMEOUT_FIELDS,
        status_in=(StepStatus.QUEUED,),
        match="attempt",
        conflict="a queued step moved meanwhile",
    )


def _queue_time_out(plan: Plan, row: StepRun) -> None:
    """A row that waited past its queue deadline for a busy or offline device (or one that
    never came online) times out: it leaves the device's queue, and its run moves on."""
    spec = step_spec(row)
    error = row_behaviour(row).queue_timeout_error.format(
        device=row.device_name,
        seconds=spec["queue_timeout_seconds"],
        why="offline" if row.device_id is not None and not row.device.reachable else "busy",
    )
    row.status, row.error, row.finished_at = StepStatus.TIMED_OUT, error, plan.now
    if row.device_id is not None:
        plan.dequeues.add(plan.locks.dequeue(row.device.name, holder=step_holder(row)))
    plan.events.add("step.timed_out", step_run=row, message=error)
    changes = {"status": row.status, "error": error, "finished_at": plan.now}
    plan.ended.append((row, Outcome(StepStatus.TIMED_OUT, changes, False, error)))


# Runs a cancel ends.
RUN_CANCELABLE = (RunStatus.PENDING, *RUN_ACTIVE)
CANCEL_FIELDS = ["status", "error", "finished_at"]


def cancel_plan(plan: Plan, run: JobRun, rows: list[StepRun], *, reason: str) -> bool:
    """Cancel a run that has not ended (False when it has) with its rows that have not
    (`rows_stop`). The device's late `done` for a canceled command is then stale."""
    if run.status not in RUN_CANCELABLE:
        return False
    run.status, run.error, run.finished_at = RunStatus.CANCELED, reason, plan.now
    plan.write(JobRun, [run], CANCEL_FIELDS, status_in=RUN_CANCELABLE, conflict="a run ended meanwhile")
    plan.events.add("run.canceled", run=run, message=reason)
    rows_stop(plan, rows, status=StepStatus.CANCELED, reason=reason)
    return True


def run_time_out_plan(plan: Plan, run: JobRun, rows: list[StepRun]) -> bool:
    """A running run past its max_duration (False when it is not: ended, compensating, or
    its deadline was moved): its forward rows at work end `timed_out` (`rows_stop`), rows
    not started are skipped; then the current step's policy decides as for a step that
    timed out: a policy of its own (a rollback) after the commit, the general way; abort
    and continue end the run `timed_out`."""
    if run.status != RunStatus.RUNNING or run.deadline is None or run.deadline > plan.now:
        return False
    reason = f"run exceeded its max_duration ({run.max_duration}s)"
    forward = [row for row in rows if row.phase == Phase.FORWARD]
    skipped = [row for row in forward if row.status == StepStatus.PENDING]  # fan-out rows not started
    for row in skipped:
        row.status, row.error, row.finished_at = StepStatus.SKIPPED, reason, plan.now
    plan.write(
        StepRun, skipped, CANCEL_FIELDS, status_in=(StepStatus.PENDING,), conflict="a row started meanwhile"
    )
    rows_stop(
        plan,
        [row for row in forward if row.status != StepStatus.SKIPPED],
        status=StepStatus.TIMED_OUT,
        reason=reason,
    )
    index = min(run.cursor, len(run.plan) - 1)
    decided = run_next(run, index, ok=False, status=StepStatus.TIMED_OUT, error=reason)
    if decided.policy:
        plan.later_add("policy", run=run, policy=decided.policy, error=reason)
        return True
    run.status, run.error, run.finished_at = RunStatus.TIMED_OUT, reason, plan.now
    plan.write(JobRun, [run], CANCEL_FIELDS, status_in=(RunStatus.RUNNING,), conflict="a run ended meanwhile")
    plan.events.add("run.timed_out", run=run, message=reason)
    return True


def run_end_by_plan(plan: Plan, run: JobRun, rows: list[StepRun]) -> bool:
    """A run at its end by (False when it is not: ended, compensating, or not due). With
    `cancel`, and for a run that has not started, it is canceled (`cancel_plan`). With
    `finish`, its commands at work go on and nothing new starts: rows not sent yet are
    canceled (a fan-out's devices not started skipped), and the run ends `canceled` once
    no command is at work (`steps_decide` ends it instead of moving on)."""
    if (
        run.end_by is None
        or run.end_by > plan.now
        or run.status not in (RunStatus.PENDING, RunStatus.RUNNING)
    ):
        return False
    reason = f"end by {run.end_by.isoformat()} reached"
    if run.end_behaviour != EndBehaviour.FINISH or run.status == RunStatus.PENDING:
        return cancel_plan(plan, run, rows, reason=reason)
    forward = [row for row in rows if row.phase == Phase.FORWARD and row.status not in STEP_TERMINAL]
    skipped = [row for row in forward if row.status == StepStatus.PENDING]
    for row in skipped:
        row.status, row.error, row.finished_at = StepStatus.SKIPPED, reason, plan.now
    plan.write(
        StepRun, skipped, CANCEL_FIELDS, status_in=(StepStatus.PENDING,), conflict="a row started meanwhile"
    )
    waiting = [row for row in forward if row.status in (StepStatus.QUEUED, StepStatus.RETRYING)]
    rows_stop(plan, waiting, status=StepStatus.CANCELED, reason=reason)
    at_work = [row for row in forward if row.status in STEP_IN_FLIGHT]
    plan.events.add(
        "run.ending", run=run, message=f"{reason}: {len(at_work)} commands at work finish, nothing new starts"
    )
    if not at_work:
        run.status, run.error, run.finished_at = RunStatus.CANCELED, reason, plan.now
        plan.write(
            JobRun, [run], CANCEL_FIELDS, status_in=(RunStatus.RUNNING,), conflict="a run ended meanwhile"
        )
        plan.events.add("run.canceled", run=run, message=reason)
    return True


def run_ended_by(run: JobRun, now: datetime) -> bool:
    """Whether the run is past an end by that lets what started finish (`finish`): it
    starts no next step."""
    return run.end_by is not None and run.end_by <= now and run.end_behaviour == EndBehaviour.FINISH


def rows_stop(plan: Plan, rows: list[StepRun], *, status: str, reason: str) -> None:
    """End the rows that have not ended as `status` (canceled, or timed out by the run's
    max_duration): an in-flight attempt's device is sent a `cancel` after the commit and its
    lock handed on at once (the next waiter is dispatched in the same transition); a queued
    row leaves its device's queue."""
    by_status: dict[str, list[StepRun]] = {}
    for row in rows:
        if row.status in STEP_TERMINAL:
            continue
        was = row.status
        row.status, row.error, row.finished_at = status, reason, plan.now
        by_status.setdefault(was, []).append(row)
        plan.zset_remove([Deadline.of(kind, row) for kind in KINDS])
        if was in STEP_IN_FLIGHT and row.command_id:
            # A task step's body is not interrupted: its outcome will be stale.
            if row_commanded(row):
                plan.cancels.append(row)
            if row.device_id is not None:
                index = plan.locks.release(row.device.name, holder=step_holder(row), fence=row.fence)
                plan.releases[index] = row
        elif row.device_id is not None:
            plan.dequeues.add(plan.locks.dequeue(row.device.name, holder=step_holder(row)))
        plan.events.add(f"step.{status}", step_run=row, message=reason)
    for was, group in by_status.items():
        plan.write(
            StepRun,
            group,
            CANCEL_FIELDS,
            status_in=(was,),
            match="attempt",
            conflict="a step moved meanwhile",
        )


# --- 2. attempts end, runs move on --------------------------------------------------


def attempts_end(plan: Plan, ending: list[tuple[StepRun, dict]]) -> None:
    """End these in-flight attempts as `how` says (`attempt_outcome`); their locks are
    released, each handing its device on, in the lock call."""
    for row, how in ending:
        _attempt_end(plan, row, how)
    _attempts_write(plan, [row for row, _ in ending])


def _attempt_end(plan: Plan, row: StepRun, how: dict) -> None:
    outcome = attempt_outcome(row, now=plan.now, **how)
    for name, value in outcome.changes.items():
        setattr(row, name, value)
    plan.events.add(f"step.{outcome.status}", step_run=row, message=outcome.message)
    cleared, retry = attempt_deadlines(row, outcome)
    plan.zset_remove(cleared)
    plan.zset_add(retry)
    if row.device_id is not None:  # a task step may have no device, and no lock
        index = plan.locks.release(row.device.name, holder=step_holder(row), fence=row.fence)
        plan.releases[index] = row
    plan.ended.append((row, outcome))


def _attempts_write(plan: Plan, rows: list[StepRun]) -> None:
    plan.write(
        StepRun,
        rows,
        END_FIELDS,
        status_in=STEP_IN_FLIGHT,
        match="command_id",
        conflict="an attempt ended meanwhile",
    )


@dataclass(frozen=True)
class StepDone:
    """A step's final outcome, which decides its run (`steps_decide`)."""

    run: JobRun
    index: int
    ok: bool
    status: str
    error: str


def runs_continue(plan: Plan) -> None:
    """Move on the runs whose step ended for good (`steps_decide`). A row that is not its
    step's whole outcome (a fan-out's, a compensation's) reports to the handler its kind
    declared, after the commit (`kinds.row_ended`)."""
    fanouts, done = set(), []
    for row, outcome in plan.ended:
        if outcome.retry or row.status == StepStatus.CANCELED:
            continue
        if row_ended_handler(row) is not None:
            # One progress check per fan-out and batch, however many of its rows ended.
            if (row.run.pk, row.index, row.phase) not in fanouts:
                fanouts.add((row.run.pk, row.index, row.phase))
                plan.later_add("continue", step_run=row)
            continue
        ok = row.status == StepStatus.SUCCEEDED
        done.append(StepDone(row.run, row.index, ok, row.status, step_error(row)))
    steps_decide(plan, done)


def steps_decide(plan: Plan, done: list[StepDone]) -> None:
    """Each step's final outcome decides its run (`runs.run_next`) if the run is still
    running at that step: the run moves on (its next step started in this plan), ends, or
    its failure policy decides after the commit (a rollback)."""
    moved, finished = [], []
    for step in done:
        run = step.run
        if run.status != RunStatus.RUNNING or run.cursor != step.index:
            continue
        decided = run_next(run, step.index, ok=step.ok, status=step.status, error=step.error)
        if decided.policy:
            plan.later_add("policy", run=run, policy=decided.policy, error=step.error)
            continue
        if decided.cursor is not None:
            run.cursor = decided.cursor
        if not decided.status and run_ended_by(run, plan.now):
            error = f"end by {run.end_by.isoformat()} reached; the steps from #{run.cursor} did not run"
            decided = replace(decided, status=RunStatus.CANCELED, error=error)
        if decided.status:
            run.status, run.error, run.finished_at = decided.status, decided.error, plan.now
            finished.append(run)
            plan.events.add(f"run.{decided.status}", run=run, message=decided.error)
        else:
            moved.append(run)
            plan.starting.append(run)
    running = (RunStatus.RUNNING,)
    plan.write(JobRun, moved, ["cursor"], status_in=running, conflict="a run moved meanwhile")
    plan.write(JobRun, finished, RUN_FINISH_FIELDS, status_in=running, conflict="a run ended meanwhile")
