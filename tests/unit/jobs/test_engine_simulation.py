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
again from a fresh read); a holder's lease running out (the monitor reclaims it before it
claims deadlines); Redis losing every lock and deadline (acquires answer NotReady until the
locks are rebuilt from the rows). Two rules apply the same inputs (replies, or the
deadlines due) to two copies of the world, once as one batch and once one at a time, and
compare the results (`world_state`). After every step it checks the invariants; once the
inputs stop, every run must end. A failing example prints its steps and
`@reproduce_failure(...)`: put that decorator on the `EngineMachine` class to replay it
(or run again with `--hypothesis-seed=N`, N the seed Hypothesis prints with the failure).
"""

from __future__ import annotations

import copy
import os
import random
from datetime import timedelta

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from devices import protocol
from jobs.deadlines import Deadline
from jobs.engine import planner
from jobs.engine.plan import holder_step_id, step_holder
from jobs.models import STEP_IN_FLIGHT, OnFailure, RunStatus, StepStatus

from .engine_world import (
    DEVICES,
    RUN_TERMINAL,
    STEP_TERMINAL,
    Conflict,
    World,
    reply,
    row_copy,
    world_state,
)


class EngineMachine(RuleBasedStateMachine):
    """Random interleavings of the planner's inputs; invariants after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.world = World()
        self.pending: list = []
        self.seen_fences: set[tuple[int, int]] = set()  # (row, attempt) whose fence was checked

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
            planner.replies_plan(plan, {k: row_copy(v) for k, v in rows.items()}, replies)
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

    @rule(data=st.data(), stale=st.booleans())
    def a_deadline_fires_again(self, data, stale):
        """A deadline claimed twice, or late: its attempt ended, or moved on, long ago
        (`stale`: one of an earlier attempt of a step in flight now). Only one already due:
        no monitor claims a deadline before its time."""
        now = int(self.world.now.timestamp() * 1000)
        due = sorted(m for m, score in self.world.members.items() if score <= now)
        if stale:
            due = [m for m in due if self._earlier_attempt(Deadline.parse(m))]
        if due:
            self.world.locks.zset[data.draw(st.sampled_from(due))] = now
            self.world.advance(0)

    def _earlier_attempt(self, deadline: Deadline) -> bool:
        row = self.world.rows.get(deadline.step_run_id) if deadline.kind != "run" else None
        return row is not None and row.status in STEP_IN_FLIGHT and deadline.attempt < row.attempt

    @rule(device=st.sampled_from(DEVICES))
    def a_lease_runs_out(self, device):
        """Time passes to just past the lease of the device's holder (its attempt's
        deadlines are due by then too: the lease outlives them by LEASE_GRACE_SECONDS);
        the monitor reclaims the lease before it claims deadlines."""
        lease = self.world.locks.devices[device].lease
        if lease is not None:
            now = int(self.world.now.timestamp() * 1000)
            self.world.advance(max(0, lease - now) / 1000 + 1)

    @rule()
    def redis_loses_the_locks(self):
        """Redis restarts without its data: every lock, queue, fence counter and deadline is
        gone; acquires answer NotReady until the locks are rebuilt from the rows (by the
        worker that was refused, or the monitor's next tick)."""
        self.world.locks.lost()

    @rule(data=st.data(), n=st.integers(2, 5))
    def replies_batched_or_one_at_a_time(self, data, n):
        """The same replies applied to two copies of the world, once as one batch, once as
        batches of one in the same order, end in the same state (`world_state`)."""
        replies = []
        for _ in range(n):
            device = data.draw(st.sampled_from(DEVICES))
            command = self._received(data, device)
            if command is not None:
                how = data.draw(st.sampled_from(["ok", "retryable", "error", "ack", "progress"]))
                replies.append((device, self._reply(how, command["id"])))
        if replies:
            self._same_either_way(
                lambda world: world.replies_apply(replies),
                lambda world: [world.replies_apply([one]) for one in replies],
            )

    @rule(seconds=st.sampled_from([3, 10, 31, 61]))
    def dues_batched_or_one_at_a_time(self, seconds):
        """The same due deadlines applied as one batch, or each on its own, in claim order."""
        self._same_either_way(
            lambda world: world.advance(seconds),
            lambda world: world.advance(seconds, one_at_a_time=True),
        )

    def _same_either_way(self, batched, one_at_a_time):
        world = self.world
        # A worker dying after its commit is an input of its own: it would strike one of
        # the transitions of one side only.
        crash, world.crash_next_publish = world.crash_next_publish, False
        events, world.events = world.events, []
        twin = copy.deepcopy(world)
        world.events, before = events, len(events)
        seed = random.getstate()  # the same back-off jitter either way
        batched(world)
        random.setstate(seed)
        one_at_a_time(twin)
        got, want = world_state(world, world.events[before:]), world_state(twin, twin.events)
        differ = {k: (got[k], want[k]) for k in got if got[k] != want[k]}
        assert not differ, differ
        world.crash_next_publish = crash

    @rule()
    def worker_dies_after_commit(self):
        self.world.crash_next_publish = True

    @rule(device=st.sampled_from(DEVICES), online=st.booleans())
    def presence_flaps(self, device, online):
        self.world.presence(device, online)

    @rule(device=st.sampled_from(DEVICES), minutes=st.sampled_from([0, 1, 5]))
    def quiet_hours_change(self, device, minutes):
        """Time windows: the device's quiet hours (UTC) begin now for `minutes`, or end."""
        now, target = self.world.now, self.world.devices[device]
        if minutes:
            target.quiet_hours_start = (now - timedelta(hours=1)).time()
            target.quiet_hours_end = (now + timedelta(minutes=minutes)).time()
        else:
            target.quiet_hours_start = target.quiet_hours_end = None

    # --- invariants ------------------------------------------------------------------

    @invariant()
    def one_command_in_flight_per_device(self):
        """At most one attempt in flight per device, and (while Redis has its lock state)
        it holds the device's lock under its own fence."""
        for device in DEVICES:
            flying = [
                r for r in self.world.rows.values() if r.device.name == device and r.status in STEP_IN_FLIGHT
            ]
            assert len(flying) <= 1, f"{device}: {[(r.pk, r.status) for r in flying]}"
            lock = self.world.locks.devices[device]
            for r in flying:
                if self.world.locks.ready:
                    assert lock.holder == step_holder(r) and lock.fence == r.fence, (
                        device,
                        lock,
                        r.pk,
                        r.fence,
                    )

    @invariant()
    def fences_only_grow(self):
        """Each attempt is dispatched under a fence above every fence its device gave
        before (a Redis loss included: the counter is rebuilt from the rows), and each
        device sees its commands' tokens grow."""
        for device, lock in self.world.locks.devices.items():
            fences = {
                (r.pk, r.attempt): r.fence
                for r in self.world.rows.values()
                if r.device.name == device and r.fence is not None
            }
            seen = self.world.fences[device]
            for attempt, fence in fences.items():
                if attempt not in self.seen_fences:
                    assert fence > seen, (device, attempt, fence, seen)
                    self.seen_fences.add(attempt)
            self.world.fences[device] = max([seen, *fences.values()])
            if self.world.locks.ready:
                assert lock.counter >= self.world.fences[device], (device, lock, self.world.fences[device])
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
        """Every row's and run's last status event names its status, and terminal events
        exist exactly for the rows and runs that ended, once each."""
        steps: dict[int, list[str]] = {}
        runs: dict = {}
        for e in self.world.events:
            status = e.kind.partition(".")[2]
            if e.kind.startswith("step.") and status in StepStatus.values:
                steps.setdefault(e.step_run.pk, []).append(status)
            elif e.kind.startswith("run."):
                runs.setdefault(e.run_id, []).append(RunStatus.RUNNING if status == "started" else status)
        for pk, row in self.world.rows.items():
            kinds = steps.get(pk, [])
            assert kinds and kinds[-1] == row.status, (pk, row.status, kinds)
            ended = [k for k in kinds if k in STEP_TERMINAL]
            assert ended == ([row.status] if row.status in STEP_TERMINAL else []), (pk, row.status, kinds)
        for pk, run in self.world.runs.items():
            kinds = runs.get(pk, [])
            assert (kinds[-1] if kinds else RunStatus.PENDING) == run.status, (pk, run.status, kinds)
            ended = [k for k in kinds if k in RUN_TERMINAL]
            assert ended == ([run.status] if run.status in RUN_TERMINAL else []), (pk, run.status, kinds)

    @invariant()
    def a_timed_out_attempt_was_due(self):
        """An attempt no device ended (a deadline or the lease did) ended timed out (or
        retrying), at or after its own deadline: its ack deadline while unacknowledged,
        else its done deadline; a device's done never reads as a timeout. A run timed out
        by its max_duration was past its own deadline."""
        for end in self.world.attempt_ends:
            if end.how == "timeout":
                assert end.status in (StepStatus.TIMED_OUT, StepStatus.RETRYING), end
                assert end.at >= end.due, end
            else:
                assert end.status != StepStatus.TIMED_OUT, end
        for run_id, at, deadline in self.world.run_time_outs:
            assert deadline is not None and at >= deadline, (run_id, at, deadline)

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


