"""What a step row executes, read from its run's plan: spec, target, args, ids. No writes.

Every stage of the engine reads a step through these functions, so a compensation (which
runs the step's compensation action), a for-each run (`device_param`) and a fan-out
(group / labels / selector) look the same to dispatching and to ending an attempt.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import Count

from devices.locks import holder_name
from devices.models import Device
from devices.selectors import labels_requirements, selector_filter, selector_parse

from .. import templating
from ..choices import DevicesFromOutcome
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
# The row statuses of each outcome of a fan-out that later steps may target (`devices_from`)
# or list ({{ steps.NAME.succeeded }}, .failed): "failed" is every row that ended without
# success; skipped rows (not started: the rollout aborted first) are neither.
OUTCOME_STATUSES = {
    DevicesFromOutcome.SUCCEEDED: (StepStatus.SUCCEEDED,),
    DevicesFromOutcome.FAILED: (
        StepStatus.FAILED,
        StepStatus.REJECTED,
        StepStatus.TIMED_OUT,
        StepStatus.CANCELED,
    ),
}
# The per-device values and what each reads: (outcome, column); a list of device names when
# the column is the name itself, else a mapping name -> column.
FANOUT_LISTS = {
    "results": (DevicesFromOutcome.SUCCEEDED, "result"),
    "errors": (DevicesFromOutcome.FAILED, "error"),
    "succeeded": (DevicesFromOutcome.SUCCEEDED, "device__name"),
    "failed": (DevicesFromOutcome.FAILED, "device__name"),
}
# The keys of {{ steps.NAME.counts }} (outcome_counts).
COUNT_KEYS = ("succeeded", "failed", "rejected", "timed_out", "canceled", "skipped", "unfinished", "total")


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
            "devices_from": {},
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
    """Whether a plan entry fans out: it targets a group, labels, a label selector, or the
    devices of an earlier fan-out by outcome (`devices_from`)."""
    return bool(spec.get("group") or spec.get("labels") or spec.get("selector") or spec.get("devices_from"))


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
    (jobs/engine/planner_locks.py `rows_name`, for a run's next step and for the rows kinds'
    starts ask for: jobs/engine/batch.py `row_create`) are made from them."""
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


def step_context(run: JobRun, device: Device | None = None, paths: list[str] | None = None) -> dict[str, Any]:
    """What {{ references }} in a step's args can read: params, earlier results, run, device.

    Only the steps that `paths` (reference paths) name are read (None: every step's result): the
    `result` of each in one query, and of a fan-out step only the values referenced (its
    `counts` one GROUP BY; `results`, `errors`, `succeeded`, `failed` one query each, at most
    IOTQUEUE_STEP_RESULTS_MAX_DEVICES devices: fanout_values). Raises templating.TemplateError
    when a referenced list is longer.
    """
    wanted = _steps_wanted(run.plan, paths)
    # A fan-out's `result` is one device's: the query returns each of its rows, the last wins.
    results = dict(
        StepRun.objects.filter(
            run=run,
            phase=Phase.FORWARD,
            status=StepStatus.SUCCEEDED,
            index__in=[index for index, names in wanted.items() if "result" in names],
        ).values_list("index", "result")
    )
    steps: dict[str, Any] = {}
    for index, spec in enumerate(run.plan):
        if index not in wanted:
            continue
        entry = {"result": results.get(index)}
        if spec_is_fanout(spec):
            entry.update(fanout_values(run, index, wanted[index]))
        steps[str(index)] = entry
        if spec.get("name"):
            steps[spec["name"]] = entry
    context = {"params": run.parameters, "steps": steps, "run": {"id": str(run.pk)}}
    if device is not None:
        context["device"] = {"name": device.name, "labels": device.labels}
    return context


def _steps_wanted(plan: list[dict[str, Any]], paths: list[str] | None) -> dict[int, set[str]]:
    """Per step index, the values of it that `paths` read (`result`, `counts`, …); the
    `result` of every step when `paths` is None."""
    if paths is None:
        return {index: {"result"} for index in range(len(plan))}
    indexes = {str(index): index for index in range(len(plan))}
    indexes.update({spec["name"]: index for index, spec in enumerate(plan) if spec.get("name")})
    wanted: dict[int, set[str]] = {}
    for path in paths:
        parts = path.split(".")
        if parts[0] == "steps" and len(parts) > 2 and parts[1] in indexes:
            wanted.setdefault(indexes[parts[1]], set()).add(parts[2])
    return wanted


