"""The run parameters a template needs, read off its steps, and which of them a start misses.

A step needs parameter NAME when its args or compensation args say `{{ params.NAME }}` (or
`{{ params.NAME.field }}`), or when it addresses its device as `device_param` NAME. Every
entrance that starts runs checks the same list before anything is written (`run_start`),
and those that save what a later start will use (schedules, trigger rules, canvas
signatures) check it when they are saved, so no run is created only to fail on a missing
parameter.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from django.utils.translation import ngettext

from .models import JobStep, JobTemplate
from .templating import parameter_names

# Where a step reads run parameters (the device_param field names one itself).
PARAMETER_FIELDS = ("args", "compensation_args")


def _step_value(step: Mapping[str, Any] | JobStep, field: str) -> Any:
    return step.get(field) if isinstance(step, Mapping) else getattr(step, field, None)


def template_parameters(template_or_plan: JobTemplate | Iterable[Mapping[str, Any] | JobStep]) -> list[str]:
    """The names of the run parameters a template's steps read, in step order, each once.

    Takes a template (its steps as they are now, one query), a plan (a run's or a
    version's list of step dicts) or step objects (an admin formset's, not yet saved).
    """
    if isinstance(template_or_plan, JobTemplate):
        steps: Iterable[Any] = template_or_plan.steps.order_by("position").values(
            "device_param", *PARAMETER_FIELDS
        )
    else:
        steps = template_or_plan
    names: list[str] = []
    for step in steps:
        found = [_step_value(step, "device_param") or ""]
        for field in PARAMETER_FIELDS:
            found.extend(parameter_names(_step_value(step, field)))
        names.extend(name for name in found if name and name not in names)
    return names


def template_device_parameters(plan: Iterable[Mapping[str, Any]]) -> set[str]:
    """The parameters a plan's steps take as a device's name (`device_param`)."""
    return {step["device_param"] for step in plan if step.get("device_param")}


def parameters_missing(required: Iterable[str], parameters: Mapping[str, Any]) -> list[str]:
    """The required names `parameters` does not hold (a key given as null counts as given)."""
    return [name for name in required if name not in parameters]


def parameters_missing_message(missing: list[str]) -> str:
    """What to tell whoever left them out; names them and says where the need comes from."""
    return ngettext(
        "missing parameter: %(names)s (the template's steps read it as {{ params.%(names)s }})",
        "missing parameters: %(names)s (the template's steps read each as {{ params.NAME }})",
        len(missing),
    ) % {"names": ", ".join(missing)}


def parameters_problem(template_or_plan: Any, parameters: Any) -> str:
    """The message for parameters that miss some the template needs, or "" (none, or not a
    JSON object: that is reported on its own)."""
    if not isinstance(parameters, Mapping):
        return ""
    missing = parameters_missing(template_parameters(template_or_plan), parameters)
    return parameters_missing_message(missing) if missing else ""
