"""Template validation (jobs/validation.py): what an operator is told, field by field, on save."""

from __future__ import annotations

import pytest
from celery import shared_task

from jobs.models import JobStep, StepKind
from jobs.tasksteps import step_task
from jobs.validation import step_errors, template_errors


@step_task
@shared_task(name="tests.unit.firmware_url")
def firmware_url(version: str) -> dict:
    """A registered step task, as a user's own would be."""
    return {"url": f"https://fw.example.com/{version}.bin"}


def step(position: int = 0, **fields) -> JobStep:
    """An unsaved command step on a device (by id: validation reads no rows)."""
    fields.setdefault("device_id", 1)
    fields.setdefault("action", "on")
    return JobStep(position=position, **fields)


def test_a_command_step_on_one_device_with_a_topic_safe_action_is_valid():
    assert step_errors(step(action="firmware/check-2.1", args={"level": "{{ params.level }}"})) == {}


@pytest.mark.parametrize(
    "targets",
    [
        {"device_id": None},
        {"device_id": 1, "device_param": "device"},
        {"device_id": None, "group_id": 2, "labels": {"kind": "pump"}},
    ],
)
def test_a_command_step_needs_exactly_one_target(targets):
    # when a command step has no target, or two, then the device field says to choose one
    assert step_errors(step(**targets))["device"].startswith("Choose exactly one target")


@pytest.mark.parametrize("action", ["", "on off", "/on", "cmd/#", "lamp+"])
def test_an_action_that_is_not_topic_safe_is_refused(action):
    assert step_errors(step(action=action))["action"] == "Use letters, digits and . _ / - only."


def test_a_delay_step_has_no_target_and_a_positive_delay():
    # when a delay step names a device and no delay
    errors = step_errors(step(kind=StepKind.DELAY, delay_seconds=0))

    # then both are reported; a delay step alone with a delay is fine
    assert set(errors) == {"device", "delay_seconds"}
    assert step_errors(step(kind=StepKind.DELAY, device_id=None, delay_seconds=1.5)) == {}


def test_wait_online_waits_for_one_device_not_a_group():
    errors = step_errors(step(kind=StepKind.WAIT_ONLINE, device_id=None, group_id=3))

    assert errors == {"group": "wait_online waits for one device, not a group."}


def test_labels_must_be_an_object_of_strings():
    errors = step_errors(step(device_id=None, labels={"kind": "pump", "rack": 4}))

    assert errors["labels"].startswith("Labels must be a JSON object of strings")


def test_a_compensation_action_must_be_topic_safe_too():
    assert "compensation_action" in step_errors(step(compensation_action="undo it"))
    assert step_errors(step(compensation_action="off")) == {}


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["not", "an", "object"], "Must be a JSON object."),
        ({"x": "{{ secrets.token }}"}, "a reference starts with one of params, steps, run, device"),
        ({"x": "{{ params.level"}, "malformed reference"),
    ],
)
def test_args_are_an_object_whose_references_start_at_a_known_root(args, problem):
    # when args or compensation args are not an object or reference something else
    errors = step_errors(step(args=args, compensation_args=args))

    # then both fields say why
    assert problem in errors["args"] and problem in errors["compensation_args"]


def test_a_task_step_names_a_registered_task_and_runs_on_at_most_one_device():
    # when task steps name the registered task, an unknown one, or target a group
    valid = step(kind=StepKind.TASK, device_id=None, action="tests.unit.firmware_url")
    unknown = step(kind=StepKind.TASK, device_id=None, action="os.system")
    grouped = step(kind=StepKind.TASK, device_id=None, group_id=2, action="tests.unit.firmware_url")

    # then only the registered one on no device is valid
    assert step_errors(valid) == {}
    assert step_errors(unknown) == {
        "action": "'os.system' is not a registered step task (decorate it with @step_task)."
    }
    assert step_errors(grouped)["device"].startswith("A task step runs once")


def test_a_task_step_ends_within_the_brokers_visibility_timeout(settings):
    # given a broker that hands a message out again after 120 s
    settings.CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 120}

    # when a task step may take that long, then it is refused: the task would run twice at once
    too_long = step(kind=StepKind.TASK, device_id=None, action="tests.unit.firmware_url", timeout_seconds=120)
    assert "visibility timeout (120s" in step_errors(too_long)["timeout_seconds"]
    assert (
        step_errors(
            step(kind=StepKind.TASK, device_id=None, action="tests.unit.firmware_url", timeout_seconds=119)
        )
        == {}
    )


def test_steps_may_read_earlier_steps_results_by_index_or_name():
    # given a template whose steps arrive out of order
    steps = [
        step(2, args={"a": "{{ steps.0.result.serial }}", "b": "{{ steps.info.result.version }}"}),
        step(0, name="info", action="read_info"),
        step(1, args={"serial": "{{ steps.info.result.serial }}"}),
    ]

    # then references to earlier steps, by position from 0 or by name, are fine
    assert template_errors(steps) == {}


