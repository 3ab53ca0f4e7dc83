"""Deterministic simulation of the step engine's planner (jobs/engine/planner.py).

Hypothesis drives the planner with an in-memory executor — rows in a dict, each write a
compare-and-set checked at commit, the device locks as a model of devices/lua/
transition.lua's rules (priority then FIFO, fences that only grow, hand-off to the queue's
head), deadlines in a sorted map, devices as mailboxes — through random interleavings: run
starts; replies duplicated, late, out of order and from other devices; batches of replies
applied together or one at a time; attempts timing out and retried; devices going offline
and back; runs canceled whatever they are doing, or timed out by their max_duration; a
worker dying between its commit and its publish (the `send` deadline sends again); two
workers planning from the same read (the second one's compare-and-set fails and it plans
again from a fresh read). After every step it checks the invariants; once the inputs stop,
every run must end. A failing example prints its steps and its seed
(`@reproduce_failure`), which replays it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from uuid import UUID

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from devices import protocol
from devices.locks import Grant, LockBatch, NotReady, Queued
from devices.models import Device
from jobs.deadlines import Deadline
from jobs.engine import planner
from jobs.engine.plan import holder_step_id, step_holder
from jobs.models import STEP_IN_FLIGHT, JobRun, OnFailure, RunStatus, StepRun, StepStatus

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
            return Grant(op["h"], lock.fence)
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
        for later in plan.later:
            # Left to the general path here, and changing nothing there: replies that answer
            # no current attempt (recorded as stale, unknown or foreign), and the start of a
            # run that is no longer pending (canceled before it started).
            assert later.what == "reply" or (
                later.what == "advance" and self.runs[UUID(later.args["run_id"])].status in RUN_TERMINAL
            ), later
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
            planner.runs_begin(plan, {run_id: self.run_read(run_id)}, [str(run_id)])
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


class EngineMachine(RuleBasedStateMachine):
    """Random interleavings of the planner's inputs; invariants after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.world = World()
        self.pending: list = []

    @initialize(
        runs=st.lists(
            st.tuples(
                st.lists(
                    st.tuples(
                        st.sampled_from(DEVICES),
                        st.sampled_from([OnFailure.ABORT, OnFailure.CONTINUE]),
                        st.integers(1, 3),
                    ),
                    min_size=1,
                    max_size=3,
                ),
                st.integers(0, 9),
            ),
            min_size=1,
            max_size=4,
        )
    )
    def runs_made(self, runs):
        self.pending = [self.world.run_new(steps, priority).pk for steps, priority in runs]

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def run_starts(self, data):
        run_id = self.pending.pop(data.draw(st.integers(0, len(self.pending) - 1)))
        self.world.start(run_id)

    def _received(self, data, device: str) -> dict | None:
        got = self.world.inbox[device]
        return data.draw(st.sampled_from(got)) if got else None

    @rule(
        data=st.data(),
        device=st.sampled_from(DEVICES),
        how=st.sampled_from(["ok", "ok", "error", "retryable", "rejected", "ack", "progress"]),
        sender=st.sampled_from(["self", "self", "self", "other"]),
    )
    def device_replies(self, data, device, how, sender):
        """A device answers a command it received: the latest, an old one (late), again
        (duplicated), or another device claims it (foreign)."""
        command = self._received(data, device)
        if command is None or not self.world.devices[device].online:
            return
        name = device if sender == "self" else DEVICES[(DEVICES.index(device) + 1) % len(DEVICES)]
        self.world.replies_apply([(name, self._reply(how, command["id"]))])

    @staticmethod
    def _reply(how: str, command_id: str) -> protocol.Reply:
        if how in ("ack", "progress"):
            return reply(how, command_id)
        return reply(
            "done",
            command_id,
            ok=how == "ok",
            error="" if how == "ok" else "broke",
            retryable=how == "retryable",
            rejected=how == "rejected",
        )

    @rule(data=st.data(), n=st.integers(2, 6))
    def replies_batched(self, data, n):
        """Several replies from several devices, in any order, applied as one batch."""
        replies = []
        for _ in range(n):
            device = data.draw(st.sampled_from(DEVICES))
            command = self._received(data, device)
            if command is not None:
                how = data.draw(st.sampled_from(["ok", "retryable", "ack", "error"]))
                replies.append((device, self._reply(how, command["id"])))
        if replies:
            self.world.replies_apply(replies)

    @rule(data=st.data(), device=st.sampled_from(DEVICES))
    def two_workers_one_read(self, data, device):
        """Two workers plan the same done from one read; the second one's writes conflict
        and it plans again from a fresh read (where the reply is stale)."""
        command = self._received(data, device)
        if command is None:
            return
        replies = [(device, self._reply("ok", command["id"]))]
        rows = self.world.by_command({command["id"]})

        def stale(plan):
            planner.replies_plan(plan, {k: _copy_row(v) for k, v in rows.items()}, replies)
            planner.runs_continue(plan)

        self.world.replies_apply(replies)
        try:
            self.world.transition(stale)
        except Conflict:
            self.world.replies_apply(replies)

    @rule(data=st.data())
    def run_canceled(self, data):
        """An operator cancels a run, whatever it is doing (a pending run too)."""
        self.world.cancel(data.draw(st.sampled_from(sorted(self.world.runs))))

    @rule(seconds=st.sampled_from([1, 3, 10, 31, 120]))
    def time_passes(self, seconds):
        self.world.advance(seconds)

    @rule(data=st.data())
    def a_deadline_fires_again(self, data):
        """A deadline claimed twice, or late: its attempt ended, or moved on, long ago."""
        if self.world.members:
            member = data.draw(st.sampled_from(sorted(self.world.members)))
            self.world.locks.zset[member] = int(self.world.now.timestamp() * 1000)
            self.world.advance(0)

    @rule()
    def worker_dies_after_commit(self):
        self.world.crash_next_publish = True

    @rule(device=st.sampled_from(DEVICES), online=st.booleans())
    def presence_flaps(self, device, online):
        self.world.presence(device, online)

    # --- invariants ------------------------------------------------------------------

    @invariant()
    def one_command_in_flight_per_device(self):
        for device in DEVICES:
            flying = [
                r for r in self.world.rows.values() if r.device.name == device and r.status in STEP_IN_FLIGHT
            ]
            assert len(flying) <= 1, f"{device}: {[(r.pk, r.status) for r in flying]}"
            lock = self.world.locks.devices[device]
            for r in flying:
                assert lock.holder == step_holder(r) and lock.fence == r.fence, (device, lock, r.pk, r.fence)

    @invariant()
    def fences_only_grow(self):
        for device, lock in self.world.locks.devices.items():
            assert lock.counter >= self.world.fences[device]
            self.world.fences[device] = lock.counter
            tokens = [c["token"] for c in self.world.inbox[device]]
            assert tokens == sorted(tokens) or len(set(c["id"] for c in self.world.inbox[device])) < len(
                tokens
            )

    @invariant()
    def nothing_leaves_a_terminal_state(self):
        for pk, statuses in self.world.history.items():
            ends = [i for i, s in enumerate(statuses) if s in STEP_TERMINAL]
            assert not ends or ends[0] == len(statuses) - 1, (pk, statuses)
        for run in self.world.runs.values():
            ended = [e for e in self.world.events if e.kind.startswith("run.") and e.run_id == run.pk]
            terminal = [e for e in ended if e.kind.split(".")[1] in RUN_TERMINAL]
            assert len(terminal) == (1 if run.status in RUN_TERMINAL else 0), (
                run.status,
                [e.kind for e in ended],
            )
            if terminal:
                assert terminal[0].kind == f"run.{run.status}"

    @invariant()
    def timeline_matches_rows(self):
        for pk, row in self.world.rows.items():
            if row.status in STEP_TERMINAL:
                kinds = [e.kind for e in self.world.events if e.step_run is not None and e.step_run.pk == pk]
                assert kinds.count(f"step.{row.status}") == 1, (pk, row.status, kinds)

    def teardown(self):
        """Inputs stop: every device comes back and answers what it holds; every run ends."""
        world = self.world
        for run_id in self.pending:
            world.start(run_id)
        for device in DEVICES:
            world.presence(device, True)
        for _ in range(200):
            if all(run.status in RUN_TERMINAL for run in world.runs.values()):
                break
            for device in DEVICES:
                flying = [
                    r for r in world.rows.values() if r.device.name == device and r.status in STEP_IN_FLIGHT
                ]
                for r in flying:
                    world.replies_apply([(device, reply("done", r.command_id, ok=True))])
            world.advance(31)
        assert all(run.status in RUN_TERMINAL for run in world.runs.values()), [
            (run.pk, run.status, run.cursor) for run in world.runs.values()
        ]


