"""The kinds' registry (jobs/engine/kinds.py): what each kind declared, and the check that
stops the app when a kind is missing or declared twice. Tests change a copy of the
registry, never the one the app runs with."""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured

from jobs.apps import KIND_MODULES, kinds_load
from jobs.engine import kinds
from jobs.engine.plan import FANOUT
from jobs.models import JobRun, OnFailure, Phase, StepKind, StepRun


def a_copy(monkeypatch: pytest.MonkeyPatch) -> kinds.KindRegistry:
    """A copy of the app's registry that the decorators fill while the test runs."""
    registry = kinds.REGISTRY.copy()
    monkeypatch.setattr(kinds, "REGISTRY", registry)
    return registry


def row_of(spec: dict, *, phase: str = Phase.FORWARD) -> StepRun:
    return StepRun(pk=7, run=JobRun(plan=[spec]), index=0, phase=phase)


def test_the_shipped_app_declares_every_kind_once():
    kinds.kinds_check()
    assert set(kinds.REGISTRY.step_kinds) == {*StepKind.values, "fanout"}
    assert kinds.REGISTRY.doubled == []


def test_loading_the_app_checks_the_kinds(monkeypatch):
    kinds_load()
    del a_copy(monkeypatch).step_kinds[StepKind.WAIT_ONLINE]
    with pytest.raises(ImproperlyConfigured, match="no step_kinds entry for 'wait_online'"):
        kinds_load()


def test_the_kind_modules_are_listed_once_in_the_app():
    assert len(KIND_MODULES) == len(set(KIND_MODULES))
    assert "jobs.cancel" in KIND_MODULES  # the `run` deadline's owner


@pytest.mark.parametrize(
    ("table", "key"),
    [
        ("step_kinds", StepKind.DELAY),
        ("step_kinds", "fanout"),
        ("row_ended", Phase.COMPENSATION),
        ("failure_policies", OnFailure.ROLLBACK),
        ("deadline_handlers", "wake"),
        ("run_deadlines", "run"),
    ],
)
def test_a_kind_without_a_declaration_stops_the_app_naming_it(monkeypatch, table, key):
    registry = a_copy(monkeypatch)
    del getattr(registry, table)[key]
    with pytest.raises(ImproperlyConfigured, match=f"no {table} entry for '{key}'"):
        kinds.kinds_check(registry)


def test_a_kind_declared_twice_stops_the_app_naming_it_and_both_definitions(monkeypatch):
    registry = a_copy(monkeypatch)

    @kinds.step_kind(StepKind.DELAY)
    def another_delay_start(run, index):
        pass

    with pytest.raises(ImproperlyConfigured) as raised:
        kinds.kinds_check(registry)
    message = str(raised.value)
    assert "registered twice: step_kinds 'delay'" in message
    assert "jobs.engine.waits.delay_start" in message
    assert "another_delay_start" in message


def test_a_declaration_for_no_such_kind_stops_the_app(monkeypatch):
    registry = a_copy(monkeypatch)

    @kinds.deadline_handler("nap")
    def nap_due(step_run, deadline):
        pass

    with pytest.raises(ImproperlyConfigured, match="deadline_handlers entry 'nap' is no such kind"):
        kinds.kinds_check(registry)


def test_the_same_definition_declared_again_replaces_itself(monkeypatch):
    registry = a_copy(monkeypatch)
    start = registry.step_kinds[StepKind.COMMAND]
    registry.add("step_kinds", StepKind.COMMAND, start)
    kinds.kinds_check(registry)


def test_the_check_leaves_the_apps_registry_alone(monkeypatch):
    before = {name: dict(getattr(kinds.REGISTRY, name)) for name in kinds.TABLES}
    registry = a_copy(monkeypatch)
    del registry.step_kinds[StepKind.TASK]
    monkeypatch.undo()
    assert {name: dict(getattr(kinds.REGISTRY, name)) for name in kinds.TABLES} == before


def test_only_a_plain_command_starts_the_batched_way():
    batched = {kind for kind, behaviour in kinds.REGISTRY.step_kinds.items() if behaviour.batched_start}
    assert batched == {StepKind.COMMAND}


