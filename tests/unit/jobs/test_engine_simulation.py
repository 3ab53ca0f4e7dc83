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

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from devices import protocol
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
