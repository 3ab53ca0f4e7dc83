"""Starting runs: the one entry point every trigger (REST, admin, beat, MQTT, CLI) calls;
and recording a template's versions, which runs are started from."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone
from django.utils.translation import gettext as _

from devices.selectors import selector_parse
from iotqueue.text import text_problem

from .choices import DevicesFromOutcome
from .engine.plan import fanout_devices
from .events import event_record
from .inbox import run_enqueue
from .models import (
    DEVICE_WINDOWS_SCOPE,
    EndBehaviour,
    JobRun,
    JobStep,
    JobTemplate,
    MaintenanceWindow,
    TemplateVersion,
    Trigger,
    window_scope,
)
from .parameters import parameters_problem
from .rows import row_last, row_new, rows_create, rows_select
from .run_windows import run_window_deadlines_set
from .timewindows import WindowSpec
from .versions import version_snapshot

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
    "selector",
    "action",
    "args",
    "delay_seconds",
    "timeout_seconds",
    "ack_timeout_seconds",
    "queue_timeout_seconds",
    "max_extend_seconds",
    "max_attempts",
    "backoff_seconds",
    "on_failure",
    "compensation_action",
    "compensation_args",
    "urgent",
    "rollout_per_minute",
    "max_in_flight",
    "abort_failure_percent",
    "abort_min_devices",
    "abort_criteria",
    "rollout_increment_factor",
    "rollout_increment_every",
    "rollout_increment_on",
    "rollout_max_per_minute",
    "success_percent",
    "compensation_per_minute",
    "continuous",
    "open_seconds",
    "devices_from",
    "waves",
)


def template_plan(template: JobTemplate) -> list[dict[str, Any]]:
    """Snapshot of the template's steps, so editing a template never changes a started run.

    Every run start reads it (`template_version_record`), so the steps are read without the
    ORM's per-query compilation (jobs/rows.py), which cost several times the query itself.
    """
    steps = rows_select(JobStep, "template", [template.pk], related=("device", "group"))
    plan = []
    for step in sorted(steps, key=lambda step: step.position):
        spec = {name: getattr(step, name) for name in PLAN_FIELDS}
        spec["device"] = step.device.name if step.device_id else ""
        spec["group"] = step.group.name if step.group_id else ""
        if not spec["devices_from"]:
            # Left out when unset, so the snapshots of templates saved before the field
            # existed stay equal and their next run records no new version.
            del spec["devices_from"]
        plan.append(spec)
    return plan


def template_snapshot(template: JobTemplate) -> dict[str, Any]:
    """What a version of the template holds: its steps and the template-level fields a run
    takes from it. Name and description are left out: they change no run."""
    return {
        "default_priority": template.default_priority,
        "max_duration": template.max_duration,
        "steps": template_plan(template),
    }


def template_version_record(*, template: JobTemplate, author: Any = None) -> TemplateVersion:
    """The template's latest version, after recording the next one if the template changed.

    Call it after the template's steps are written, in the same transaction. A save that
    changes nothing a run executes (steps, default priority) records no version. Two callers
    at once are serialized on the template's row, so numbers stay 1..n without gaps.
    """
    snapshot = template_snapshot(template)
    latest = row_last(TemplateVersion, "template", template.pk, by="number")
    if latest is not None and version_snapshot(latest) == snapshot:
        return latest  # the common case (every run start) takes no lock
    with transaction.atomic():
        JobTemplate.objects.select_for_update().filter(pk=template.pk).first()
        latest = template.versions.order_by("-number").first()
        if latest is not None and version_snapshot(latest) == snapshot:
            return latest
        return TemplateVersion.objects.create(
            template=template,
            number=latest.number + 1 if latest else 1,
            author=author if getattr(author, "pk", None) else None,
            **snapshot,
        )


def plan_step_target(spec: dict[str, Any]) -> str:
    """What a plan entry addresses, for people: `lamp-2`, `group pumps`, `labels kind=pump`."""
    if spec.get("device"):
        return spec["device"]
    if spec.get("device_param"):
        return f"{{{{ params.{spec['device_param']} }}}}"
    if spec.get("group"):
        return _("group %(group)s") % {"group": spec["group"]}
    if spec.get("labels"):
        labels = ",".join(f"{k}={v}" for k, v in spec["labels"].items())
        return _("labels %(labels)s") % {"labels": labels}
    if spec.get("selector"):
        return _("selector %(selector)s") % {"selector": spec["selector"]}
    if spec.get("devices_from"):
        return devices_from_text(spec["devices_from"])
    return "-"


def devices_from_text(devices_from: dict[str, Any]) -> str:
    """A `devices_from` target for people: `devices that succeeded in step flash`."""
    values = {"step": devices_from.get("step")}
    if devices_from.get("outcome") == DevicesFromOutcome.FAILED:
        return _("devices that failed in step %(step)s") % values
    return _("devices that succeeded in step %(step)s") % values


def run_start(
    *,
    template: JobTemplate,
    parameters: dict[str, Any] | None = None,
    trigger: str = Trigger.REST,
    triggered_by: str = "",
    priority: int | None = None,
    idempotency_key: str | None = None,
    plan: list[dict[str, Any]] | None = None,
    version: int | None = None,
    not_before: datetime | None = None,
    end_by: datetime | None = None,
    end_behaviour: str = EndBehaviour.CANCEL,
) -> tuple[JobRun, bool]:
    """Create a run and enqueue its first step after commit; returns (run, created).

    The run executes a version of the template, recorded on the run: `version` by number,
    or else the template as it is now (recorded as its next version first if it was changed
    without one, e.g. in a shell). With an idempotency key that an earlier run already used,
    that run is returned and nothing new starts. `plan` runs these steps instead (a canvas
    command, jobs/canvas.py), filed under the template with no version.

    Time windows: a run with `not_before` ahead stays pending until then; at `end_by` its
    `end_behaviour` decides (jobs/run_windows.py). The maintenance windows that apply to
    the template's runs, its devices' groups or labels are kept on the run
    (`run_windows_snapshot`).

    Raises RunStartError naming the field at fault, before any row is written: among
    others when `parameters` lack one the steps read (jobs/parameters.py).
    """
    run_window_check(not_before=not_before, end_by=end_by, end_behaviour=end_behaviour)
    parameters = {} if parameters is None else parameters
    if not isinstance(parameters, dict):
        raise RunStartError("parameters", _("parameters must be a JSON object"))
    parameters_check(parameters)
    if priority is not None and not 0 <= priority <= 9:
        raise RunStartError("priority", _("priority must be from 0 to 9"))
    if idempotency_key:
        existing = JobRun.objects.filter(idempotency_key=idempotency_key).first()
        window = timedelta(hours=settings.IOTQUEUE_IDEMPOTENCY_HOURS)
        if existing is not None and existing.created_at > timezone.now() - window:
            return existing, False
        if existing is not None:  # the key's window is over: it may start a new run
            JobRun.objects.filter(pk=existing.pk).update(idempotency_key=None)
    try:
        with transaction.atomic():
            template_version = None if plan else _run_version(template, version)
            plan = plan or template_version.steps
            if not plan:
                raise RunStartError(
                    "template", _("template '%(name)s' has no steps") % {"name": template.name}
                )
            # Before the run exists: a run that could only fail on its first reference is refused.
            problem = parameters_problem(plan, parameters)
            if problem:
                raise RunStartError("parameters", problem)
            default_priority = (
                template_version.default_priority if template_version else template.default_priority
            )
            run = row_new(
                JobRun,
                template=template,
                template_version=template_version,
                parameters=parameters,
                plan=plan,
                trigger=trigger,
                triggered_by=triggered_by,
                priority=default_priority if priority is None else priority,
                idempotency_key=idempotency_key or None,
                max_duration=template_version.max_duration if template_version else None,
                not_before=not_before,
                end_by=end_by,
                end_behaviour=end_behaviour,
                windows=run_windows_snapshot(template),
            )
            rows_create(JobRun, [run])  # the ORM's save compiles its INSERT on every call
            event_record("run.created", run=run, message=f"{trigger} by {triggered_by or 'anonymous'}")
            transaction.on_commit(lambda: _run_enqueue(run))
    except IntegrityError:
        if idempotency_key:
            return JobRun.objects.get(idempotency_key=idempotency_key), False
        raise
    return run, True


def _run_version(template: JobTemplate, number: int | None) -> TemplateVersion:
    """The version a run of the template executes: `number`, or the template as it is now."""
    if number is None:
        return template_version_record(template=template)
    version = template.versions.filter(number=number).first()
    if version is None:
        message = _("template '%(name)s' has no version %(number)d") % {
            "name": template.name,
            "number": number,
        }
        raise RunStartError("template_version", message)
    return version


def parameters_check(parameters: dict[str, Any]) -> None:
    """Parameters every entrance (REST, admin, CLI, trigger rules, canvas) may store: text
    that can be stored (iotqueue/text.py), within IOTQUEUE_RUN_PARAMETERS_MAX_BYTES."""
    problem = text_problem(parameters)
    if problem:
        message = _("text that cannot be stored is not accepted: %(problem)s") % {"problem": problem}
        raise RunStartError("parameters", message)
    size = len(json.dumps(parameters, separators=(",", ":"), ensure_ascii=False).encode())
    limit = settings.IOTQUEUE_RUN_PARAMETERS_MAX_BYTES
    if size > limit:
        raise RunStartError(
            "parameters",
            _(
                "parameters take %(size)d bytes as JSON, "
                "more than IOTQUEUE_RUN_PARAMETERS_MAX_BYTES (%(limit)d)"
            )
            % {"size": size, "limit": limit},
        )


def _run_enqueue(run: JobRun) -> None:
    if (run.not_before is not None or run.end_by is not None) and run_window_deadlines_set(run):
        return  # its `start` deadline starts it (jobs/run_windows.py)
    run_enqueue(str(run.pk))  # started with whatever else the engine is doing (jobs/inbox.py)


def run_window_check(*, not_before: datetime | None, end_by: datetime | None, end_behaviour: str) -> None:
    """A run's own time window, as every entrance may give it; RunStartError naming the field."""
    if end_behaviour not in EndBehaviour.values:
        raise RunStartError(
            "end_behaviour",
            _("end_behaviour must be one of: %(choices)s") % {"choices": ", ".join(EndBehaviour.values)},
        )
    for name, value in (("not_before", not_before), ("end_by", end_by)):
        if value is not None and timezone.is_naive(value):
            raise RunStartError(
                name, _("%(field)s needs a time zone (e.g. 2026-11-28T02:00:00+01:00)") % {"field": name}
            )
    if end_by is not None and end_by <= timezone.now():
        raise RunStartError("end_by", _("end_by is in the past"))
    if not_before is not None and end_by is not None and end_by <= not_before:
        raise RunStartError("end_by", _("end_by must be later than not_before"))


