"""Template validation: what an operator gets told when saving a template, field by field.

Checked on save (admin and REST), so a run never discovers a typo at 02:00: the target is
exactly one of device / device_param / group / labels; actions are topic-safe; args are
JSON objects whose {{ references }} are well-formed and point at run parameters or at
earlier steps (by position or name), never at the step itself or a later one.
"""

from __future__ import annotations

from typing import Any

from devices.protocol import ACTION_RE

from . import templating
from .choices import StepKind

# What an args reference may start with.
REFERENCE_ROOTS = ("params", "steps", "run", "device")


def _target_count(step) -> int:
    return sum(bool(x) for x in (step.device_id, step.device_param, step.group_id, step.labels))


def step_errors(step) -> dict[str, str]:
    """Errors of one step on its own, keyed by field name."""
    errors: dict[str, str] = {}
    targets = _target_count(step)
    if step.kind == StepKind.DELAY:
        if targets:
            errors["device"] = "A delay step has no target device."
        if not step.delay_seconds or step.delay_seconds <= 0:
            errors["delay_seconds"] = "A delay step needs delay_seconds > 0."
        return errors
    if targets != 1:
        errors["device"] = "Choose exactly one target: device, device_param, group or labels."
    if step.kind == StepKind.WAIT_ONLINE and (step.group_id or step.labels):
        errors["group"] = "wait_online waits for one device, not a group."
    if step.kind == StepKind.COMMAND and not ACTION_RE.match(step.action or ""):
        errors["action"] = "Use letters, digits and . _ / - only."
    if step.compensation_action and not ACTION_RE.match(step.compensation_action):
        errors["compensation_action"] = "Use letters, digits and . _ / - only."
    if step.labels and (
        not isinstance(step.labels, dict) or not all(isinstance(v, str) for v in step.labels.values())
    ):
        errors["labels"] = 'Labels must be a JSON object of strings, e.g. {"kind": "pump"}.'
    for field in ("args", "compensation_args"):
        value = getattr(step, field)
        if not isinstance(value, dict):
            errors[field] = "Must be a JSON object."
            continue
        try:
            for ref in templating.references(value):
                if ref.split(".")[0] not in REFERENCE_ROOTS:
                    raise templating.TemplateError(
                        f"{{{{ {ref} }}}}: a reference starts with one of {', '.join(REFERENCE_ROOTS)}"
                    )
        except templating.TemplateError as exc:
            errors[field] = str(exc)
    return errors


def template_errors(steps: list[Any]) -> dict[str, dict[str, str]]:
    """Errors of a template's steps in position order, keyed by "step <position>" then field.

    Adds the checks one step cannot make alone: references to other steps must name an
    earlier step, positions and names must be unique.
    """
    errors: dict[str, dict[str, str]] = {}
    ordered = sorted(steps, key=lambda s: s.position)
    seen_names: dict[str, int] = {}
    for index, step in enumerate(ordered):
        label = f"step {step.position}"
        own = step_errors(step)
        if step.name:
            if step.name in seen_names:
                own["name"] = f"Name {step.name!r} is already used by step {seen_names[step.name]}."
            seen_names[step.name] = step.position
        for field in ("args", "compensation_args"):
            if field in own or not isinstance(getattr(step, field), dict):
                continue
            problem = _step_reference_problem(getattr(step, field), index, ordered, seen_names, field)
            if problem:
                own[field] = problem
        if own:
            errors[label] = own
    return errors


def _step_reference_problem(value, index: int, ordered: list, names: dict[str, int], field: str) -> str:
    # A compensation runs after its own step succeeded, so it may use that step's result.
    limit = index + 1 if field == "compensation_args" else index
    earlier = {str(i) for i in range(limit)} | {s.name for s in ordered[:limit] if s.name}
    for ref in templating.references(value):
        parts = ref.split(".")
        if parts[0] != "steps":
            continue
        if len(parts) < 2 or parts[1] not in earlier:
            target = parts[1] if len(parts) > 1 else ""
            return f"{{{{ {ref} }}}}: {target!r} is not an earlier step (use its index from 0 or its name)"
        if len(parts) > 2 and parts[2] != "result":
            return f"{{{{ {ref} }}}}: a step reference reads its result, e.g. steps.{parts[1]}.result.serial"
    return ""
