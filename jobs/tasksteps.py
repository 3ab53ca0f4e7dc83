"""Celery tasks allowed as template steps (kind `task`): the registry, and calling one.

A task becomes usable as a step by decorating it, on top of its Celery decorator:

    @step_task
    @shared_task(name="myapp.firmware_url")
    def firmware_url(model: str) -> dict: ...

Only registered names may be saved in a template (jobs/validation.py), so a template can
never make the worker run an arbitrary task. Registration happens when the task's module is
imported: the worker imports every app's `tasks.py` and CELERY_IMPORTS, and the web process
does the same the first time a name is looked up (`step_task_registered`), so both agree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from celery import current_app
from django.conf import settings

_registered: set[str] = set()
_discovered = False


def step_task(task: Any) -> Any:
    """Decorator: allow this Celery task as a template step; returns the task unchanged."""
    _registered.add(task.name)
    return task


def step_tasks_discover() -> None:
    """Import the task modules the worker imports (apps' tasks.py, CELERY_IMPORTS), once,
    so that a process that is not a worker knows the same registered names."""
    global _discovered
    if not _discovered:
        current_app.loader.import_default_modules()
        _discovered = True


def step_task_registered(name: str) -> bool:
    step_tasks_discover()
    return name in _registered


@dataclass(frozen=True)
class TaskOutcome:
    """What a step task's call amounts to, in the terms of a device's `done`."""

    ok: bool
    result: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    retryable: bool = False


def step_task_call(name: str, args: dict[str, Any]) -> TaskOutcome:
    """Run the registered task `name` in this process with `args` as keyword arguments.

    Its return value becomes the step's result: a dict as it is, None as {}, anything else
    as {"value": ...}; it must be JSON and at most IOTQUEUE_MAX_PAYLOAD_BYTES, as a device's
    result must (else the step fails without a retry: calling again returns the same). An
    exception fails the attempt as retryable, so the step's max_attempts decide.
    """
    if name not in _registered:
        return TaskOutcome(ok=False, error=f"{name!r} is not a registered step task in this worker")
    try:
        value = current_app.tasks[name](**args)
    except Exception as exc:  # the task's own failure is the step's outcome, not ours
        return TaskOutcome(ok=False, error=f"{type(exc).__name__}: {exc}", retryable=True)
    result = value if isinstance(value, dict) else {} if value is None else {"value": value}
    try:
        size = len(json.dumps(result, separators=(",", ":")))
    except (TypeError, ValueError) as exc:
        return TaskOutcome(ok=False, error=f"{name} returned a value that is not JSON: {exc}")
    if size > settings.IOTQUEUE_MAX_PAYLOAD_BYTES:
        return TaskOutcome(
            ok=False, error=f"{name} returned {size} bytes of JSON (> IOTQUEUE_MAX_PAYLOAD_BYTES)"
        )
    return TaskOutcome(ok=True, result=result)