def fanout_values(run: JobRun, index: int, names: set[str]) -> dict[str, Any]:
    """What later steps may read of the fan-out step at `index`, only the `names` asked for:

    - `counts`: its rows by outcome (COUNT_KEYS), one GROUP BY;
    - `results` (device name -> result, of the devices that succeeded), `errors` (device
      name -> error, of those that failed), `succeeded` and `failed` (device names, in name
      order): one query each, refused past IOTQUEUE_STEP_RESULTS_MAX_DEVICES devices.
    """
    rows = StepRun.objects.filter(run=run, phase=Phase.FORWARD, index=index)
    values: dict[str, Any] = {}
    if "counts" in names:
        by_status = dict(rows.order_by().values_list("status").annotate(n=Count("pk")))
        values["counts"] = outcome_counts(by_status)
    limit = settings.IOTQUEUE_STEP_RESULTS_MAX_DEVICES
    for name, (outcome, column) in FANOUT_LISTS.items():
        if name not in names:
            continue
        chosen = rows.filter(status__in=OUTCOME_STATUSES[outcome], device__isnull=False)
        found = list(chosen.order_by("device__name").values_list("device__name", column)[: limit + 1])
        if len(found) > limit:
            step = run.plan[index].get("name") or index
            raise templating.TemplateError(
                f"{{{{ steps.{step}.{name} }}}} has more than {limit} devices "
                "(IOTQUEUE_STEP_RESULTS_MAX_DEVICES): read its counts, or target the devices "
                "with devices_from"
            )
        values[name] = [device for device, _ in found] if column == "device__name" else dict(found)
    return values


def outcome_counts(by_status: dict[str, int]) -> dict[str, int]:
    """A fan-out's rows by outcome ({{ steps.NAME.counts }}): one key per ending status,
    `unfinished` for rows not ended (pending, or at work after an abort), and `total`."""
    ended = {key: by_status.get(key, 0) for key in COUNT_KEYS if key not in ("unfinished", "total")}
    total = sum(by_status.values())
    return {**ended, "unfinished": total - sum(ended.values()), "total": total}


def step_args(run: JobRun, args: dict[str, Any], device: Device | None) -> dict[str, Any]:
    """Args with their references resolved; no context is read when there are none.

    Raises templating.TemplateError when a reference has no value, or when the args take
    more than IOTQUEUE_COMMAND_MAX_BYTES as JSON (checked while rendering, before any row
    holds them: the step is refused and its run fails at once, saying so).
    """
    return args_renderer(run, args)(device)


def args_renderer(run: JobRun, args: dict[str, Any]) -> Callable[[Device | None], dict[str, Any]]:
    """step_args for many devices (a fan-out's rows): the earlier steps' values the args
    reference are read once, at the first device, not once per device."""
    limit = settings.IOTQUEUE_COMMAND_MAX_BYTES
    paths = templating.references(args)
    if not paths:
        size = templating.json_size(args)
        if size > limit:
            raise templating.TemplateError(
                f"the args take {size} bytes, more than {limit} (IOTQUEUE_COMMAND_MAX_BYTES)"
            )
        return lambda device: args
    read: dict[str, Any] = {}

    def render(device: Device | None) -> dict[str, Any]:
        if not read:
            read.update(step_context(run, paths=paths))
        context = dict(read)
        if device is not None:
            context["device"] = {"name": device.name, "labels": device.labels}
        return templating.render(args, context, limit=limit)

    return render


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


def fanout_devices(spec: dict[str, Any], run: JobRun | None = None) -> list[Device]:
    """Enabled devices of the step's group, or that its labels and label selector match,
    as they are now (a fan-out step calls this when it starts); for a step with
    `devices_from`, the enabled devices of `run`'s earlier fan-out step with that outcome.

    Raises ValueError when the selector does not parse, or `devices_from` names no fan-out
    step of the run (a plan written before validation).
    """
    devices = Device.objects.filter(enabled=True).order_by("name")
    if spec.get("devices_from"):
        return list(devices.filter(pk__in=outcome_rows(run, spec["devices_from"]).values("device_id")))
    if spec.get("group"):
        devices = devices.filter(groups__name=spec["group"])
    requirements = labels_requirements(spec.get("labels") or {}) + selector_parse(spec.get("selector") or "")
    return list(selector_filter(devices, requirements))


def outcome_rows(run: JobRun | None, devices_from: dict[str, Any]):
    """The rows of `run`'s fan-out step named `devices_from["step"]` that ended with
    `devices_from["outcome"]` (OUTCOME_STATUSES). Raises ValueError when the run has no
    such fan-out step."""
    name, outcome = devices_from.get("step"), devices_from.get("outcome")
    plan = run.plan if run is not None else []
    index = next((i for i, spec in enumerate(plan) if name and spec.get("name") == name), None)
    if index is None or not spec_is_fanout(plan[index]) or outcome not in OUTCOME_STATUSES:
        raise ValueError(f"no fan-out step {name!r} with outcome {outcome!r} in the run")
    return StepRun.objects.filter(
        run=run, phase=Phase.FORWARD, index=index, status__in=OUTCOME_STATUSES[outcome]
    )


def fanout_target(spec: dict[str, Any]) -> str:
    """A fan-out's target as the engine's messages name it: `labels {...}`, `devices that
    succeeded in step flash`."""
    if spec.get("devices_from"):
        source = spec["devices_from"]
        return f"devices that {source.get('outcome')} in step {source.get('step')}"
    return next((f"{name} {spec[name]}" for name in ("group", "labels", "selector") if spec.get(name)), "")
