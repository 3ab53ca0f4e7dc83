"""The in-memory world the engine simulation (test_engine_simulation.py) drives the planner
in: rows in dicts, each write a compare-and-set applied in order and rolled back on a
conflict, the device locks as a model of devices/lua/transition.lua's rules (leases and
the epoch included), deadlines in a sorted map, devices as mailboxes. Its executor is
jobs/engine/batch.py's `_transition`, without I/O; its monitor tick is jobs/monitor.py's
(lost locks rebuilt as devices/lock_recovery.py and jobs/step_locks.py do, expired leases
reclaimed, then due deadlines)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import partial
from uuid import UUID

from devices import protocol
from devices.lock_recovery import LEASE_CLAIM_SECONDS
from devices.locks import Grant, LockBatch, NotReady, Preempted, Queued
from devices.models import Device
from jobs.deadlines import Deadline
from jobs.engine import effects, planner, planner_locks
from jobs.engine.kinds import PLANNED_DEADLINES
from jobs.engine.plan import holder_step_id, lease_seconds, step_holder, step_spec
from jobs.models import STEP_IN_FLIGHT, JobRun, Phase, RunStatus, StepRun, StepStatus
from jobs.step_locks import DEADLINE_KIND_FOR_STATUS

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
    lease: int | None = None  # the lease index's entry: expiry ms (None: no entry)


class Locks:
    """transition.lua's rules for acquire, release-and-hand-on, extend, dequeue, reclaim
    and restore, in memory, with the epoch (`ready`) and the deadlines' sorted set that
    live on the same Redis. `now_ms` is the script's clock (Redis TIME): the world's."""

    def __init__(self) -> None:
        self.devices: dict[str, Lock] = {d: Lock() for d in DEVICES}
        self.seq = 0
        self.ready = True
        self.zset: dict[str, int] = {}  # deadline member -> due ms
        self.now_ms = 0

    def snapshot(self) -> tuple:
        return (
            {d: Lock(v.holder, v.fence, v.counter, list(v.queue), v.lease) for d, v in self.devices.items()},
            self.seq,
            self.ready,
            dict(self.zset),
        )

    def restore(self, snap: tuple) -> None:
        devices, self.seq, self.ready, zset = snap
        self.devices, self.zset = devices, zset

    def lost(self) -> None:
        """Redis lost its data (a restart without persistence): every lock key, the arrival
        counter, the epoch and the deadlines' sorted set are gone."""
        self.devices = {d: Lock() for d in DEVICES}
        self.seq, self.ready, self.zset = 0, False, {}

    def apply(self, batch: LockBatch) -> list:
        outcomes = []
        for op in batch.ops:
            lock = self.devices[op["d"]]
            if op["o"] == "a":
                outcomes.append(self._acquire(lock, op))
            elif op["o"] == "r":
                outcomes.append(self._release(lock, op))
            elif op["o"] == "e":
                held = lock.holder == op["h"] and lock.fence == op["f"]
                if held:
                    lock.lease = self.now_ms + op["l"]
                outcomes.append(held)
            elif op["o"] == "q":
                waiting = [h for _, h in lock.queue]
                lock.queue = [(score, h) for score, h in lock.queue if h != op["h"]]
                outcomes.append(op["h"] in waiting)
            elif op["o"] == "s":
                outcomes.append(self._restore(lock, op))
            elif op["o"] == "u":
                outcomes.append(self._preempt(lock, op))
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
            self._granted_writes(op)
            return Grant(op["h"], lock.fence, held=True)
        if lock.holder is None and not lock.queue:
            lock.counter += 1
            lock.holder, lock.fence, lock.lease = op["h"], lock.counter, self.now_ms + op["l"]
            self._granted_writes(op)
            return Grant(op["h"], lock.fence)
        waiting = op["h"] in [h for _, h in lock.queue]
        if not waiting:
            self.seq += 1
            lock.queue.append(((9 - op["p"]) * BAND + self.seq, op["h"]))
            lock.queue.sort()
        self.zset.update({m: s for s, m in op.get("q", [])})
        return Queued([h for _, h in lock.queue].index(op["h"]) + 1, waiting=waiting)

    def _granted_writes(self, op: dict) -> None:
        self.zset.update({m: s for s, m in op.get("g", [])})
        for member in op.get("gc", []):
            self.zset.pop(member, None)

    def _preempt(self, lock: Lock, op: dict):
        """The urgent acquire ("u"): displace v (under vf) to the head of its band."""
        if not self.ready or lock.holder != op["v"] or lock.fence != op["vf"]:
            return self._acquire(lock, op)
        lock.counter += 1
        lock.queue = sorted(
            [(s, h) for s, h in lock.queue if h != op["h"]] + [((9 - op["vp"]) * BAND, op["v"])]
        )
        lock.holder, lock.fence, lock.lease = op["h"], lock.counter, self.now_ms + op["l"]
        self._granted_writes(op)
        return Preempted(op["h"], lock.fence, displaced=op["v"])

    def _release(self, lock: Lock, op: dict):
        if not op.get("x") and (lock.holder != op["h"] or lock.fence != op["f"]):
            return None
        if not lock.queue:
            # transition.lua deletes the lock hash (holder and fence) and its lease entry.
            lock.holder, lock.fence, lock.lease = None, 0, None
            return None
        _, head = lock.queue.pop(0)
        lock.counter += 1
        lock.holder, lock.fence, lock.lease = head, lock.counter, self.now_ms + op["l"]
        return Grant(head, lock.fence)

    def _restore(self, lock: Lock, op: dict) -> None:
        lock.counter = max(lock.counter, op["m"])
        if op["h"] and lock.holder is None:
            lock.holder, lock.fence, lock.lease = op["h"], op["f"], self.now_ms + op["l"]

    def reclaim(self, *, claim_ms: int) -> list[tuple[str, Grant]]:
        """The reclaim op ("c"): devices whose lease ran out, each pushed out by `claim_ms`
        so the next tick does not claim it again (an entry without a holder is dropped)."""
        claimed = []
        for device, lock in sorted(self.devices.items(), key=lambda item: (item[1].lease or 0, item[0])):
            if lock.lease is None or lock.lease > self.now_ms:
                continue
            if lock.holder is None:
                lock.lease = None
                continue
            lock.lease = self.now_ms + claim_ms
            claimed.append((device, Grant(lock.holder, lock.fence)))
        return claimed


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
        self.members: dict[str, int] = {}  # every deadline ever set -> its due ms, to fire again late
        # Attempts that ended (row pk, attempt, its status then, how it ended, when, the due
        # time of its own ack or done deadline): a_timed_out_attempt_was_due checks them.
        self.attempt_ends: list[AttemptEnd] = []
        self.run_time_outs: list[tuple] = []  # (run id, when, the run's deadline)
        self.answering: set[str] = set()  # command ids a `done` of this transition answers
        self.preempts: list[int] = []  # urgent rows a plan asked to preempt for, after its commit

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

    def transition(self, prepare, replies=()) -> effects.Plan:
        """Plan with `prepare(plan)` from fresh reads, carry it out, commit, publish. Each
        write is checked and applied in order, as the database would inside the
        transaction; a conflict rolls the writes and the lock calls back. `replies`: those
        the plan answers (to tell an attempt a device ended from one that timed out)."""
        snap, undo = self.locks.snapshot(), []
        plan = effects.Plan(now=self.now)
        self.locks.now_ms = _ms(self.now)
        self.answering = {r.command_id for _, r in replies if r.kind == "done"}
        try:
            prepare(plan)
            names = planner_locks.rows_wanted(plan)
            self._write(plan.writes, undo)
            ids = list(range(self.next_id, self.next_id + len(plan.naming) + len(plan.creating)))
            planner_locks.rows_name(plan, {n: _copy(self.devices[n]) for n in names}, ids)
            planner_locks.locks_order(plan)
            outcomes = self.locks.apply(plan.locks)
            planner_locks.locks_answered(plan, outcomes)
            handed = {pk: self.row_read(pk) for pk in planner_locks.handed_ids(plan) if pk in self.rows}
            self.locks.apply(planner_locks.handed_plan(plan, handed))
            self._insert(plan.new_rows, undo)
            self._write(planner_locks.dispatches_writes(plan), undo)
        except Conflict:
            for revert in reversed(undo):
                revert()
            self.locks.restore(snap)
            raise
        self.next_id += len(plan.naming) + len(plan.creating)
        self._commit(plan)
        return plan

    def _write(self, writes: list[effects.RowWrite], undo: list) -> None:
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
                self._ended(write, stored, row, undo)
                for name in write.fields:
                    setattr(stored, name, getattr(row, name))
                if write.model is StepRun:
                    self.history[row.pk].append(row.status)
                    undo.append(self.history[row.pk].pop)

    def _ended(self, write: effects.RowWrite, stored, row, undo: list) -> None:
        """Record an attempt that ends (an END_FIELDS write of an attempt in flight) and a
        run timed out by its max_duration, for the invariants."""
        if write.model is JobRun:
            if row.status == RunStatus.TIMED_OUT and write.fields == planner.CANCEL_FIELDS:
                self.run_time_outs.append((row.pk, self.now, stored.deadline))
                undo.append(self.run_time_outs.pop)
            return
        if write.fields != planner.END_FIELDS or stored.status not in STEP_IN_FLIGHT:
            return
        spec = step_spec(row)
        due = stored.deadline  # the attempt's `done` deadline
        if stored.status == StepStatus.DISPATCHED and spec["ack_timeout_seconds"]:
            due = min(due, stored.dispatched_at + timedelta(seconds=spec["ack_timeout_seconds"]))
        how = "reply" if stored.command_id in self.answering else "timeout"
        self.attempt_ends.append(AttemptEnd(row.pk, stored.attempt, row.status, how, self.now, due))
        undo.append(self.attempt_ends.pop)

    def _insert(self, rows: list[StepRun], undo: list) -> None:
        for row in rows:
            stored = _copy(row)
            stored.device = self.devices[row.device.name]
            self.rows[row.pk] = stored
            self.history[row.pk] = [row.status]
            undo.append(lambda pk=row.pk: (self.rows.pop(pk), self.history.pop(pk)))

    def _commit(self, plan: effects.Plan) -> None:
        self.events += plan.events.events
        for d, when in plan.run_deadlines.items():
            self.locks.zset[d.member] = int(when.timestamp() * 1000)
        # Every input of this world (command steps only) is planned whole: nothing is left
        # to the general path but an urgent row's preemption, which a test applies itself, and
        # a device a held row hands on (time windows).
        self.preempts += [later.args["step_run_id"] for later in plan.later if later.what == "preempt"]
        assert all(later.what in ("preempt", "pass_on") for later in plan.later), plan.later
        # Replies that answer no current attempt: recorded, sampled (counted in Redis).
        self.sampled += [kind for kind, _, _ in plan.events.sampled]
        self.members.update(self.locks.zset)
        if self.crash_next_publish:
            self.crash_next_publish = False  # the worker died after its commit
            return
        for row in plan.dispatches:
            self.publish(self.rows[row.pk])
        for row in plan.dispatches:  # the broker confirmed them: their `send` checks go
            self.locks.zset.pop(Deadline.of("send", row).member, None)
        if plan.rebuild:
            # An acquire found the epoch gone (NotReady): jobs/engine/batch.py rebuilds the
            # locks after the commit.
            self.locks_rebuild()
        for later in plan.later:  # devices.locks.device_lock_pass_on, its hand-off planned
            if later.what == "pass_on":
                self.apply(partial(self._passed_on, **later.args))

    def _passed_on(self, plan, *, device: str, holder: str, fence: int) -> None:
        index = plan.locks.release(device, holder=holder, fence=fence)
        plan.releases[index] = self.row_read(holder_step_id(holder))

    def publish(self, row: StepRun) -> None:
        device = row.device.name
        self.inbox[device].append({"id": row.command_id, "token": row.fence, "pk": row.pk})

    # --- inputs ----------------------------------------------------------------------

    def apply(self, prepare, replies=()) -> None:
        """As a worker does: plan and carry out; on a conflict, plan again from a fresh read."""
        for _ in range(5):
            try:
                self.transition(prepare, replies)
                return
            except Conflict:
                continue
        raise AssertionError("a transition kept conflicting")

    def replies_apply(self, replies: list[tuple[str, protocol.Reply]]) -> None:
        def prepare(plan):
            rows = self.by_command({r.command_id for _, r in replies})
            planner.replies_plan(plan, rows, replies)
            planner.runs_continue(plan)

        self.apply(prepare, replies)

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

    def advance(self, seconds: float, *, one_at_a_time: bool = False) -> None:
        """Time passes, then the monitor ticks (jobs/monitor.py `monitor_tick`): lost lock
        state is rebuilt and expired leases reclaimed first (`locks_maintain`), then due
        deadlines fire. `one_at_a_time`: the planned ones each in a transition of its own
        (instead of one batch), in the order the monitor claimed them."""
        self.now += timedelta(seconds=seconds)
        self.locks.now_ms = now_ms = _ms(self.now)
        if not self.locks.ready:
            self.locks_rebuild()
        for device, grant in self.locks.reclaim(claim_ms=int(LEASE_CLAIM_SECONDS * 1000)):
            self.lease_expired(device, grant)
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
                self.publish(row)  # jobs/engine/due.py, the `send` deadline
        for d in deadlines:
            if d.kind == "run":  # a run past its max_duration (jobs/cancel.py `run_time_out`)
                run_id = UUID(str(d.step_run_id))

                def timed_out(plan, run_id=run_id):
                    rows = [self.row_read(pk) for pk, r in self.rows.items() if r.run_id == run_id]
                    planner.run_time_out_plan(plan, self.run_read(run_id), rows)

                self.apply(timed_out)
        planned = [d for d in deadlines if d.kind in PLANNED_DEADLINES]
        for group in [[d] for d in planned] if one_at_a_time else [planned] if planned else []:

            def prepare(plan, group=group):
                rows = {
                    d.step_run_id: self.row_read(d.step_run_id) for d in group if d.step_run_id in self.rows
                }
                holders = {
                    name: Grant(lock.holder, lock.fence)
                    for name, lock in self.locks.devices.items()
                    if lock.holder is not None
                }
                planner.dues_plan(plan, rows, group, holders)
                assert not plan.unplanned
                planner.runs_continue(plan)

            self.apply(prepare)

    def lease_expired(self, device: str, grant: Grant) -> None:
        """jobs/step_locks.py `step_lease_expired`, its decisions planned: a step still in
        flight under the expired grant ends its attempt as timed out (retried if it has
        budget; `batch.attempt_end_apply`) and the lock is handed on; any other holder is
        passed on (and a row still queued asks for the lock again)."""
        row = self.rows.get(holder_step_id(grant.holder))
        if row is not None and row.device.name != device:
            row = None
        if row is not None and row.status in STEP_IN_FLIGHT and row.fence == grant.fence:
            how = {"ok": False, "error": "device lock lease expired", "retryable": True, "timed_out": True}

            def ended(plan, pk=row.pk):
                read = self.row_read(pk)
                if read.status in STEP_IN_FLIGHT and read.fence == grant.fence:
                    planner.attempts_end(plan, [(read, how)])
                    planner.runs_continue(plan)

            self.apply(ended)
            return

        def passed_on(plan):
            index = plan.locks.release(device, holder=grant.holder, fence=grant.fence)
            plan.releases[index] = row if row is not None else self.row_read(holder_step_id(grant.holder))

        self.apply(passed_on)
        if row is not None and row.status == StepStatus.QUEUED:
            self.apply(lambda plan: planner_locks.row_acquire(plan, self.row_read(row.pk)))

    def locks_rebuild(self) -> None:
        """devices/lock_recovery.py `locks_rebuild` with the jobs app's source and hook
        (jobs/step_locks.py): each device's executing step gets its lock back, fence
        counters rise to the highest fence any row of the device had, the epoch is back;
        then the rows' deadlines are put back and each queued step asks for its lock again
        (`presence.steps_resume`: `batch.rows_start`, here as a plan of its acquire), oldest first."""
        self.locks.now_ms = _ms(self.now)
        batch = LockBatch()
        for device in DEVICES:
            mine = [r for r in self.rows.values() if r.device.name == device]
            fenced = [r.fence for r in mine if r.fence is not None]
            if not fenced:
                continue
            executing = [r for r in mine if r.status in STEP_IN_FLIGHT and r.command_id]
            holder = self.row_read(executing[-1].pk) if executing else None
            batch.restore(
                device,
                holder=step_holder(holder) if holder else None,
                fence=holder.fence if holder else max(fenced),
                floor=max(fenced),
                lease_seconds=lease_seconds(step_spec(holder)) if holder else 0.0,
            )
        self.locks.apply(batch)
        self.locks.ready = True
        for pk, r in sorted(self.rows.items()):
            kind = DEADLINE_KIND_FOR_STATUS.get(r.status)
            if kind is not None and r.deadline is not None:
                self.locks.zset[Deadline(kind, pk, r.attempt).member] = _ms(r.deadline)
        queued = sorted((r.queued_at, pk) for pk, r in self.rows.items() if r.status == StepStatus.QUEUED)
        for _, pk in queued:
            self.apply(lambda plan, pk=pk: planner_locks.row_acquire(plan, self.row_read(pk)))

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
                planner_locks.row_acquire(plan, self.row_read(pk))

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


