"""Shared concurrency limits: which commands a ConcurrencyLimit applies to, and the slots
(devices/lock_slots.py `Slot`) a step row asks for with its device's lock.

The enabled limits are read once and kept for LIMITS_CACHE_SECONDS (forgotten at once in
the process that saves or deletes one; other processes see the change within that time),
so a command no limit applies to costs no query and no Redis round trip of its own: the
slots ride in the device lock's one script call (transition.lua, "slots").
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from django.db.models.signals import post_delete, post_save
from django.utils.translation import gettext as _

from devices.lock_slots import Slot

from .models import ConcurrencyLimit, JobTemplate, LimitScope, StepRun

# How long a process keeps the enabled limits before reading them again.
LIMITS_CACHE_SECONDS = 5.0


@dataclass(frozen=True)
class Limit:
    """An enabled ConcurrencyLimit as the engine reads it."""

    name: str
    label: str
    most: int
    applies_to: str
    match: str
    template_id: int | None  # applies_to "template": the template it names (None: no such)

    def applies(self, *, action: str, template_id: int | None) -> bool:
        if self.applies_to == LimitScope.ALL:
            return True
        if self.applies_to == LimitScope.ACTION:
            return action == self.match
        if self.applies_to == LimitScope.PREFIX:
            return action.startswith(self.match)
        return self.template_id is not None and template_id == self.template_id

    def describe(self) -> str:
        """e.g. limit 'site-downloads' (3 per site)"""
        return _("limit '%(name)s' (%(most)s per %(label)s)") % {
            "name": self.name,
            "most": self.most,
            "label": self.label,
        }


_lock = threading.Lock()
_cached: tuple[float, list[Limit]] | None = None


def limits_enabled() -> list[Limit]:
    """The enabled limits (cached for LIMITS_CACHE_SECONDS)."""
    global _cached
    with _lock:
        if _cached is not None and time.monotonic() - _cached[0] < LIMITS_CACHE_SECONDS:
            return _cached[1]
    rows = list(ConcurrencyLimit.objects.filter(enabled=True).order_by("name"))
    names = {row.match for row in rows if row.applies_to == LimitScope.TEMPLATE}
    templates = dict(JobTemplate.objects.filter(name__in=names).values_list("name", "pk")) if names else {}
    limits = [
        Limit(row.name, row.label, row.max_concurrent, row.applies_to, row.match, templates.get(row.match))
        for row in rows
    ]
    with _lock:
        _cached = (time.monotonic(), limits)
    return limits


def limits_signals_connect() -> None:
    """A limit saved or deleted is read again at once in this process (jobs/apps.py)."""
    post_save.connect(limits_forget, sender=ConcurrencyLimit, dispatch_uid="jobs.limits.saved")
    post_delete.connect(limits_forget, sender=ConcurrencyLimit, dispatch_uid="jobs.limits.deleted")


def limits_forget(**kwargs) -> None:
    """A limit changed: this process reads them again at its next command."""
    global _cached
    with _lock:
        _cached = None


def limits_applying(
    *, action: str, template_id: int | None, labels: dict[str, str]
) -> list[tuple[Limit, str]]:
    """The limits a command applies to, each with the device's label value it counts under
    (a device without the limit's label is not limited by it)."""
    return _applying(limits_enabled(), action=action, template_id=template_id, labels=labels)


def row_slots(row: StepRun, limits: list[Limit]) -> list[Slot]:
    """The slots a step row needs beside its device's lock under `limits` (the enabled
    ones, `limits_enabled`): none when no limit applies."""
    if row.device_id is None or not limits:
        return []
    applying = _applying(limits, action=row.action, template_id=row.run.template_id, labels=row.device.labels)
    return [Slot(limit.name, value, limit.most) for limit, value in applying]


def _applying(
    limits: list[Limit], *, action: str, template_id: int | None, labels: dict[str, str]
) -> list[tuple[Limit, str]]:
    found = []
    for limit in limits:
        value = labels.get(limit.label)
        if value is not None and limit.applies(action=action, template_id=template_id):
            found.append((limit, value))
    return found
