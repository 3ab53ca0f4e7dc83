"""Continuous fan-outs: devices that come to match an open fan-out join it; closing it.

A fan-out step with `continuous` stays open after it started (jobs/engine/continuous_open.py
`fanout_open` records a `ContinuousFanout`): a device that comes to match its target while
it is open — created, relabelled, added to its group, enabled, or back online — gets a row
of the step, once (the unique (run, phase, index, device) constraint), started by the same
pump and limits as the others. A device whose row timed out waiting in its queue (never
sent: it was offline) gets that row queued again when it joins online. The step is not
decided while it is open; it closes at its end-by (`open_seconds`, the `fanout_close`
deadline) or by hand (`fanout_close`), and then the success criterion decides over all rows.
A run that ends while its fan-out is open (canceled, timed out) closes it (`run_ended`). In
waves, a device that joins goes into the open wave.

How devices are noticed: jobs/apps.py connects device saves, group changes and bulk label
edits to `device_changes_noticed`, and a presence batch's devices back online reach
`fanouts_join` from jobs/presence.py. Each asks one cheap query first (`fanouts_open_any`)
and does nothing more while no continuous fan-out is open.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from celery import current_app
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from devices.models import Device
from devices.selectors import labels_requirements, selector_matches, selector_parse

from .. import templating
from ..deadlines import FANOUT_CLOSE, Deadline, deadlines_clear
from ..events import event_record, event_run
from ..models import ContinuousFanout, JobRun, Phase, Rollout, RunStatus, StepRun, StepStatus
from .fanout import fanout_pump
from .fanout_progress import fanout_progress
from .kinds import run_deadline
from .plan import step_args

log = logging.getLogger(__name__)

# The task that lets open continuous fan-outs look at changed devices (jobs/tasks.py).
JOIN_TASK = "jobs.fanout_join"
# Device names a `step.fanout_joined` event lists; the rest are counted (events stay bounded
# however many devices join at once).
JOINED_NAMES_SHOWN = 20
# Runs whose lost end-by one reconcile pass closes: the next pass takes the rest.
CLOSE_BATCH = 500


def device_joins(
    spec: Mapping[str, Any], *, labels: Mapping[str, str], groups: Iterable[str], enabled: bool
) -> bool:
    """Whether a device with these labels and groups is a target of the fan-out step `spec`
    (the same test `plan.fanout_devices` makes in SQL when the step starts). Pure."""
    if not enabled:
        return False
    if spec.get("group") and spec["group"] not in set(groups):
        return False
    try:
        requirements = labels_requirements(spec.get("labels") or {}) + selector_parse(
            spec.get("selector") or ""
        )
    except ValueError:
        return False  # a plan written before validation: its start refused it already
    return selector_matches(requirements, dict(labels))


def fanouts_open_any() -> bool:
    """Whether any continuous fan-out is open: one indexed query, the only one the hooks
    make while none is."""
    return ContinuousFanout.objects.filter(closed_at=None).exists()


def device_changes_noticed(device_ids: Iterable[int]) -> None:
    """Devices changed (created, relabelled, regrouped, enabled): after the commit, when a
    continuous fan-out is open, one task looks at them (`fanouts_join`)."""
    ids = sorted({int(pk) for pk in device_ids})
    if not ids:
        return

    def send() -> None:
        # After the commit of a device edit (a web request): a broker or database failure
        # here is logged, never raised into a response whose change was already committed.
        try:
            if fanouts_open_any():
                current_app.signature(JOIN_TASK, args=(ids,)).apply_async()
        except Exception:
            log.exception("devices %s were not looked at by the open continuous fan-outs", ids[:20])

    transaction.on_commit(send)


# The fields whose change may make a device match a fan-out it did not.
TARGETING_FIELDS = frozenset({"labels", "enabled"})


def device_saved(sender, *, instance: Device, created: bool, update_fields=None, **kwargs) -> None:
    """post_save of a device: a new one, or one whose labels or enabled flag may have changed."""
    if instance.enabled and (created or update_fields is None or TARGETING_FIELDS & set(update_fields)):
        device_changes_noticed([instance.pk])


def device_groups_changed(sender, *, instance, action: str, reverse: bool, pk_set=None, **kwargs) -> None:
    """m2m_changed of device groups: devices added to a group (from either side)."""
    if action == "post_add":
        # From a group's side (group.devices.add) pk_set holds the devices.
        device_changes_noticed((pk_set or ()) if reverse else [instance.pk])


def devices_relabelled(sender, *, device_ids: list[int], **kwargs) -> None:
    """A bulk label edit (devices/labels.py) changed these devices."""
    device_changes_noticed(device_ids)


def fanouts_join(device_ids: list[int]) -> int:
    """Give every open continuous fan-out a row for each of these devices it now targets
    (and a new try to a device back online whose row timed out in its queue); returns how
    many rows joined. A fan-out whose run moved on (canceled, timed out) is closed here."""
    opened = list(ContinuousFanout.objects.filter(closed_at=None).select_related("run"))
    if not opened:
        return 0
    devices = list(Device.objects.filter(pk__in=device_ids, enabled=True).prefetch_related("groups"))
    joined = 0
    for fanout in opened:
        run = fanout.run
        if run.status != RunStatus.RUNNING or run.cursor != fanout.index:
            ContinuousFanout.objects.filter(pk=fanout.pk, closed_at=None).update(closed_at=timezone.now())
            continue
        spec = run.plan[fanout.index]
        matching = [
            device
            for device in devices
            if device_joins(
                spec,
                labels=device.labels,
                groups=[g.name for g in device.groups.all()],
                enabled=device.enabled,
            )
        ]
        # Devices back online that have their row already (the common case) take no lock.
        kept = _rows_kept(run, fanout.index, matching)
        matching = [device for device in matching if device.pk not in kept]
        if matching:
            joined += fanout_devices_add(run=run, index=fanout.index, devices=matching)
    return joined


def _rows_kept(run: JobRun, index: int, devices: list[Device]) -> set[int]:
    """The devices among these whose row of the step stays as it is (all but a row that timed
    out in its queue, unsent): one query, outside the run's lock."""
    if not devices:
        return set()
    rows = StepRun.objects.filter(run=run, phase=Phase.FORWARD, index=index, device__in=devices)
    unsent = Q(status=StepStatus.TIMED_OUT, dispatched_at=None)
    return set(rows.exclude(unsent).values_list("device_id", flat=True))


