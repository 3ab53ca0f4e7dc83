"""Admin for devices and groups: online state, lock holder and queue length at a glance."""

from __future__ import annotations

import logging

from django.contrib import admin
from django.db.models import Count
from django.utils.html import format_html
from redis import RedisError

from .locks import LockState, device_lock_state, device_lock_states
from .models import Device, DeviceGroup

log = logging.getLogger(__name__)

# How many waiters the device page names; the rest are counted.
QUEUE_NAMED = 10


@admin.register(DeviceGroup)
class DeviceGroupAdmin(admin.ModelAdmin):
    list_display = ["name", "device_count", "description"]
    search_fields = ["name"]

    def get_queryset(self, request):
        return super().get_queryset(request).annotate(device_count=Count("devices"))

    @admin.display(description="devices", ordering="device_count")
    def device_count(self, group: DeviceGroup) -> int:
        return group.device_count


@admin.register(Device)
class DeviceAdmin(admin.ModelAdmin):
    list_display = [
        "name",
        "enabled",
        "online",
        "presence_required",
        "last_seen",
        "lock_holder",
        "queue_length",
        "command_topic",
        "reply_topic",
    ]
    list_filter = ["enabled", "online", "presence_required", "groups"]
    search_fields = ["name", "description"]
    filter_horizontal = ["groups"]
    readonly_fields = ["online", "last_seen", "lock", "created_at", "updated_at"]

    def get_changelist_instance(self, request):
        """The page's lock states in one Redis round trip, kept on its rows for the columns."""
        changelist = super().get_changelist_instance(request)
        devices = list(changelist.result_list)  # evaluates the page once; the template reuses it
        states = self.lock_states_read([device.name for device in devices])
        urls = self.lock_holder_urls([state.holder for state in states.values() if state.holder])
        for device in devices:
            device.lock_state = states.get(device.name)
            device.lock_holder_url = urls.get(device.lock_state.holder) if device.lock_state else None
        return changelist

    def lock_states_read(self, names: list[str]) -> dict[str, LockState]:
        """Lock states from Redis; none (shown as '?') when Redis cannot be reached."""
        try:
            return device_lock_states(names)
        except RedisError as exc:
            log.warning("device list without lock states: %s", exc)
            return {}

    def lock_holder_urls(self, holders: list[str]) -> dict[str, str]:
        """Admin links for lock holders; the jobs app links its step holders to their run."""
        return {}

    @admin.display(description="lock holder")
    def lock_holder(self, device: Device) -> str:
        state = getattr(device, "lock_state", None)
        if state is None:
            return "?"
        if state.holder is None:
            return "free"
        if device.lock_holder_url:
            return format_html('<a href="{}">{}</a>', device.lock_holder_url, state.holder)
        return state.holder

    @admin.display(description="queue")
    def queue_length(self, device: Device) -> str:
        state = getattr(device, "lock_state", None)
        return "?" if state is None else str(len(state.queue))

    @admin.display(description="Lock holder and queue")
    def lock(self, device: Device) -> str:
        """Live from Redis: who executes on the device now and who waits."""
        try:
            state = device_lock_state(device.name)
        except RedisError as exc:
            return f"unknown: Redis unreachable ({exc})"
        if state.holder is None:
            return "free"
        holder = state.holder
        url = self.lock_holder_urls([holder]).get(holder)
        if url:
            holder = format_html('<a href="{}">{}</a>', url, holder)
        waiting = ", ".join(state.queue[:QUEUE_NAMED])
        more = f" and {len(state.queue) - QUEUE_NAMED} more" if len(state.queue) > QUEUE_NAMED else ""
        return format_html(
            "{} (fence {}); {} waiting: {}{}", holder, state.fence, len(state.queue), waiting, more
        )