def _copy_row(row: StepRun) -> StepRun:
    fresh = _copy(row)
    fresh.run, fresh.device = _copy(row.run), _copy(row.device)
    return fresh


EngineMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_engine_simulation = EngineMachine.TestCase


def test_a_step_ended_for_good_moves_its_run_on_or_ends_it():
    # given a run of two steps whose first step succeeded, and one whose only step failed
    world = World()
    two = world.run_new([("d0", OnFailure.ABORT, 1), ("d1", OnFailure.ABORT, 1)], 5)
    one = world.run_new([("d2", OnFailure.ABORT, 1)], 5)
    world.start(two.pk)
    world.start(one.pk)
    first, only = world.inbox["d0"][0], world.inbox["d2"][0]

    # when both devices answer in one batch
    world.replies_apply(
        [("d0", reply("done", first["id"], ok=True)), ("d2", reply("done", only["id"], ok=False))]
    )

    # then the first run's next step was dispatched to its device, the second run failed
    assert (world.runs[two.pk].cursor, world.runs[two.pk].status) == (1, RunStatus.RUNNING)
    assert (
        len(world.inbox["d1"]) == 1
        and world.locks.devices["d1"].holder == f"step:{world.inbox['d1'][0]['pk']}"
    )
    assert world.runs[one.pk].status == RunStatus.FAILED
    assert world.locks.devices["d2"].holder is None


