"""Holding a command for its time windows: whether a queued row may ask for its device now.

The planner asks `row_hold` where a queued row asks for its device's lock (`row_acquire`)
and where a device is handed to it (`handed_plan`): a row outside every maintenance window
that applies to it, or in its device's quiet hours, stays `queued` without asking, and a
`window` deadline at the time it may go asks again (`dues_plan`). An urgent step (`urgent`
in the plan) is never held.

Pure but for `window_groups_read`, which the executor calls beside its other reads: the
windows come from the run (the ones that applied when it was created, `JobRun.windows`),
the quiet hours from the device row. A run with no windows and a device with no quiet hours
cost one attribute test each: no query, no Redis call.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from devices.models import Device

from ..models import JobRun, StepRun
from ..timewindows import Hold, QuietHours, WindowSpec, hold_until, zone
from .plan import step_spec

# A device's time zone label, when its `timezone` field is empty.
TZ_LABEL = "tz"


def device_quiet_hours(device: Device) -> QuietHours | None:
    """The device's quiet hours in its time zone (its field, its `tz` label, else UTC)."""
    if device.quiet_hours_start is None or device.quiet_hours_end is None:
        return None
    tz = device.timezone or (device.labels or {}).get(TZ_LABEL) or "UTC"
    try:
        zone(tz)
    except ValueError:
        tz = "UTC"  # a label no one validated: the field is validated when saved
    return QuietHours(device.quiet_hours_start, device.quiet_hours_end, tz)


def device_windows(run: JobRun, device: Device, groups: Iterable[str] = ()) -> list[WindowSpec]:
    """The run's windows that apply to `device` (`groups`: the device's group names)."""
    specs = [WindowSpec.from_dict(entry) for entry in run.windows or ()]
    labels = device.labels or {}
    return [
        spec
        for spec in specs
        if (spec.group and spec.group in groups)
        or (spec.label and labels.get(spec.label[0]) == spec.label[1])
        or (not spec.group and not spec.label)
    ]


def row_hold(row: StepRun, now: datetime, groups: dict[str, frozenset[str]]) -> Hold | None:
    """Why the row's command may not go now and until when, or None. `groups`: the group
    names of the devices whose run has group windows (`window_groups_read`)."""
    if row.device_id is None:
        return None
    device = row.device
    if not row.run.windows and device.quiet_hours_start is None:
        return None  # the common case: nothing to look at
    if step_spec(row).get("urgent"):
        return None
    windows = device_windows(row.run, device, groups.get(device.name, ())) if row.run.windows else []
    return hold_until(windows, device_quiet_hours(device), now)


def run_has_group_windows(run: JobRun) -> bool:
    return any(entry.get("group") for entry in run.windows or ())


def window_groups_read(pairs: Iterable[tuple[JobRun, str]]) -> dict[str, frozenset[str]]:
    """The group names of the devices (by name) whose run has group windows: one query
    when there are any, none otherwise."""
    names = {device for run, device in pairs if run.windows and run_has_group_windows(run)}
    return device_groups_read(names) if names else {}


def device_groups_read(names: Iterable[str]) -> dict[str, frozenset[str]]:
    """The group names of the devices (by name): one query."""
    groups: dict[str, set[str]] = {name: set() for name in names}
    for device, group in Device.groups.through.objects.filter(device__name__in=names).values_list(
        "device__name", "devicegroup__name"
    ):
        groups[device].add(group)
    return {name: frozenset(found) for name, found in groups.items()}


def hold_message(hold: Hold) -> str:
    """What a `step.held` event says (in English, as every event)."""
    if hold.reason == "window":
        return f"outside maintenance window {hold.window}; opens at {hold.until.isoformat()}"
    return f"quiet hours until {hold.until.isoformat()}"
