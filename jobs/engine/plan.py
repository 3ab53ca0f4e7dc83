"""What a step row executes, read from its run's plan: spec, target, args, ids. No writes.

Every stage of the engine reads a step through these functions, so a compensation (which
runs the step's compensation action), a for-each run (`device_param`) and a fan-out
(group / labels / selector) look the same to dispatching and to ending an attempt.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings

from devices.locks import holder_name
from devices.models import Device
from devices.selectors import labels_requirements, selector_filter, selector_parse

from .. import templating
from ..models import JobRun, Phase, RunStatus, StepKind, StepRun, StepStatus

# Run states in which steps may be dispatched (compensations run while compensating).
RUN_ACTIVE = (RunStatus.RUNNING, RunStatus.COMPENSATING)
# A lock holder "step:<step run id>" is a step row of this app (devices/locks.py).
HOLDER_KIND = "step"
# The lock lease outlives the step's own timeout by this much, so the timeout (a step
# outcome) always fires before the lease expiry (a crash-recovery path).
LEASE_GRACE_SECONDS = 30.0
# The step kind of a plan entry that fans out (`spec_kind`), beside models.StepKind.
FANOUT = "fanout"


def step_holder(step_run: StepRun) -> str:
    return holder_name(HOLDER_KIND, step_run.pk)


def holder_step_id(holder: str) -> int | None:
    """The step run id a lock holder names, or None when it is not a step."""
    kind, _, ident = holder.partition(":")
    return int(ident) if kind == HOLDER_KIND and ident.isdigit() else None


def step_spec(step_run: StepRun) -> dict[str, Any]:
    """The plan entry a step row executes; a compensation runs the step's compensation."""
    spec = step_run.run.plan[step_run.index]
    if step_run.phase == Phase.COMPENSATION:
        # A task step is undone by a task (its compensation_action names one), any other by
        # a command to its device.
        return {
            **spec,
            "kind": StepKind.TASK if spec.get("kind") == StepKind.TASK else StepKind.COMMAND,
            "action": spec["compensation_action"],
            "args": spec["compensation_args"],
            "group": "",
            "labels": {},
            "selector": "",
        }
    return spec


def step_preempts(step_run: StepRun) -> bool:
    """Whether the row may take its busy device from a lower-priority command in flight:
    its step is `urgent` and its run's priority is at least IOTQUEUE_PREEMPT_PRIORITY (unset:
    never). Urgent preemption: docs/orchestration.md#urgent-preemption."""
    floor = settings.IOTQUEUE_PREEMPT_PRIORITY
    return (
        floor is not None
        and step_run.device_id is not None
        and step_run.phase == Phase.FORWARD
        and bool(step_run.run.plan[step_run.index].get("urgent"))
        and step_run.run.priority >= floor
    )


def spec_kind(spec: dict[str, Any]) -> str:
    """The kind a plan entry starts as: command, delay, wait_online, task or fanout."""
    if spec.get("kind") in (StepKind.DELAY, StepKind.TASK):
        return spec["kind"]
    if spec_is_fanout(spec):
        return FANOUT
    return spec.get("kind") or StepKind.COMMAND


def spec_is_fanout(spec: dict[str, Any]) -> bool:
    """Whether a plan entry fans out: it targets a group, labels or a label selector."""
    return bool(spec.get("group") or spec.get("labels") or spec.get("selector"))


def is_task_row(step_run: StepRun) -> bool:
    """A row that runs a registered Celery task (jobs/engine/taskstep.py) instead of
    sending a command: nothing of it is ever published to its device."""
    return step_spec(step_run).get("kind") == StepKind.TASK


def step_answerer(step_run: StepRun) -> str:
    """Who is to answer the row's attempt, for people: its device, or its task."""
    return f"task {step_run.action}" if is_task_row(step_run) else step_run.device_name


def lease_seconds(spec: dict[str, Any]) -> float:
    return float(spec["timeout_seconds"]) + LEASE_GRACE_SECONDS


def command_id_new(step_run_id: int, attempt: int) -> str:
    """Unique per attempt, and names its step so a late reply can be attributed."""
    return f"{step_run_id}-{attempt}-{uuid.uuid4().hex[:12]}"