def test_a_done_and_its_duplicate_in_one_batch_end_the_attempt_once():
    world = World()
    run = world.run_new([("d0", OnFailure.ABORT, 1)], 5)
    world.start(run.pk)
    command = world.inbox["d0"][0]
    done = reply("done", command["id"], ok=True)

    plan = world.transition(
        lambda plan: (
            planner.replies_plan(plan, world.by_command({command["id"]}), [("d0", done), ("d0", done)]),
            planner.runs_continue(plan),
        )
    )

    assert [later.what for later in plan.later] == ["reply"]  # the copy: stale, the general path
    assert world.runs[run.pk].status == RunStatus.SUCCEEDED
    assert [e.kind for e in world.events].count("step.succeeded") == 1


def test_a_timed_out_attempt_is_retried_then_fails_its_run():
    # given a step with two attempts whose device never answers
    world = World()
    run = world.run_new([("d0", OnFailure.ABORT, 2)], 5)
    world.start(run.pk)

    # when its timeouts and back-off pass
    for _ in range(6):
        world.advance(31)

    # then it was sent twice under growing fences and the run timed out
    assert [c["token"] for c in world.inbox["d0"]] == [1, 2]
    assert world.runs[run.pk].status == RunStatus.TIMED_OUT
    assert world.locks.devices["d0"].holder is None


def test_a_higher_priority_waiter_is_handed_the_device_first():
    world = World()
    busy = world.run_new([("d0", OnFailure.ABORT, 1)], 5)
    low = world.run_new([("d0", OnFailure.ABORT, 1)], 1)
    high = world.run_new([("d0", OnFailure.ABORT, 1)], 9)
    for run in (busy, low, high):
        world.start(run.pk)

    world.replies_apply([("d0", reply("done", world.inbox["d0"][0]["id"], ok=True))])

    handed = world.rows[world.inbox["d0"][1]["pk"]]
    assert handed.run_id == high.pk and holder_step_id(world.locks.devices["d0"].holder) == handed.pk


def test_a_run_past_its_max_duration_times_out_and_hands_its_device_on():
    # given a run whose step holds d0 past the run's max_duration, and another run waiting for d0
    world = World()
    slow = world.run_new([("d0", OnFailure.ABORT, 1), ("d1", OnFailure.ABORT, 1)], 3)  # max_duration 90
    slow.plan[0]["timeout_seconds"] = 600  # its attempt outlives the run
    waiting = world.run_new([("d0", OnFailure.ABORT, 1)], 5)
    world.start(slow.pk)
    world.start(waiting.pk)
    first = world.inbox["d0"][0]
    world.replies_apply([("d0", reply("ack", first["id"]))])

    # when 91 seconds pass
    world.advance(91)

    # then the run timed out with its step, and d0 went to the waiting run at once
    assert world.runs[slow.pk].status == RunStatus.TIMED_OUT
    assert "max_duration" in world.runs[slow.pk].error
    assert world.rows[first["pk"]].status == StepStatus.TIMED_OUT
    handed = world.inbox["d0"][1]
    assert world.rows[handed["pk"]].run_id == waiting.pk and handed["token"] > first["token"]
