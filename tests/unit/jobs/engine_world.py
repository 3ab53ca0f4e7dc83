"""The in-memory world the engine simulation (test_engine_simulation.py) drives the planner
in: rows in dicts, each write a compare-and-set applied in order and rolled back on a
conflict, the device locks as a model of devices/lua/transition.lua's rules, deadlines in a
sorted map, devices as mailboxes. Its executor is jobs/engine/batch.py's `_transition`,
without I/O."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from uuid import UUID

from devices import protocol
from devices.locks import Grant, LockBatch, NotReady, Queued
from devices.models import Device
from jobs.deadlines import Deadline
from jobs.engine import planner
from jobs.engine.plan import step_holder
from jobs.models import JobRun, Phase, RunStatus, StepRun, StepStatus

STEP_TERMINAL = {
    StepStatus.SUCCEEDED,
    StepStatus.FAILED,
    StepStatus.REJECTED,
    StepStatus.TIMED_OUT,
    StepStatus.CANCELED,
}
RUN_TERMINAL = {RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.TIMED_OUT, RunStatus.CANCELED}
DEVICES = ("d0", "d1", "d2")
EPOCH = datetime(2026, 1, 1, tzinfo=UTC)
BAND = 2**40


class Conflict(Exception):
    """A compare-and-set found a row moved: the transition is undone and planned again."""


@dataclass
class Lock:
    holder: str | None = None
    fence: int = 0
    counter: int = 0
    queue: list[tuple[int, str]] = field(default_factory=list)  # (score, holder), sorted


class Locks:
    """transition.lua's rules for acquire, release-and-hand-on and extend, in memory."""

    def __init__(self) -> None:
        self.devices: dict[str, Lock] = {d: Lock() for d in DEVICES}
        self.seq = 0
        self.ready = True
        self.zset: dict[str, int] = {}  # deadline member -> due ms

    def snapshot(self) -> tuple:
        return (
            {d: Lock(v.holder, v.fence, v.counter, list(v.queue)) for d, v in self.devices.items()},
            self.seq,
            self.ready,
            dict(self.zset),
        )

    def restore(self, snap: tuple) -> None:
        devices, self.seq, self.ready, zset = snap
        self.devices, self.zset = devices, zset

    def apply(self, batch: LockBatch) -> list:
        outcomes = []
        for op in batch.ops:
            lock = self.devices[op["d"]]
            if op["o"] == "a":
                outcomes.append(self._acquire(lock, op))
            elif op["o"] == "r":
                outcomes.append(self._release(lock, op))
            elif op["o"] == "e":
                outcomes.append(lock.holder == op["h"] and lock.fence == op["f"])
            elif op["o"] == "q":
                waiting = [h for _, h in lock.queue]
                lock.queue = [(score, h) for score, h in lock.queue if h != op["h"]]
                outcomes.append(op["h"] in waiting)
            else:
                raise AssertionError(f"op {op['o']} is not simulated")
        for writes in batch.writes.values():
            self.zset.update(writes.get("zadd", {}))
            for member in writes.get("zrem", []):
                self.zset.pop(member, None)
        return outcomes

    def _acquire(self, lock: Lock, op: dict):
        if not self.ready:
            self.zset.update({m: s for s, m in op.get("q", [])})
            return NotReady()
        if lock.holder == op["h"]:
            self.zset.update({m: s for s, m in op.get("g", [])})
            return Grant(op["h"], lock.fence, held=True)
        if lock.holder is None and not lock.queue:
            lock.counter += 1
            lock.holder, lock.fence = op["h"], lock.counter
            self.zset.update({m: s for s, m in op.get("g", [])})
            return Grant(op["h"], lock.fence)
        if op["h"] not in [h for _, h in lock.queue]:
            self.seq += 1
            lock.queue.append(((9 - op["p"]) * BAND + self.seq, op["h"]))
            lock.queue.sort()
        self.zset.update({m: s for s, m in op.get("q", [])})
        return Queued([h for _, h in lock.queue].index(op["h"]) + 1)

    @staticmethod
    def _release(lock: Lock, op: dict):
        if lock.holder != op["h"] or lock.fence != op["f"]:
            return None
        if not lock.queue:
            lock.holder = None
            return None
        _, head = lock.queue.pop(0)
        lock.counter += 1
        lock.holder, lock.fence = head, lock.counter
        return Grant(head, lock.fence)


def _copy(row):
    """A fresh read of a stored row (what a SELECT would return)."""
    fresh = type(row)(**{f.attname: getattr(row, f.attname) for f in row._meta.concrete_fields})
    return fresh