@dataclass(frozen=True)
class AttemptEnd:
    pk: int
    attempt: int
    status: str
    how: str  # "reply": a device's done ended it; "timeout": a deadline or the lease did
    at: datetime
    due: datetime  # its own ack deadline (still unacked, when it had one), else its done


def _ms(when: datetime) -> int:
    return int(when.timestamp() * 1000)


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


def world_state(world: World, events: list) -> dict:
    """What two worlds fed the same inputs must agree on, ids aside: every row's fields
    (COMPARED_ROW_FIELDS), every run's, each lock (holder, fence, counter, queue order,
    lease), the epoch, every deadline and its due time, the commands each device received
    (with their tokens) and the status events of each row and run among `events`. A step row
    is named by its run, phase and index (the ids a transition reserves follow the order
    its rows are named in), a command by its row and attempt (its id has a random part)."""
    key = {pk: (str(r.run_id), r.phase, r.index) for pk, r in world.rows.items()}

    def holder_key(holder):
        return None if holder is None else key.get(holder_step_id(holder), holder)

    def member_key(member):
        d = Deadline.parse(member)
        return (d.kind, key.get(d.step_run_id, str(d.step_run_id)), d.attempt)

    status_events: dict = {}
    for e in events:
        if e.step_run is not None and e.kind.removeprefix("step.") in StepStatus.values:
            status_events.setdefault(key[e.step_run.pk], []).append(e.kind)
        elif e.kind.startswith("run."):
            status_events.setdefault(str(e.run_id), []).append(e.kind)
    return {
        "rows": {
            key[pk]: tuple(getattr(r, name) for name in COMPARED_ROW_FIELDS) for pk, r in world.rows.items()
        },
        "runs": {
            str(pk): (r.status, r.cursor, r.error, r.started_at, r.finished_at, r.deadline)
            for pk, r in world.runs.items()
        },
        "locks": {
            d: (holder_key(v.holder), v.fence, v.counter, [holder_key(h) for _, h in v.queue], v.lease)
            for d, v in world.locks.devices.items()
        },
        "ready": world.locks.ready,
        "deadlines": {member_key(m): score for m, score in world.locks.zset.items()},
        "published": {
            d: [(key[c["pk"]], c["id"].split("-")[1], c["token"]) for c in commands]
            for d, commands in world.inbox.items()
        },
        "events": status_events,
    }


# Every field a transition writes but the command id (it carries the row's id and a random
# part). Fences are compared: either way the same grants happen on each device, in the same
# order.
COMPARED_ROW_FIELDS = (
    "status",
    "attempt",
    "error",
    "result",
    "progress",
    "progress_messages",
    "deadline",
    "queued_at",
    "dispatched_at",
    "acked_at",
    "finished_at",
    "fence",
)