def run_windows_snapshot(template: JobTemplate) -> list[dict[str, Any]]:
    """The maintenance windows a run of `template` keeps: the template's, and every group's
    and label's (which of its devices they hold is decided per command). One indexed read
    (by `MaintenanceWindow.scope`) without the ORM's query compilation: every start makes it."""
    scopes = [window_scope(template.pk), DEVICE_WINDOWS_SCOPE]
    windows = rows_select(MaintenanceWindow, "scope", scopes, related=("group",))
    return [
        WindowSpec(
            w.name,
            w.cron,
            w.duration_minutes,
            w.timezone,
            w.group.name if w.group_id else "",
            (w.label_key, w.label_value) if w.label_key else None,
        ).as_dict()
        for w in sorted(windows, key=lambda w: w.name)
    ]


def run_start_each(
    *,
    template: JobTemplate,
    group: str = "",
    labels: dict[str, str] | None = None,
    selector: str = "",
    parameters: dict[str, Any] | None = None,
    **options: Any,
) -> list[JobRun]:
    """One run of the template per device of a group / label selector ("for each device").

    Each run gets the device's name as parameter `device`; steps address it with
    device_param "device". `labels` and `selector` (devices/selectors.py) must both match.
    The devices are those enabled when the trigger fires. An empty
    selector (it would match every device) is refused.
    """
    for_each_target_check(group=group, labels=labels or {}, selector=selector)
    devices = fanout_devices({"group": group, "labels": labels or {}, "selector": selector})
    for_each_count_check(len(devices))
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


def for_each_target_check(*, group: str, labels: dict[str, str], selector: str) -> None:
    """Refuse a for-each target whose selector does not parse, or that would match every device."""
    try:
        requirements = selector_parse(selector)
    except ValueError as exc:
        raise RunStartError("for_each", _("not a label selector: %(problem)s") % {"problem": exc}) from None
    if not group and not labels and not requirements:
        raise RunStartError("for_each", _("name a group or at least one label; an empty selector is refused"))


def for_each_count_check(count: int) -> None:
    """Refuse a for-each start over no enabled device or over more than the deployment allows."""
    if not count:
        raise RunStartError("for_each", _("no enabled device matches"))
    limit = settings.IOTQUEUE_FOR_EACH_MAX_DEVICES
    if count > limit:
        raise RunStartError(
            "for_each",
            _(
                "%(count)d devices match, more than IOTQUEUE_FOR_EACH_MAX_DEVICES (%(limit)d); "
                "a fan-out step rolls out to a fleet at a set pace"
            )
            % {"count": count, "limit": limit},
        )