class World:
    """The database, the locks, the broker and the devices, in memory."""

    def __init__(self) -> None:
        self.now = EPOCH
        self.runs: dict = {}
        self.rows: dict[int, StepRun] = {}
        self.devices = {
            name: Device(id=i + 1, name=name, enabled=True, online=True, presence_required=True)
            for i, name in enumerate(DEVICES)
        }
        self.locks = Locks()
        self.next_id = 1
        self.events: list = []
        self.sampled: list[str] = []  # kinds of the sampled events planned
        self.inbox: dict[str, list[dict]] = {d: [] for d in DEVICES}  # commands received
        self.fences: dict[str, int] = {d: 0 for d in DEVICES}  # highest fence each device saw
        self.history: dict[int, list[str]] = {}
        self.crash_next_publish = False
        self.members: set[str] = set()  # every deadline ever set, to fire again late

    # --- reads -----------------------------------------------------------------------

    def run_read(self, run_id) -> JobRun:
        return _copy(self.runs[run_id])

    def row_read(self, pk: int) -> StepRun:
        row = _copy(self.rows[pk])
        row.run = self.run_read(row.run_id)
        row.device = _copy(self.devices[self.rows[pk].device.name])
        return row

    def by_command(self, command_ids) -> dict[str, StepRun]:
        return {r.command_id: self.row_read(pk) for pk, r in self.rows.items() if r.command_id in command_ids}

    # --- the executor (jobs/engine/batch.py `_transition`, in memory) ---------------

    def transition(self, prepare) -> planner.Plan:
        """Plan with `prepare(plan)` from fresh reads, carry it out, commit, publish. Each
        write is checked and applied in order, as the database would inside the
        transaction; a conflict rolls the writes and the lock calls back."""
        snap, undo = self.locks.snapshot(), []
        plan = planner.Plan(now=self.now)
        try:
            prepare(plan)
            names = planner.rows_wanted(plan)
            self._write(plan.writes, undo)
            ids = list(range(self.next_id, self.next_id + len(plan.naming)))
            planner.rows_name(plan, {n: _copy(self.devices[n]) for n in names}, ids)
            outcomes = self.locks.apply(plan.locks)
            planner.locks_answered(plan, outcomes)
            handed = {pk: self.row_read(pk) for pk in planner.handed_ids(plan) if pk in self.rows}
            self.locks.apply(planner.handed_plan(plan, handed))
            self._insert(plan.new_rows, undo)
            self._write(planner.dispatches_writes(plan), undo)
        except Conflict:
            for revert in reversed(undo):
                revert()
            self.locks.restore(snap)
            raise
        self.next_id += len(plan.naming)
        self._commit(plan)
        return plan

    def _write(self, writes: list[planner.RowWrite], undo: list) -> None:
        for write in writes:
            store = self.runs if write.model is JobRun else self.rows
            for row in write.rows:
                stored = store.get(row.pk)
                if stored is None or stored.status not in write.status_in:
                    raise Conflict(write.conflict)
                if write.match and getattr(stored, write.match) != getattr(row, write.match):
                    raise Conflict(write.conflict)
                was = {name: getattr(stored, name) for name in write.fields}
                undo.append(lambda stored=stored, was=was: [setattr(stored, k, v) for k, v in was.items()])
                for name in write.fields:
                    setattr(stored, name, getattr(row, name))
                if write.model is StepRun:
                    self.history[row.pk].append(row.status)
                    undo.append(self.history[row.pk].pop)

    def _insert(self, rows: list[StepRun], undo: list) -> None:
        for row in rows:
            stored = _copy(row)
            stored.device = self.devices[row.device.name]
            self.rows[row.pk] = stored
            self.history[row.pk] = [row.status]
            undo.append(lambda pk=row.pk: (self.rows.pop(pk), self.history.pop(pk)))

    def _commit(self, plan: planner.Plan) -> None:
        self.events += plan.events.events
        for d, when in plan.run_deadlines.items():
            self.locks.zset[d.member] = int(when.timestamp() * 1000)
        # Every input of this world (command steps only) is planned whole: nothing is left
        # to the general path.
        assert not plan.later, plan.later
        # Replies that answer no current attempt: recorded, sampled (counted in Redis).
        self.sampled += [kind for kind, _, _ in plan.events.sampled]
        assert not plan.rebuild
        if self.crash_next_publish:
            self.crash_next_publish = False  # the worker died after its commit
            return
        for row in plan.dispatches:
            self.publish(self.rows[row.pk])
        for row in plan.dispatches:  # the broker confirmed them: their `send` checks go
            self.locks.zset.pop(Deadline.of("send", row).member, None)
        self.members |= set(self.locks.zset)

    def publish(self, row: StepRun) -> None:
        device = row.device.name
        self.inbox[device].append({"id": row.command_id, "token": row.fence, "pk": row.pk})

    # --- inputs ----------------------------------------------------------------------

    def apply(self, prepare) -> None:
        """As a worker does: plan and carry out; on a conflict, plan again from a fresh read."""
        for _ in range(5):
            try:
                self.transition(prepare)
                return
            except Conflict:
                continue
        raise AssertionError("a transition kept conflicting")

    def replies_apply(self, replies: list[tuple[str, protocol.Reply]]) -> None:
        def prepare(plan):
            rows = self.by_command({r.command_id for _, r in replies})
            planner.replies_plan(plan, rows, replies)
            planner.runs_continue(plan)

        self.apply(prepare)

    def cancel(self, run_id) -> None:
        def prepare(plan):
            rows = [self.row_read(pk) for pk, r in self.rows.items() if r.run_id == run_id]
            planner.cancel_plan(plan, self.run_read(run_id), rows, reason="canceled by tester")

        self.apply(prepare)

    def start(self, run_id) -> None:
        def prepare(plan):
            run = self.run_read(run_id)
            here = [
                pk
                for pk, r in self.rows.items()
                if r.run_id == run_id and r.phase == Phase.FORWARD and r.index == run.cursor
            ]
            at_cursor = {run_id: self.row_read(here[0])} if here else {}
            planner.runs_begin(plan, {run_id: run}, [str(run_id)], at_cursor)
            planner.runs_continue(plan)

        self.apply(prepare)

    def advance(self, seconds: float) -> None:
        """Time passes: due deadlines fire, as the monitor claims them."""
        self.now += timedelta(seconds=seconds)
        now_ms = int(self.now.timestamp() * 1000)
        due = sorted((s, m) for m, s in self.locks.zset.items() if s <= now_ms)
        for _, member in due:
            self.locks.zset.pop(member, None)
        deadlines = [Deadline.parse(m) for _, m in due]
        for d in deadlines:
            row = self.rows.get(d.step_run_id)
            if (
                d.kind == "send"
                and row is not None
                and row.attempt == d.attempt
                and row.status == "dispatched"
            ):
                self.publish(row)  # jobs/engine/dispatch.py `command_resend`
        for d in deadlines:
            if d.kind == "run":  # a run past its max_duration (jobs/cancel.py `run_time_out`)
                run_id = UUID(str(d.step_run_id))

                def timed_out(plan, run_id=run_id):
                    rows = [self.row_read(pk) for pk, r in self.rows.items() if r.run_id == run_id]
                    planner.run_time_out_plan(plan, self.run_read(run_id), rows)

                self.apply(timed_out)
        planned = [d for d in deadlines if d.kind in planner.PLANNED_DEADLINES]
        if planned:

            def prepare(plan):
                rows = {
                    d.step_run_id: self.row_read(d.step_run_id) for d in planned if d.step_run_id in self.rows
                }
                planner.dues_plan(plan, rows, planned)
                assert not plan.unplanned
                planner.runs_continue(plan)

            self.apply(prepare)
        for d in deadlines:
            row = self.rows.get(d.step_run_id)
            if d.kind == "queue" and row is not None and row.status == StepStatus.QUEUED:
                # Offline past its queue timeout: re-queued here for the simulation's end
                # (jobs/engine/due.py times it out; that path is not the planner's).
                self.locks.zset[d.member] = now_ms + 60_000

    def presence(self, device: str, online: bool) -> None:
        """A device goes offline or comes back; back, its waiting rows ask for the lock
        (jobs/presence.py, as a plan of their acquires)."""
        self.devices[device].online = online
        if not online:
            return
        waiting = [
            pk
            for pk, r in sorted(self.rows.items())
            if r.device.name == device and r.status == StepStatus.QUEUED and not self._queued_or_holding(r)
        ]

        def prepare(plan):
            for pk in waiting:
                planner.row_acquire(plan, self.row_read(pk))

        if waiting:
            self.apply(prepare)

    def _queued_or_holding(self, row: StepRun) -> bool:
        lock = self.locks.devices[row.device.name]
        holder = step_holder(row)
        return lock.holder == holder or holder in [h for _, h in lock.queue]

    def run_new(self, steps: list[tuple[str, str, int]], priority: int) -> JobRun:
        plan = [
            {
                "device": device,
                "action": "flash",
                "args": {"n": i},
                "on_failure": policy,
                "timeout_seconds": 30,
                "ack_timeout_seconds": 10 if attempts == 2 else 0,
                "queue_timeout_seconds": 600,
                "max_attempts": attempts,
                "backoff_seconds": 2,
            }
            for i, (device, policy, attempts) in enumerate(steps)
        ]
        run = JobRun(
            max_duration=90 if priority % 3 == 0 else None,
            id=UUID(int=len(self.runs) + 1),
            plan=plan,
            parameters={},
            priority=priority,
            status=RunStatus.PENDING,
            cursor=0,
        )
        self.runs[run.pk] = run
        return run


def reply(kind: str, command_id: str, *, ok=None, error="", retryable=False, rejected=False):
    return protocol.Reply(
        kind=kind,
        command_id=command_id,
        ok=ok,
        error=error,
        retryable=retryable,
        rejected=rejected,
        result={} if ok else None,
        progress=50 if kind == "progress" else None,
        detail="",
        extend_seconds=None,
    )


def row_copy(row: StepRun) -> StepRun:
    fresh = _copy(row)
    fresh.run, fresh.device = _copy(row.run), _copy(row.device)
    return fresh
