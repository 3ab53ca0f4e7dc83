"""Starting runs: the one entry point every trigger (REST, admin, beat, MQTT, CLI) calls."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from .engine.plan import fanout_devices
from .events import event_record
from .inbox import run_enqueue
from .models import JobRun, JobTemplate, Trigger

# The task that (re)starts a run at its cursor, by name (jobs/tasks.py sits above this
# module); the monitor sends it for runs its sweep finds stuck.
RUN_ADVANCE_TASK = "jobs.run_advance"


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


def plan_step_target(spec: dict[str, Any]) -> str:
    """What a plan entry addresses, for people: `lamp-2`, `group pumps`, `labels kind=pump`."""
    if spec.get("device"):
        return spec["device"]
    if spec.get("device_param"):
        return f"{{{{ params.{spec['device_param']} }}}}"
    if spec.get("group"):
        return f"group {spec['group']}"
    if spec.get("labels"):
        return "labels " + ",".join(f"{k}={v}" for k, v in spec["labels"].items())
    return "-"


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
        window = timedelta(hours=settings.IOTQUEUE_IDEMPOTENCY_HOURS)
        if existing is not None and existing.created_at > timezone.now() - window:
            return existing, False
        if existing is not None:  # the key's window is over: it may start a new run
            JobRun.objects.filter(pk=existing.pk).update(idempotency_key=None)
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
    run_enqueue(str(run.pk))  # started with whatever else the engine is doing (jobs/inbox.py)


def run_start_each(
    *,
    template: JobTemplate,
    group: str = "",
    labels: dict[str, str] | None = None,
    parameters: dict[str, Any] | None = None,
    **options: Any,
) -> list[JobRun]:
    """One run of the template per device of a group / label selector ("for each device").

    Each run gets the device's name as parameter `device`; steps address it with
    device_param "device". The devices are those enabled when the trigger fires.
    """
    devices = fanout_devices({"group": group, "labels": labels or {}})
    if not devices:
        raise RunStartError("for_each", "no enabled device matches")
    key = options.pop("idempotency_key", None)
    return [
        run_start(
            template=template,
            parameters={**(parameters or {}), "device": device.name},
            idempotency_key=f"{key}:{device.name}" if key else None,
            **options,
        )[0]
        for device in devices
    ]