def command_id_step(command_id: str) -> int | None:
    """The step run id a command id names, or None for a foreign id."""
    head = command_id.split("-", 1)[0]
    return int(head) if head.isdigit() else None


def queued_row(
    run: JobRun, index: int, *, device: Device | None, action: str, args: dict, phase: str, now: datetime
) -> dict[str, Any]:
    """The fields of a step's new `queued` row, with its queue deadline. A plan's rows
    (jobs/engine/planner.py `rows_name`) and a kind's start (jobs/engine/start.py
    `step_row_create`) make the same row from them."""
    return {
        "run": run,
        "phase": phase,
        "index": index,
        "device": device,
        "action": action,
        "args": args,
        "status": StepStatus.QUEUED,
        "queued_at": now,
        "deadline": now + timedelta(seconds=run.plan[index]["queue_timeout_seconds"]),
    }


def queued_message(step_run: StepRun) -> str:
    """What a row's `step.queued` event says: where and what."""
    return f"{step_run.device_name or 'task'} {step_run.action}"


def step_context(run: JobRun, device: Device | None = None) -> dict[str, Any]:
    """What {{ references }} in a step's args can read: params, earlier results, run, device."""
    results = dict(
        StepRun.objects.filter(run=run, phase=Phase.FORWARD, status=StepStatus.SUCCEEDED).values_list(
            "index", "result"
        )
    )
    steps: dict[str, Any] = {}
    for index, spec in enumerate(run.plan):
        entry = {"result": results.get(index)}
        steps[str(index)] = entry
        if spec.get("name"):
            steps[spec["name"]] = entry
    context = {"params": run.parameters, "steps": steps, "run": {"id": str(run.pk)}}
    if device is not None:
        context["device"] = {"name": device.name, "labels": device.labels}
    return context


def step_args(run: JobRun, args: dict[str, Any], device: Device | None) -> dict[str, Any]:
    """Args with their references resolved; no context is read when there are none.

    Raises templating.TemplateError when a reference has no value, or when the args take
    more than IOTQUEUE_COMMAND_MAX_BYTES as JSON (checked while rendering, before any row
    holds them: the step is refused and its run fails at once, saying so).
    """
    limit = settings.IOTQUEUE_COMMAND_MAX_BYTES
    if not templating.references(args):
        size = templating.json_size(args)
        if size > limit:
            raise templating.TemplateError(
                f"the args take {size} bytes, more than {limit} (IOTQUEUE_COMMAND_MAX_BYTES)"
            )
        return args
    return templating.render(args, step_context(run, device), limit=limit)


def step_target_name(run: JobRun, spec: dict[str, Any]) -> tuple[str | None, str]:
    """The name of the one device a step addresses, or (None, why not)."""
    if spec.get("device_param"):
        name = run.parameters.get(spec["device_param"])
        if not isinstance(name, str) or not name:
            return None, f"run parameter {spec['device_param']!r} must name a device"
        return name, ""
    return spec["device"], ""


def step_target(
    run: JobRun, spec: dict[str, Any], devices: dict[str, Device] | None = None
) -> tuple[Device | None, str]:
    """The one device a step addresses, or (None, why not). `devices` may hold it already."""
    name, problem = step_target_name(run, spec)
    if name is None:
        return None, problem
    device = devices.get(name) if devices is not None else Device.objects.filter(name=name).first()
    if device is None or not device.enabled:
        return None, f"device {name} {'is disabled' if device else 'does not exist'}"
    return device, ""


def fanout_devices(spec: dict[str, Any]) -> list[Device]:
    """Enabled devices of the step's group, or that its labels and label selector match,
    as they are now (a fan-out step calls this when it starts).

    Raises ValueError when the selector does not parse (a plan written before validation).
    """
    devices = Device.objects.filter(enabled=True).order_by("name")
    if spec.get("group"):
        devices = devices.filter(groups__name=spec["group"])
    requirements = labels_requirements(spec.get("labels") or {}) + selector_parse(spec.get("selector") or "")
    return list(selector_filter(devices, requirements))