@pytest.mark.parametrize(
    ("reference", "problem"),
    [
        ("steps.1.result", "'1' is not an earlier step"),  # itself
        ("steps.2.result", "'2' is not an earlier step"),  # a later one
        ("steps.later.result", "'later' is not an earlier step"),
        ("steps", "'' is not an earlier step"),
        ("steps.0.args", "a step reference reads its result"),
    ],
)
def test_a_reference_to_the_step_itself_a_later_one_or_not_its_result_is_refused(reference, problem):
    # given step 1 referencing something other than an earlier step's result
    steps = [step(0), step(1, args={"x": f"{{{{ {reference} }}}}"}), step(2, name="later")]

    # when the template is validated, then step 1's args say why
    assert problem in template_errors(steps)["step 1"]["args"]


def test_a_compensation_may_read_its_own_steps_result():
    # given a compensation that undoes with what the step itself returned
    own = step(
        0, name="open", compensation_action="close", compensation_args={"id": "{{ steps.open.result.id }}"}
    )

    # then it is valid, while the forward args may not read it
    assert template_errors([own]) == {}
    own.args = {"id": "{{ steps.open.result.id }}"}
    assert "'open' is not an earlier step" in template_errors([own])["step 0"]["args"]


def test_step_names_are_unique():
    errors = template_errors([step(0, name="read"), step(1, name="read")])

    assert errors == {"step 1": {"name": "Name 'read' is already used by step 0."}}


def test_max_extend_seconds_is_bounded_to_a_week():
    assert "max_extend_seconds" not in step_errors(step(max_extend_seconds=0))
    errors = step_errors(step(max_extend_seconds=8 * 24 * 3600))
    assert errors["max_extend_seconds"].startswith("Give 0 to 604800 seconds")


def fanout(position: int, name: str = "", **fields) -> JobStep:
    """An unsaved fan-out step over a label."""
    return step(position, name=name, device_id=None, labels={"kind": "gateway"}, **fields)


def test_a_step_may_target_the_devices_of_an_earlier_fan_out_by_outcome():
    # given a flash to every gateway, a verify on those that flashed, a retry on the others
    steps = [
        fanout(0, "flash", action="firmware/flash"),
        step(1, name="verify", device_id=None, devices_from={"step": "flash", "outcome": "succeeded"}),
        step(2, device_id=None, devices_from={"step": "verify", "outcome": "failed"}),
    ]

    # then it is valid: a step with devices_from is a fan-out itself, so a later one may use it
    assert template_errors(steps) == {}


@pytest.mark.parametrize(
    "devices_from",
    [
        {"step": "flash"},
        {"step": "flash", "outcome": "skipped"},
        {"step": "", "outcome": "failed"},
        {"step": 0, "outcome": "failed"},
        {"step": "flash", "outcome": "failed", "wave": 1},
        ["flash", "failed"],
    ],
)
def test_devices_from_takes_a_step_name_and_an_outcome(devices_from):
    errors = step_errors(step(device_id=None, devices_from=devices_from))

    assert errors["devices_from"].startswith('Use {"step": NAME, "outcome": OUTCOME}')
    assert "succeeded, failed" in errors["devices_from"]


@pytest.mark.parametrize(
    ("source", "position"),
    [
        ("check", 1),  # an earlier step that is not a fan-out
        ("retry", 1),  # a later fan-out
        ("verify", 1),  # itself
        ("nothing", 1),  # no such step
    ],
)
def test_devices_from_names_an_earlier_fan_out_step_of_the_template(source, position):
    # given a single-device step, the step under test, then a later fan-out
    steps = [
        step(0, name="check"),
        step(position, name="verify", device_id=None, devices_from={"step": source, "outcome": "succeeded"}),
        fanout(2, "retry"),
    ]

    # then the field says which step it names and what it must be
    message = template_errors(steps)[f"step {position}"]["devices_from"]
    assert message.startswith(f"'{source}' is not an earlier fan-out step of this template")


def test_devices_from_is_one_target_among_the_others():
    # a step with devices_from and a device, or a task or wait_online step with it, is refused
    both = step(devices_from={"step": "flash", "outcome": "failed"})
    assert step_errors(both)["device"].startswith("Choose exactly one target")
    waiting = step(kind=StepKind.WAIT_ONLINE, device_id=None, devices_from={"step": "a", "outcome": "failed"})
    assert "device" not in step_errors(waiting) and "group" in step_errors(waiting)


def test_a_fan_out_steps_results_counts_and_device_lists_may_be_read_by_later_steps():
    # given a report after a fan-out, reading what the fan-out offers beside its result
    report = step(
        1,
        args={
            "counts": "{{ steps.flash.counts }}",
            "failed": "{{ steps.flash.failed }}",
            "ok": "{{ steps.0.succeeded }}",
            "versions": "{{ steps.flash.results }}",
            "why": "{{ steps.flash.errors.gw-7 }}",
            "failures": "{{ steps.flash.counts.failed }} failed",
        },
    )

    # then it is valid
    assert template_errors([fanout(0, "flash"), report]) == {}


@pytest.mark.parametrize(
    ("reference", "problem"),
    [
        ("steps.check.counts", "a step reference reads its result"),  # not a fan-out
        ("steps.flash.rows", "a fan-out step's reference reads one of result, results, errors, counts"),
    ],
)
def test_a_fan_outs_values_are_read_only_of_a_fan_out(reference, problem):
    steps = [step(0, name="check"), fanout(1, "flash"), step(2, args={"x": f"{{{{ {reference} }}}}"})]

    assert problem in template_errors(steps)["step 2"]["args"]