# A longer search by hand: IOTQUEUE_SIMULATION_EXAMPLES=4000 IOTQUEUE_SIMULATION_STEPS=40.
EngineMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("IOTQUEUE_SIMULATION_EXAMPLES", "300")),
    stateful_step_count=int(os.environ.get("IOTQUEUE_SIMULATION_STEPS", "30")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,  # a failure prints `@reproduce_failure(...)`, which replays it
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

    assert [kind for kind, _, _ in plan.events.sampled] == ["reply.stale"]  # the copy
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


def test_a_batch_queues_a_run_s_next_step_before_a_later_reply_hands_its_device_on():
    # Found by this simulation: the lock call made every release before any new row asked,
    # so a device went to the waiter already queued where, one reply at a time, the next
    # step of a higher priority run would have been queued ahead of it (planner_locks.locks_order).
    # given run A (priority 9) on d1 then d0, run B holding d0, run C (priority 5) waiting for d0
    world = World()
    a = world.run_new([("d1", OnFailure.ABORT, 1), ("d0", OnFailure.ABORT, 1)], 9)
    b = world.run_new([("d0", OnFailure.ABORT, 1)], 5)
    c = world.run_new([("d0", OnFailure.ABORT, 1)], 5)
    for run in (a, b, c):
        world.start(run.pk)
    replies = [
        ("d1", reply("done", world.inbox["d1"][0]["id"], ok=True)),  # A moves on to d0
        ("d0", reply("done", world.inbox["d0"][0]["id"], ok=True)),  # B lets d0 go
    ]
    twin = copy.deepcopy(world)
    before = len(world.events)

    # when A's and B's dones are applied as one batch, and (to the twin) one at a time
    world.replies_apply(replies)
    for one in replies:
        twin.replies_apply([one])

    # then both end alike: A's step holds d0
    assert world_state(world, world.events[before:]) == world_state(twin, twin.events[before:])


def test_a_lease_that_runs_out_ends_its_attempt_as_timed_out_and_hands_the_device_on():
    # given a step holding d0 whose device never answers, and another run waiting for d0
    world = World()
    stuck = world.run_new([("d0", OnFailure.ABORT, 1)], 5)
    waiting = world.run_new([("d0", OnFailure.ABORT, 1)], 5)
    world.start(stuck.pk)
    world.start(waiting.pk)
    first = world.inbox["d0"][0]

    # when the monitor's next tick comes after the lease ran out (its deadline is due too)
    world.advance(61)

    # then the lease was reclaimed first: the attempt timed out, after its own deadline,
    # and d0 went to the waiting run under a higher fence
    row = world.rows[first["pk"]]
    assert (row.status, row.error) == (StepStatus.TIMED_OUT, "device lock lease expired")
    assert world.attempt_ends[-1].at >= world.attempt_ends[-1].due
    handed = world.inbox["d0"][1]
    assert world.rows[handed["pk"]].run_id == waiting.pk and handed["token"] > first["token"]
    assert world.locks.devices["d0"].holder == f"step:{handed['pk']}"


def test_after_redis_lost_the_locks_they_are_rebuilt_from_the_rows_and_fences_keep_growing():
    # given a step executing on d0 under fence 1 and another queued for d0
    world = World()
    executing = world.run_new([("d0", OnFailure.ABORT, 1)], 5)
    queued = world.run_new([("d0", OnFailure.ABORT, 1)], 5)
    world.start(executing.pk)
    world.start(queued.pk)
    first = world.inbox["d0"][0]

    # when Redis loses every lock and deadline, and a new run asks for d1
    world.locks.lost()
    other = world.run_new([("d1", OnFailure.ABORT, 1)], 5)
    world.start(other.pk)

    # then its acquire was refused (NotReady), the locks rebuilt from the rows (the
    # executing step holds d0 again, its deadlines are back) and d1 granted after that
    assert world.locks.ready and world.locks.devices["d0"].holder == f"step:{first['pk']}"
    assert f"done:{first['pk']}:1" in world.locks.zset
    assert world.inbox["d1"] and world.rows[world.inbox["d1"][0]["pk"]].run_id == other.pk
    # and d0's next holder, the queued step asking again, gets a fence above the lost one
    world.replies_apply([("d0", reply("done", first["id"], ok=True))])
    assert world.inbox["d0"][1]["token"] > first["token"]
    assert world.runs[executing.pk].status == RunStatus.SUCCEEDED


def test_a_waiting_row_granted_when_it_asks_again_leaves_no_queue_deadline():
    # Found by this simulation: after Redis lost the locks, a queued row asking again (the
    # rebuild) was granted at once but kept the queue deadline the rebuild put back, where
    # one reply at a time it was handed the device (which clears it).
    # given run A (priority 8) on d1 then d0, and run B (priority 4) holding d0
    world = World()
    b = world.run_new([("d0", OnFailure.ABORT, 1)], 4)
    a = world.run_new([("d1", OnFailure.CONTINUE, 2), ("d0", OnFailure.CONTINUE, 2)], 8)
    world.start(a.pk)
    world.start(b.pk)
    # and Redis lost every lock and deadline
    world.locks.lost()
    replies = [
        ("d1", reply("done", world.inbox["d1"][0]["id"], ok=True)),  # A moves on to d0
        ("d0", reply("done", world.inbox["d0"][0]["id"], ok=False, error="flash error")),  # B lets go
    ]
    twin = copy.deepcopy(world)
    before = len(world.events)

    # when both replies are applied as one batch, and (to the twin) one at a time
    world.replies_apply(replies)
    for one in replies:
        twin.replies_apply([one])

    # then both end alike, A's step on d0 dispatched with no queue deadline left
    assert world_state(world, world.events[before:]) == world_state(twin, twin.events[before:])
    step = next(row for row in world.rows.values() if row.run_id == a.pk and row.index == 1)
    assert f"queue:{step.pk}:0" not in world.locks.zset
