"""The run parameters a template needs (jobs/parameters.py), read off its steps."""

from __future__ import annotations

import pytest

from jobs.canvas import device_command
from jobs.models import JobStep
from jobs.parameters import (
    parameters_missing,
    parameters_missing_message,
    parameters_problem,
    template_device_parameters,
    template_parameters,
)
from jobs.templating import parameter_names


def test_parameter_names_are_the_first_level_under_params_in_order_of_first_use():
    value = {
        "reason": "door {{ params.door }} opened by {{params.badge}}",
        "nested": [{"url": "{{ params.previous.url }}"}, "{{ params.door }}"],
        "serial": "{{ steps.0.result.serial }}",
        "device": "{{ device.name }}",
        "all": "{{ params }}",  # the whole object: no one name is needed
    }

    assert parameter_names(value) == ["door", "badge", "previous"]


def test_malformed_references_are_skipped_not_raised():
    # a plan stored before validation existed still answers
    assert parameter_names({"a": "{{ params.level", "b": "{{ params.ok }}"}) == ["ok"]
    assert parameter_names(7) == [] and parameter_names(None) == []


def test_a_plan_needs_args_compensation_args_and_device_param_names_each_once():
    plan = [
        {"args": {"level": "{{ params.level }}"}, "compensation_args": {}, "device_param": ""},
        {"args": {}, "compensation_args": {"undo": "{{ params.backup }}"}, "device_param": "pump"},
        {"args": {"again": "{{ params.level }}"}, "compensation_args": {}, "device_param": "pump"},
    ]

    assert template_parameters(plan) == ["level", "pump", "backup"]
    assert template_device_parameters(plan) == {"pump"}


def test_unsaved_step_objects_answer_like_a_plan():
    steps = [JobStep(position=0, action="on", args={"level": "{{ params.level }}"}, device_param="lamp")]

    assert template_parameters(steps) == ["lamp", "level"]


def test_missing_parameters_are_named_and_a_null_value_counts_as_given():
    plan = [{"args": {"a": "{{ params.level }}", "b": "{{ params.zone }}"}}]

    assert parameters_missing(template_parameters(plan), {"zone": None}) == ["level"]
    assert parameters_problem(plan, {"level": 1, "zone": "B"}) == ""
    assert parameters_problem(plan, "not an object") == ""  # reported on its own elsewhere
    message = parameters_problem(plan, {})
    assert "level, zone" in message and "{{ params.NAME }}" in message
    assert parameters_missing_message(["level"]).startswith("missing parameter: level")


def test_a_canvas_command_reading_a_parameter_it_cannot_have_is_refused_when_built():
    assert device_command("lamp-2", "on", {"because": "{{ params.previous.action }}"})

    with pytest.raises(ValueError, match=r"missing parameter: level.*previous"):
        device_command("lamp-2", "on", {"level": "{{ params.level }}"})
