"""Devices with their lock holder linked to its run, and the audited force-release action.

The force-release action ends the holder's attempt, which is engine (jobs) business; the
devices app must not import jobs, so jobs extends the device admin here.
"""

from __future__ import annotations

from django.contrib import admin, messages

from devices.admin import DeviceAdmin
from devices.locks import holder_parse
from devices.models import Device

from ..cancel import lock_force_release
from ..engine.plan import HOLDER_KIND
from ..models import StepRun
from .dashboard import DeviceStateFilter
from .display import run_url

admin.site.unregister(Device)


@admin.register(Device)
class DeviceWithLockAdmin(DeviceAdmin):
    actions = [*DeviceAdmin.actions, "force_release_lock"]
    # The dashboard's fleet numbers link here filtered by state (online, busy, ...).
    list_filter = [DeviceStateFilter, *DeviceAdmin.list_filter]

    def lock_holder_urls(self, holders: list[str]) -> dict[str, str]:
        """Step holders link to their run's page (one query for the whole page)."""
        steps = {}
        for holder in holders:
            kind, ident = holder_parse(holder)
            if kind == HOLDER_KIND and ident.isdigit():
                steps[holder] = int(ident)
        if not steps:
            return {}
        runs = dict(StepRun.objects.filter(pk__in=steps.values()).values_list("pk", "run_id"))
        return {holder: run_url(runs[pk]) for holder, pk in steps.items() if pk in runs}

    @admin.action(description="Force-release the device lock (audited)", permissions=["change"])
    def force_release_lock(self, request, queryset):
        for device in queryset:
            holder = lock_force_release(device=device, by=request.user.username)
            if holder:
                self.message_user(request, f"{device.name}: lock taken from {holder}.", messages.WARNING)
            else:
                self.message_user(request, f"{device.name}: lock was free.", messages.INFO)
