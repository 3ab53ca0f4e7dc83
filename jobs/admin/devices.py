"""Devices with their lock holder shown as its run (linked) and step, the steps that wait
for each device and why, and the audited force-release action.

The force-release action ends the holder's attempt, which is engine (jobs) business; the
devices app must not import jobs, so jobs extends the device admin here.
"""

from __future__ import annotations

import logging

from django.contrib import admin, messages
from django.utils.html import format_html, format_html_join
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy
from redis import RedisError

from devices.admin import QUEUE_NAMED, DeviceAdmin
from devices.locks import holder_name
from devices.models import Device

from ..cancel import lock_force_release
from ..engine.plan import HOLDER_KIND
from ..models import StepRun
from ..waiting import StepRef, devices_work, steps_waiting
from .dashboard import DeviceStateFilter
from .display import run_url, waiting_html

log = logging.getLogger(__name__)

admin.site.unregister(Device)


@admin.register(Device)
class DeviceWithLockAdmin(DeviceAdmin):
    actions = [*DeviceAdmin.actions, "force_release_lock"]
    # The dashboard's fleet numbers link here filtered by state (online, busy, ...).
    list_filter = [DeviceStateFilter, *DeviceAdmin.list_filter]

    class Media:
        css = {"all": ["jobs/admin.css"]}

    def devices_describe(self, devices: list[Device]) -> None:
        """The page's devices' work (`devices_work`: one Redis round trip, one query): the
        step holding each, linked to its run, and how many steps wait for it, in its lock
        queue or for it to come online."""
        try:
            work = devices_work([device.name for device in devices])
        except RedisError as exc:
            log.warning("device list without lock states: %s", exc)
            work = {}
        for device in devices:
            item = work.get(device.name)
            device.lock_state = item.lock if item else None
            device.lock_holder_html = step_ref_html(item.holder) if item and item.holder else None
            device.waiting = item.queue_length if item else None

    @admin.display(description=gettext_lazy("Lock holder and queue"))
    def lock(self, device: Device) -> str:
        """Live: the step holding the device (its run linked), then every step waiting for it
        in the order it gets the device (its lock queue, then those waiting for it to come
        online, oldest first), each with why it waits."""
        if device.pk is None:
            return "-"
        try:
            work = devices_work([device.name])[device.name]
        except RedisError as exc:
            return _("unknown: Redis unreachable (%(error)s)") % {"error": exc}
        holder = step_ref_html(work.holder) if work.holder else work.lock.holder or _("free")
        if work.lock.holder:
            fence = _("fence %(fence)s") % {"fence": work.lock.fence}
            holder = format_html('{} <span class="iq-quiet">({})</span>', holder, fence)
        if not work.queue_length:
            return format_html("{}<br>{}", holder, _("Nobody waits."))
        named = work.queued[:QUEUE_NAMED]
        rows = StepRun.objects.filter(pk__in=[ref.step_run for ref in named]).select_related("run", "device")
        try:
            reasons = steps_waiting(rows)
        except RedisError:
            reasons = {}
        queued = format_html_join(
            "",
            "<li>{}<br>{}</li>",
            ((step_ref_html(ref), waiting_html(reasons.get(ref.step_run))) for ref in named),
        )
        others = format_html_join("", "<li>{}</li>", ((other,) for other in work.others))
        more = len(work.queued) - len(named)
        return format_html(
            '{}<br>{}<ol class="iq-queue">{}{}</ol>{}',
            holder,
            _("%(count)s waiting, in order:") % {"count": work.queue_length},
            queued,
            others,
            _("and %(count)s more") % {"count": more} if more > 0 else "",
        )

    @admin.action(description=gettext_lazy("Force-release the device lock (audited)"), permissions=["change"])
    def force_release_lock(self, request, queryset):
        for device in queryset:
            holder = lock_force_release(device=device, by=request.user.username)
            if holder:
                taken = _("%(device)s: lock taken from %(holder)s.") % {
                    "device": device.name,
                    "holder": holder,
                }
                self.message_user(request, taken, messages.WARNING)
            else:
                free = _("%(device)s: lock was free.") % {"device": device.name}
                self.message_user(request, free, messages.INFO)


def step_ref_html(ref: StepRef) -> str:
    """A step for people: its run (linked, the lock holder's name on hover) and template,
    then its step and action."""
    step = _("step #%(index)s %(action)s") % {"index": ref.index, "action": ref.action}
    return format_html(
        '<a href="{}" title="{}">{}</a> {}<br><span class="iq-quiet">{}</span>',
        run_url(ref.run),
        holder_name(HOLDER_KIND, ref.step_run),
        _("run %(run)s") % {"run": str(ref.run)[:8]},
        ref.template,
        step,
    )
