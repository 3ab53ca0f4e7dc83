"""What starting a run would do, without starting it: targets, presence, queues, limits, ETA.

`run_preview` validates the start's input as `run_start` does (the same RunStartError,
field and message) and then only reads: one device query per step, one Redis round trip
for every device's lock state, one query per step for its action's recent durations. It
writes nothing, not even the template's next version (it reads the template as it is now).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone
from django.utils.translation import gettext as _

from devices.locks import device_lock_states
from devices.models import Device
from devices.selectors import labels_requirements, selector_filter, selector_parse

from .choices import DevicesFromOutcome, StepKind
from .engine.holds import device_groups_read
from .engine.plan import FANOUT, spec_kind, step_target_name
from .engine.waves import waves_expand
from .estimate import (
    TYPICAL_SAMPLE_ROWS,
    fanout_expected_seconds,
    row_timing,
    typical_seconds,
    waves_finish_seconds,
)
from .limits import limits_enabled
from .models import JobRun, JobTemplate, Phase, StepRun, StepStatus
from .parameters import parameters_problem
from .services import (
    RunStartError,
    for_each_count_check,
    for_each_target_check,
    parameters_check,
    plan_step_target,
    run_windows_snapshot,
    template_snapshot,
)
from .timewindows import WindowSpec, window_next_start, window_open
from .versions import version_snapshot

# Device names a step's preview lists at most (the counts cover them all): a preview of a
# 100,000-device fan-out stays a few kilobytes.
PREVIEW_MAX_DEVICES = 100
# The columns a preview reads of each targeted device (one query per step).
DEVICE_COLUMNS = (
    "name",
    "enabled",
    "online",
    "presence_required",
    "min_interval_seconds",
    "max_per_minute",
    "labels",
)


@dataclass
class TargetDevice:
    """A device a step would address, as the preview reads it."""

    name: str
    enabled: bool
    online: bool
    presence_required: bool
    min_interval_seconds: float
    max_per_minute: int
    labels: dict[str, str] = field(default_factory=dict)  # a fan-out in waves by_label splits on them
    holder: str | None = None
    queue: list[str] = field(default_factory=list)

    @property
    def reachable(self) -> bool:
        return self.online or not self.presence_required

    @property
    def ahead(self) -> int:
        """Commands before a new one on this device: the holder's and those queued."""
        return len(self.queue) + (1 if self.holder else 0)


def run_preview(
    *,
    template: JobTemplate,
    parameters: dict[str, Any] | None = None,
    priority: int | None = None,
    version: int | None = None,
    for_each: dict[str, Any] | None = None,
    **ignored: Any,
) -> dict[str, Any]:
    """The preview of a run start (`POST /api/runs/preview/`, the admin's *Preview*).

    Raises RunStartError as run_start / run_start_each would for the same input. Other
    keyword arguments of a start (idempotency_key, trigger) change nothing it shows.
    """
    parameters = _input_check(parameters, priority)
    plan, number, default_priority = _plan_read(template, version)
    each = _for_each_read(for_each) if for_each else None
    if each is not None:  # each run gets its device as parameter "device": the first shows
        parameters = {**parameters, "device": each["first"]}
    problem = parameters_problem(plan, parameters)
    if problem:
        raise RunStartError("parameters", problem)
    steps, targets = _steps_preview(plan, parameters, template_id=template.pk)
    total = _total_seconds(steps)
    now = timezone.now()
    return {
        "template": template.name,
        "template_version": number,
        "priority": default_priority if priority is None else priority,
        "runs": each["matched"] if each else 1,
        "for_each": {key: value for key, value in each.items() if key != "first"} if each else None,
        "steps": steps,
        "estimate": {
            "seconds": total,
            "finish_at": now + timedelta(seconds=total) if total is not None else None,
            "steps_in_sequence": True,
            # Waves whose gate waits for an operator: their time is not in the estimate.
            "approval_gates": sum(step["estimate"].get("approval_gates", 0) for step in steps),
        },
        "problems": [
            _("step %(index)d: %(problem)s") % {"index": step["index"], "problem": p}
            for step in steps
            for p in step["problems"]
        ],
        "windows": _windows_preview(template, targets, now),
        "previewed_at": now,
    }


