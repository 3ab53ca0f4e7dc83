"""Starting runs: the one entry point every trigger (REST, admin, beat, MQTT, CLI) calls."""

from __future__ import annotations

from typing import Any

from django.db import IntegrityError, transaction

from .events import event_record
from .models import JobRun, JobTemplate, Trigger


class RunStartError(ValueError):
    """The run cannot start; `field` names the offending input."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


PLAN_FIELDS = (
    "position",
    "name",
    "kind",
    "device_param",
    "labels",
    "action",
    "args",
    "delay_seconds",
    "timeout_seconds",
    "ack_timeout_seconds",
    "queue_timeout_seconds",
    "max_attempts",
    "backoff_seconds",
    "on_failure",
    "compensation_action",
    "compensation_args",
    "rollout_per_minute",
    "max_in_flight",
    "abort_failure_percent",
    "abort_min_devices",
    "success_percent",
)


def template_plan(template: JobTemplate) -> list[dict[str, Any]]:
    """Snapshot of the template's steps, so editing a template never changes a started run."""
    plan = []
    for step in template.steps.select_related("device", "group").order_by("position"):
        spec = {name: getattr(step, name) for name in PLAN_FIELDS}
        spec["device"] = step.device.name if step.device_id else ""
        spec["group"] = step.group.name if step.group_id else ""
        plan.append(spec)
    return plan


def run_start(
    *,
    template: JobTemplate,
    parameters: dict[str, Any] | None = None,
    trigger: str = Trigger.REST,
    triggered_by: str = "",
    priority: int | None = None,
    idempotency_key: str | None = None,
) -> tuple[JobRun, bool]:
    """Create a run and enqueue its first step after commit; returns (run, created).

    With an idempotency key that an earlier run already used, that run is returned and
    nothing new starts.
    """
    parameters = {} if parameters is None else parameters
    if not isinstance(parameters, dict):
        raise RunStartError("parameters", "parameters must be a JSON object")
    if priority is not None and not 0 <= priority <= 9:
        raise RunStartError("priority", "priority must be from 0 to 9")
    if idempotency_key:
        existing = JobRun.objects.filter(idempotency_key=idempotency_key).first()
        if existing is not None:
            return existing, False
    plan = template_plan(template)
    if not plan:
        raise RunStartError("template", f"template {template.name!r} has no steps")
    try:
        with transaction.atomic():
            run = JobRun.objects.create(
                template=template,
                parameters=parameters,
                plan=plan,
                trigger=trigger,
                triggered_by=triggered_by,
                priority=template.default_priority if priority is None else priority,
                idempotency_key=idempotency_key or None,
            )
            event_record("run.created", run=run, message=f"{trigger} by {triggered_by or 'anonymous'}")
            transaction.on_commit(lambda: _run_enqueue(run))
    except IntegrityError:
        if idempotency_key:
            return JobRun.objects.get(idempotency_key=idempotency_key), False
        raise
    return run, True


def _run_enqueue(run: JobRun) -> None:
    from .tasks import run_advance_task

    run_advance_task.delay(str(run.pk))