def test_rows_that_send_an_attempt_are_dispatched_by_a_plan_waits_are_not():
    assert kinds.row_batched(row_of({"kind": StepKind.COMMAND, "device": "d"}))
    assert kinds.row_batched(row_of({"kind": StepKind.COMMAND, "group": "g"}))
    assert kinds.row_batched(row_of({"kind": StepKind.TASK, "action": "t"}))
    undo_task = {"kind": StepKind.TASK, "compensation_action": "u", "compensation_args": {}}
    assert kinds.row_batched(row_of(undo_task, phase=Phase.COMPENSATION))
    assert not kinds.row_batched(row_of({"kind": StepKind.DELAY}))
    assert not kinds.row_batched(row_of({"kind": StepKind.WAIT_ONLINE, "device": "d"}))


def test_a_fanout_row_and_a_compensation_report_to_their_owner_a_command_to_its_run():
    assert kinds.row_ended_handler(row_of({"kind": StepKind.COMMAND, "device": "d"})) is None
    fanout = kinds.row_ended_handler(row_of({"kind": StepKind.COMMAND, "labels": {"a": "b"}}))
    assert fanout is kinds.REGISTRY.row_ended["fanout"]
    undo = {"kind": StepKind.COMMAND, "compensation_action": "u", "compensation_args": {}}
    compensation = kinds.row_ended_handler(row_of(undo, phase=Phase.COMPENSATION))
    assert compensation is kinds.REGISTRY.row_ended[Phase.COMPENSATION]


def test_a_wait_online_row_times_out_saying_its_device_did_not_come_online():
    wait = kinds.row_behaviour(row_of({"kind": StepKind.WAIT_ONLINE, "device": "d"}))
    command = kinds.row_behaviour(row_of({"kind": StepKind.COMMAND, "device": "d"}))
    assert wait.queue_timeout_error.format(device="d", seconds=5, why="offline") == (
        "device d did not come online within 5s"
    )
    assert command.queue_timeout_error.format(device="d", seconds=5, why="busy") == (
        "waited 5s for device d (busy)"
    )


def test_every_due_deadline_of_a_delay_row_ends_it_and_only_a_delays():
    assert set(kinds.REGISTRY.row_deadlines) == {StepKind.DELAY}


def test_only_delays_have_no_compensation():
    compensable = {kind for kind, behaviour in kinds.REGISTRY.step_kinds.items() if behaviour.compensable}
    assert compensable == {StepKind.COMMAND, StepKind.WAIT_ONLINE, StepKind.TASK, FANOUT}


def test_a_fanout_is_undone_per_device_and_the_other_kinds_by_one_row():
    # given the rollback's handlers by kind: only the fan-out declares its own
    assert set(kinds.REGISTRY.compensations) == {FANOUT}
    assert kinds.step_compensation_handler({"labels": {"kind": "gw"}}).__name__ == "fanout_compensate"
    assert kinds.step_compensation_handler({"device": "gw-1"}) is None


def test_only_the_rollback_policy_is_declared_beside_abort_and_continue():
    assert kinds.failure_policy_handler(OnFailure.ABORT) is None
    assert kinds.failure_policy_handler(OnFailure.CONTINUE) is None
    assert kinds.failure_policy_handler(OnFailure.ROLLBACK) is not None


def test_a_task_row_sends_its_device_no_command_other_rows_do():
    assert kinds.row_commanded(row_of({"kind": StepKind.COMMAND, "device": "d"}))
    assert kinds.row_commanded(row_of({"kind": StepKind.COMMAND, "group": "g"}))
    assert not kinds.row_commanded(row_of({"kind": StepKind.TASK, "device": "d"}))


def test_a_queued_wait_online_row_checks_its_device_again_a_command_asks_for_the_lock():
    assert kinds.row_resume_handler(row_of({"kind": StepKind.COMMAND, "device": "d"})) is None
    resume = kinds.row_resume_handler(row_of({"kind": StepKind.WAIT_ONLINE, "device": "d"}))
    assert resume is not None and resume.__name__ == "wait_online_check"