def _input_check(parameters: Any, priority: int | None) -> dict[str, Any]:
    """The parameters, checked as run_start checks them (the same field and message)."""
    parameters = {} if parameters is None else parameters
    if not isinstance(parameters, dict):
        raise RunStartError("parameters", _("parameters must be a JSON object"))
    # run_start's own check (size, storable text), shared rather than copied.
    parameters_check(parameters)
    if priority is not None and not 0 <= priority <= 9:
        raise RunStartError("priority", _("priority must be from 0 to 9"))
    return parameters


def _plan_read(template: JobTemplate, number: int | None) -> tuple[list[dict], int | None, int]:
    """(plan, version number, default priority) a run would execute; never records a version."""
    if number is not None:
        version = template.versions.filter(number=number).first()
        if version is None:
            message = _("template '%(name)s' has no version %(number)d") % {
                "name": template.name,
                "number": number,
            }
            raise RunStartError("template_version", message)
        plan, default_priority = version.steps, version.default_priority
    else:
        snapshot = template_snapshot(template)
        plan, default_priority = snapshot["steps"], snapshot["default_priority"]
        # The version the start would reuse, or the next one it would record.
        latest = template.versions.order_by("-number").first()
        if latest is None:
            number = 1
        else:
            number = latest.number if version_snapshot(latest) == snapshot else latest.number + 1
    if not plan:
        raise RunStartError("template", _("template '%(name)s' has no steps") % {"name": template.name})
    return plan, number, default_priority


def _for_each_read(for_each: dict[str, Any]) -> dict[str, Any]:
    """The devices a for-each start would run on, checked as run_start_each checks them."""
    for_each_target_check(
        group=for_each.get("group") or "",
        labels=for_each.get("labels") or {},
        selector=for_each.get("selector") or "",
    )
    enabled = [device.name for device in _devices_matching(for_each) if device.enabled]
    for_each_count_check(len(enabled))
    return {"matched": len(enabled), "devices": enabled[:PREVIEW_MAX_DEVICES], "first": enabled[0]}


def _devices_matching(spec: dict[str, Any]) -> list[TargetDevice]:
    """Every device (enabled or not) of the spec's group, labels and selector, in one query,
    in name order (the order a fan-out writes, and so starts, its rows in)."""
    devices = Device.objects.order_by("name")
    if spec.get("group"):
        devices = devices.filter(groups__name=spec["group"])
    requirements = labels_requirements(spec.get("labels") or {}) + selector_parse(spec.get("selector") or "")
    return [TargetDevice(*row) for row in selector_filter(devices, requirements).values_list(*DEVICE_COLUMNS)]


def _steps_preview(
    plan: list[dict], parameters: dict[str, Any], *, template_id: int
) -> tuple[list[dict[str, Any]], list[TargetDevice]]:
    """Each step's targets and estimate, the lock states of all of them read at once; and
    the enabled devices the steps address."""
    targets: list[tuple[list[TargetDevice], list[str]]] = []
    for spec in plan:
        if spec.get("devices_from"):
            targets.append((_outcome_targets(spec["devices_from"], plan, targets), []))
        else:
            targets.append(_step_targets(spec, parameters))
    names = sorted({device.name for devices, _problems in targets for device in devices if device.enabled})
    states = device_lock_states(names) if names else {}
    for devices, _problems in targets:
        for device in devices:
            state = states.get(device.name)
            if state is not None:
                device.holder, device.queue = state.holder, state.queue
    previews = [
        _step_preview(index, spec, devices, problems, template_id=template_id)
        for index, (spec, (devices, problems)) in enumerate(zip(plan, targets, strict=True))
    ]
    enabled = {device.name: device for devices, _problems in targets for device in devices if device.enabled}
    return previews, list(enabled.values())