def fanouts_join_names(names: list[str]) -> int:
    """`fanouts_join` for devices named by a presence batch; nothing while none is open."""
    if not names or not fanouts_open_any():
        return 0
    return fanouts_join(list(Device.objects.filter(name__in=names).values_list("pk", flat=True)))


def fanout_devices_add(*, run: JobRun, index: int, devices: list[Device]) -> int:
    """Add rows of the open fan-out for the devices that have none, queue again the rows of
    online devices that timed out in their queue, record who joined, and pump.

    Under the run's row lock (as a pump and a row's end), so a close or the step's end and
    a join are one after the other; a fan-out that closed meanwhile takes no one.
    """
    with transaction.atomic():
        locked = JobRun.objects.select_for_update().filter(pk=run.pk, status=RunStatus.RUNNING, cursor=index)
        if (
            not locked.exists()
            or not ContinuousFanout.objects.filter(run=run, index=index, closed_at=None).exists()
        ):
            return 0
        rows = StepRun.objects.filter(run=run, phase=Phase.FORWARD, index=index)
        have = dict(rows.filter(device__in=devices).values_list("device_id", "status"))
        unsent = set(
            rows.filter(device__in=devices, status=StepStatus.TIMED_OUT, dispatched_at=None).values_list(
                "device_id", flat=True
            )
        )
        spec = run.plan[index]
        # A fan-out in waves: who joins goes into the open wave (it starts now while the
        # rollout runs, and waits with the wave while it is paused, soaking or at a gate).
        rollout = Rollout.objects.filter(run=run, index=index).first() if spec.get("waves") else None
        wave = rollout.wave if rollout is not None else 0
        new, refused = [], []
        for device in devices:
            if device.pk in have:
                continue
            try:
                args = step_args(run, spec["args"], device)
            except templating.TemplateError as exc:
                refused.append(f"{device.name}: {exc}")
                continue
            new.append(
                StepRun(run=run, index=index, device=device, action=spec["action"], args=args, wave=wave)
            )
        StepRun.objects.bulk_create(new, ignore_conflicts=True)
        if rollout is not None and new:
            rollout.waves[wave]["size"] += len(new)
            rollout.save(update_fields=["waves", "updated_at"])
        again = [device for device in devices if device.pk in unsent and device.online]
        rows.filter(device__in=again, status=StepStatus.TIMED_OUT, dispatched_at=None).update(
            status=StepStatus.PENDING, error="", finished_at=None, deadline=None, queued_at=None
        )
        names = sorted(row.device.name for row in new) + sorted(device.name for device in again)
        if names:
            _joined_record(run, index, names, retried=len(again))
        for problem in refused:
            event_record("step.fanout_join_refused", run=run, message=problem, index=index)
        if names:
            fanout_pump(run=run, index=index)
    return len(names)


def run_ended(sender, event, **kwargs) -> None:
    """jobs.events.run_ended: a run that ended (canceled, timed out, failed) while its
    continuous fan-out was open closes it after the commit. Only a run whose plan has a
    continuous step (the plan is in memory) is looked at: no query for other runs' ends."""
    run = event_run(event)
    if run is None:
        return  # no run kept on the event: the next device change closes it (`fanouts_join`)
    if "plan" not in run.get_deferred_fields() and not any(spec.get("continuous") for spec in run.plan):
        return
    status = event.kind.removeprefix("run.")
    transaction.on_commit(lambda: fanouts_close_ended(run=run, status=status))