def _windows_preview(template: JobTemplate, devices: list[TargetDevice], now) -> list[dict[str, Any]]:
    """The maintenance windows a run would keep that hold any of its devices (time windows),
    each open now or not, and how many of the devices it holds: one query, two with group
    windows."""
    windows = [WindowSpec.from_dict(entry) for entry in run_windows_snapshot(template)]
    groups = {}
    if any(window.group for window in windows):
        groups = device_groups_read([device.name for device in devices])
    previews = []
    for window in windows:
        if window.group:
            held = sum(window.group in groups.get(device.name, ()) for device in devices)
            applies_to = f"group {window.group}"
        elif window.label:
            held = sum((device.labels or {}).get(window.label[0]) == window.label[1] for device in devices)
            applies_to = f"label {window.label[0]}={window.label[1]}"
        else:
            held, applies_to = len(devices), f"template {template.name}"
        if not held:
            continue
        closes = window_open(window, now)
        previews.append(
            {
                "name": window.name,
                "cron": window.cron,
                "duration_minutes": window.minutes,
                "timezone": window.tz,
                "applies_to": applies_to,
                "devices": held,
                "open_now": closes is not None,
                "closes_at": closes,
                "next_opening": None if closes is not None else window_next_start(window, now),
            }
        )
    return previews


def _step_targets(spec: dict[str, Any], parameters: dict[str, Any]) -> tuple[list[TargetDevice], list[str]]:
    """(devices the step addresses, problems that would fail it) as the engine would find them."""
    kind = spec_kind(spec)
    if kind == FANOUT:
        try:
            devices = _devices_matching(spec)
        except ValueError as exc:
            return [], [_("the selector does not parse: %(problem)s") % {"problem": exc}]
        enabled = sum(device.enabled for device in devices)
        limit = settings.IOTQUEUE_FANOUT_MAX_DEVICES
        if not enabled and not spec.get("continuous"):  # a continuous one waits for devices to join
            return devices, [_("no enabled device matches %(target)s") % {"target": plan_step_target(spec)}]
        if enabled > limit:
            problem = _("%(count)d devices match, more than IOTQUEUE_FANOUT_MAX_DEVICES (%(limit)d)")
            return devices, [problem % {"count": enabled, "limit": limit}]
        return devices, []
    if kind in (StepKind.DELAY, StepKind.TASK):
        return [], []
    name, problem = step_target_name(JobRun(parameters=parameters), spec)
    if name is None:
        return [], [problem]
    devices = _devices_named(name)
    if not devices:
        return [], [_("device %(name)s does not exist") % {"name": name}]
    if not devices[0].enabled:
        return devices, [_("device %(name)s is disabled") % {"name": name}]
    return devices, []


def _outcome_targets(
    source: dict[str, Any], plan: list[dict], earlier: list[tuple[list[TargetDevice], list[str]]]
) -> list[TargetDevice]:
    """A step targeting an earlier fan-out's devices by outcome, which only the run knows:
    for `succeeded`, that step's enabled devices (as if all of them succeed: the most it
    can be); for `failed`, none (as if none fails)."""
    if source.get("outcome") != DevicesFromOutcome.SUCCEEDED:
        return []
    index = next(
        (i for i, spec in enumerate(plan[: len(earlier)]) if spec.get("name") == source.get("step")), None
    )
    return [] if index is None else [device for device in earlier[index][0] if device.enabled]


def _devices_named(name: str) -> list[TargetDevice]:
    return [TargetDevice(*row) for row in Device.objects.filter(name=name).values_list(*DEVICE_COLUMNS)]