def fanouts_close_ended(*, run: JobRun, status: str) -> int:
    """Close the continuous fan-outs still open of a run that ended `status`, each with a
    `step.fanout_closed` event; returns how many (none when they were closed already)."""
    now, closed = timezone.now(), 0
    with transaction.atomic():
        opened = list(ContinuousFanout.objects.filter(run=run, closed_at=None))
        for fanout in opened:
            if not ContinuousFanout.objects.filter(pk=fanout.pk, closed_at=None).update(closed_at=now):
                continue
            closed += 1
            rows = StepRun.objects.filter(run=run, phase=Phase.FORWARD, index=fanout.index).count()
            event_record(
                "step.fanout_closed",
                run=run,
                message=f"continuous fan-out closed with {rows} devices: the run ended {status}",
                index=fanout.index,
                by=None,
                devices=rows,
                run_ended=status,
            )
        due = [Deadline(FANOUT_CLOSE, str(run.pk), f.index) for f in opened if f.closes_at is not None]
        if due:
            transaction.on_commit(lambda: deadlines_clear(due))
    return closed


def _joined_record(run: JobRun, index: int, names: list[str], *, retried: int) -> None:
    """One event for the devices that joined together: the first few named, all counted."""
    shown = ", ".join(names[:JOINED_NAMES_SHOWN])
    more = f" and {len(names) - JOINED_NAMES_SHOWN} more" if len(names) > JOINED_NAMES_SHOWN else ""
    again = f" ({retried} back online after their queue timed out)" if retried else ""
    event_record(
        "step.fanout_joined",
        run=run,
        message=f"{len(names)} devices joined the continuous fan-out{again}: {shown}{more}",
        index=index,
        devices=names[:JOINED_NAMES_SHOWN],
        count=len(names),
    )


def plan_step_index(plan: list[dict[str, Any]], step: str) -> int | None:
    """The index of the plan's step named `step` (its name, or its index from 0), or None."""
    for index, spec in enumerate(plan):
        if step in (str(index), spec.get("name")):
            return index
    return None


def fanout_close(*, run: JobRun, index: int | None = None, by: str) -> int | None:
    """Close the run's open continuous fan-out (step `index`, or whichever is open); returns
    the step it closed, or None when none is open. `by` names who closed it ("" = its end-by).

    No device joins it after this; once its rows have ended, the success criterion decides
    the step over all of them (at once when they already have).
    """
    with transaction.atomic():
        JobRun.objects.select_for_update().filter(pk=run.pk).first()
        opened = ContinuousFanout.objects.filter(run=run, closed_at=None)
        if index is not None:
            opened = opened.filter(index=index)
        fanout = opened.order_by("index").first()
        if fanout is None:
            return None
        ContinuousFanout.objects.filter(pk=fanout.pk).update(closed_at=timezone.now(), closed_by=by)
        rows = StepRun.objects.filter(run=run, phase=Phase.FORWARD, index=fanout.index).count()
        who = f"by {by}" if by else "at its end-by"
        event_record(
            "step.fanout_closed",
            run=run,
            message=f"continuous fan-out closed {who} with {rows} devices",
            index=fanout.index,
            by=by or None,
            devices=rows,
        )
        fanout_progress(run=run, index=fanout.index)
        if fanout.closes_at is not None:
            deadline = Deadline(FANOUT_CLOSE, str(run.pk), fanout.index)
            transaction.on_commit(lambda: deadlines_clear([deadline]))
    return fanout.index


@run_deadline(FANOUT_CLOSE)
def fanout_end_by(run_id: str) -> None:
    """A continuous fan-out's end-by is due: close the run's fan-outs whose end-by passed
    (none when it was closed by hand before: the deadline changes nothing then)."""
    due = ContinuousFanout.objects.filter(run_id=run_id, closed_at=None, closes_at__lte=timezone.now())
    for index in due.values_list("index", flat=True):
        run = JobRun.objects.filter(pk=run_id).first()
        if run is not None:
            fanout_close(run=run, index=index, by="")


def fanouts_overdue_close(*, before: datetime) -> int:
    """Close open fan-outs whose end-by passed before `before` and whose deadline was lost
    (a Redis restart): the monitor's reconcile pass asks, the database being the authority.
    Returns how many runs had one."""
    overdue = ContinuousFanout.objects.filter(closed_at=None, closes_at__lt=before)
    run_ids = sorted({str(run_id) for run_id in overdue.values_list("run_id", flat=True)[:CLOSE_BATCH]})
    for run_id in run_ids:
        fanout_end_by(run_id)
    return len(run_ids)