def _step_preview(
    index: int, spec: dict[str, Any], devices: list[TargetDevice], problems: list[str], *, template_id: int
) -> dict[str, Any]:
    kind = spec_kind(spec)
    enabled = [device for device in devices if device.enabled]
    return {
        "index": index,
        "name": spec.get("name") or "",
        "kind": kind,
        "action": spec.get("action") or "",
        "target": _preview_target(spec),
        "devices": _devices_summary(devices, enabled),
        "flow_control": _flow_control(enabled),
        "limits": _limits(spec, kind, enabled, template_id=template_id),
        "rollout": _rollout(spec) if kind == FANOUT else None,
        "continuous": _continuous(spec) if kind == FANOUT else None,
        "problems": problems,
        "estimate": _step_estimate(spec, kind, enabled, failing=bool(problems)),
    }


def _preview_target(spec: dict[str, Any]) -> str:
    target = plan_step_target(spec)
    if spec.get("devices_from"):  # counted as _outcome_targets says
        return _("%(target)s (known when the step starts)") % {"target": target}
    return target


def _devices_summary(devices: list[TargetDevice], enabled: list[TargetDevice]) -> dict[str, Any]:
    """Counts over every device, and the first PREVIEW_MAX_DEVICES of them by name."""
    return {
        "matched": len(devices),
        "enabled": len(enabled),
        "disabled": len(devices) - len(enabled),
        "online": sum(device.online for device in enabled),
        "reachable": sum(device.reachable for device in enabled),
        "offline_waiting": sum(not device.reachable for device in enabled),
        "busy": sum(device.holder is not None for device in enabled),
        "queued_ahead": sum(device.ahead for device in enabled),
        "listed": min(len(devices), PREVIEW_MAX_DEVICES),
        "items": [
            {
                "name": device.name,
                "enabled": device.enabled,
                "online": device.online,
                "presence_required": device.presence_required,
                "holder": device.holder,
                "queue_depth": len(device.queue),
            }
            for device in devices[:PREVIEW_MAX_DEVICES]
        ],
    }


def _flow_control(enabled: list[TargetDevice]) -> dict[str, Any]:
    """The per-device flow-control limits among the targets: how many have each, the strictest."""
    spaced = [device.min_interval_seconds for device in enabled if device.min_interval_seconds]
    capped = [device.max_per_minute for device in enabled if device.max_per_minute]
    return {
        "min_interval_devices": len(spaced),
        "min_interval_seconds_max": max(spaced, default=None),
        "max_per_minute_devices": len(capped),
        "max_per_minute_min": min(capped, default=None),
    }


def _limits(
    spec: dict[str, Any], kind: str, enabled: list[TargetDevice], *, template_id: int
) -> list[dict[str, Any]]:
    """The shared concurrency limits that apply to the step's command on its targets: how
    many targets each covers, over how many label values, and the largest value's share."""
    if kind in (StepKind.DELAY, StepKind.TASK):
        return []
    action = spec.get("action") or ""
    found = []
    for limit in limits_enabled():
        if not limit.applies(action=action, template_id=template_id):
            continue
        values = Counter(d.labels[limit.label] for d in enabled if limit.label in (d.labels or {}))
        if not values:
            continue
        value, most = values.most_common(1)[0]
        found.append(
            {
                "name": limit.name,
                "description": limit.describe(),
                "label": limit.label,
                "max_concurrent": limit.most,
                "devices": sum(values.values()),
                "label_values": len(values),
                "largest": {"value": value, "devices": most},
            }
        )
    return found


ROLLOUT_FIELDS = (
    "rollout_per_minute",
    "max_in_flight",
    "rollout_increment_factor",
    "rollout_increment_every",
    "rollout_increment_on",
    "rollout_max_per_minute",
    "success_percent",
    "abort_failure_percent",
    "abort_criteria",
    "waves",
)


def _rollout(spec: dict[str, Any]) -> dict[str, Any]:
    return {name: spec.get(name) for name in ROLLOUT_FIELDS}


def _continuous(spec: dict[str, Any]) -> dict[str, Any] | None:
    """A continuous fan-out stays open for devices that come to match it: until when."""
    if not spec.get("continuous"):
        return None
    seconds = spec.get("open_seconds")
    if seconds:
        note = _("continuous: devices that come to match join for %(seconds)d s after it starts") % {
            "seconds": seconds
        }
    else:
        note = _("continuous: devices that come to match join until it is closed by hand")
    return {"open_seconds": seconds, "note": note}


def _step_estimate(
    spec: dict[str, Any], kind: str, enabled: list[TargetDevice], *, failing: bool
) -> dict[str, Any]:
    """How long the step would take, and from what (fields, so a client can show its method)."""
    if failing:
        return {"seconds": None, "method": "fails_at_start", "typical_seconds": None, "typical_source": None}
    if kind == StepKind.DELAY:
        seconds = float(spec.get("delay_seconds") or 0)
        return {"seconds": seconds, "method": "delay", "typical_seconds": None, "typical_source": None}
    typical, source = typical_seconds(
        _recent_durations(spec["action"]), timeout_seconds=spec["timeout_seconds"]
    )
    base = {
        "typical_seconds": typical,
        "typical_source": source,
        "queue_timeout_seconds": spec["queue_timeout_seconds"],
    }
    if kind == StepKind.TASK:
        return {"seconds": typical, "method": "typical", **base}
    rows = [
        row_timing(
            ahead=device.ahead,
            reachable=device.online if kind == StepKind.WAIT_ONLINE else device.reachable,
            typical=0.0 if kind == StepKind.WAIT_ONLINE else typical,
            queue_timeout=spec["queue_timeout_seconds"],
        )
        for device in enabled
    ]
    timed_out = sum(not row.succeeds for row in rows)
    if kind == FANOUT and spec.get("waves"):
        assigned, waves = waves_expand(spec["waves"], enabled)
        waved = waves_finish_seconds(spec, rows, assigned, waves, tick=monitor_interval())
        return {
            "seconds": waved.seconds,
            "method": "waves_replay",
            "rows_timing_out": timed_out,
            "waves": waved.waves,
            "soak_seconds": waved.soak_seconds,
            "approval_gates": waved.approval_gates,
            **base,
        }
    if kind == FANOUT:
        # A pump waiting for the rate's window runs at the monitor's next tick after it.
        seconds = fanout_expected_seconds(spec, rows, tick=monitor_interval())
        if spec.get("continuous"):
            # It ends when it closes (its rows ended by then): at its end-by, or by hand (unknown).
            end_by = spec.get("open_seconds")
            seconds = max(seconds, float(end_by)) if end_by and seconds is not None else None
            method = "continuous_end_by" if end_by else "continuous_until_closed"
            return {"seconds": seconds, "method": method, "rows_timing_out": timed_out, **base}
        return {"seconds": seconds, "method": "rollout_replay", "rows_timing_out": timed_out, **base}
    seconds = rows[0].seconds if rows else None
    return {"seconds": seconds, "method": "queue_then_typical", "rows_timing_out": timed_out, **base}


def monitor_interval() -> float:
    return float(settings.IOTQUEUE_MONITOR_INTERVAL)


def _recent_durations(action: str) -> list[float]:
    """Seconds from dispatch to end of the action's latest succeeded rows (one query)."""
    rows = (
        StepRun.objects.filter(action=action, phase=Phase.FORWARD, status=StepStatus.SUCCEEDED)
        .exclude(dispatched_at=None)
        .exclude(finished_at=None)
        .order_by("-finished_at")
        .values_list("dispatched_at", "finished_at")[:TYPICAL_SAMPLE_ROWS]
    )
    return [(finished - dispatched).total_seconds() for dispatched, finished in rows]


def _total_seconds(steps: list[dict[str, Any]]) -> float | None:
    """The steps run one after the other; None when one of them has no estimate."""
    seconds = [step["estimate"]["seconds"] for step in steps]
    return None if any(value is None for value in seconds) else float(sum(seconds))
